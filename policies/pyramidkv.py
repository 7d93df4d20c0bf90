"""PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", arXiv:2406.02069): SnapKV's scores with layer budgets that shrink from the bottom layers
to the top ones, keeping the same total."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.policies.snapkv import SnapKV
from kvlab.registry import POLICIES


@POLICIES.register("pyramidkv")
@dataclass
class PyramidKV(SnapKV):
    """beta: the top layer keeps 1/beta of the mean budget (the paper's 20).

    Budgets as the PyramidKV reference code and kvpress compute them, with c the uniform budget (`budget`,
    or n(1 - compression_ratio) unrounded), w the window and L layers: min = c / beta, max = 2c - min;
    if max >= n - w then max = n - w and min = 2c - max. Layer l keeps round(max - l (max - min) / (L - 1))
    (falling linearly with depth; the mean over layers is c). Unless n >= max >= min >= w every layer keeps
    max(1, round(c)): Python's round (half to even) -- the only policy that rounds instead of truncating.
    """

    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta >= 1:
            raise ValueError(f"beta must be >= 1, got {self.beta!r}")

    def layer_budget(self, layer_idx: int, num_layers: int, num_tokens: int) -> int:
        n, w = num_tokens, self.window_size
        c = float(self.budget) if self.budget is not None else n * (1.0 - (self.compression_ratio or 0.0))
        if c >= n:  # the uniform budget covers the sequence: nothing to compress anywhere
            return n
        low = c / self.beta
        high = 2 * c - low
        if high >= n - w:
            high = n - w
            low = 2 * c - high
        if not n >= high >= low >= w:
            return min(n, max(1, round(c)))
        frac = layer_idx / (num_layers - 1) if num_layers > 1 else 0.0
        return min(n, max(1, round(high - (high - low) * frac)))

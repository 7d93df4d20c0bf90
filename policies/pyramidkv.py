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
    """beta: the top layer keeps 1/beta of the mean budget (the paper's 20); budgets fall linearly with
    depth from 2 * mean - mean / beta at the bottom, so the mean over layers is the uniform budget
    (layers whose share exceeds the sequence keep it all; no layer keeps less than the window)."""

    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta >= 1:
            raise ValueError(f"beta must be >= 1, got {self.beta!r}")

    def layer_budget(self, layer_idx: int, num_layers: int, num_cached: int) -> int:
        mean = super().layer_budget(layer_idx, num_layers, num_cached)
        if mean >= num_cached:  # the uniform budget covers the sequence: nothing to compress anywhere
            return num_cached
        low = mean / self.beta
        high = 2 * mean - low
        frac = layer_idx / (num_layers - 1) if num_layers > 1 else 0.0
        return max(min(num_cached, int(high - (high - low) * frac)), min(num_cached, self.window_size, mean))

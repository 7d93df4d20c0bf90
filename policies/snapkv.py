"""SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
arXiv:2404.14469): the last `window_size` queries vote for the keys they attend to; votes are pooled
so neighbours of a chosen token come along; the window itself is always kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.policies.base import Policy
from kvlab.policies.observation import window_attention
from kvlab.registry import POLICIES


@POLICIES.register("snapkv")
@dataclass
class SnapKV(Policy):
    """window_size: observation-window queries (kvpress's default 64); kernel_size: pooling width (5)."""

    window_size: int = 64
    kernel_size: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("window_size", "kernel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (centred pooling), got {self.kernel_size}")

    @property
    def query_window(self) -> int:
        return self.window_size

    def score(self, layer_idx, keys, values, queries, attn_stats):
        return snap_scores(queries, keys, self.kernel_size)


def snap_scores(queries: torch.Tensor, keys: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """[L, Hkv]: the window's mean attention over the keys before the window, pooled with a centred
    average of `kernel_size` (zero padding counted, as kvpress does); the window's own keys score above
    every vote (more recent higher, for a budget smaller than the window: kvpress refuses that case)."""
    if queries.shape[0] > keys.shape[0]:  # fewer tokens cached than the window (a budget below it): their queries
        queries = queries[-keys.shape[0]:]
    W, L = queries.shape[0], keys.shape[0]
    probs = window_attention(queries, keys)  # [Hkv, g, W, L]: softmax over every key, window included
    votes = probs[..., : L - W].mean(dim=(1, 2))  # [Hkv, L - W]
    if L > W:
        votes = F.avg_pool1d(votes[:, None], kernel_size, padding=kernel_size // 2, stride=1)[:, 0]  # [Hkv, L - W]
    top = votes.max() + 1.0 if votes.numel() else torch.ones((), device=keys.device)
    window = top + torch.arange(W, device=keys.device, dtype=votes.dtype) / W  # [W]
    return torch.cat([votes, window.expand(votes.shape[0], W)], dim=1).T  # [L, Hkv]

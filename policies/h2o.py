"""H2O, the heavy-hitter oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative
Inference of Large Language Models", arXiv:2306.14048): keep the tokens that have received the most
attention so far, summed over every query since they were cached, plus the most recent ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.policies.base import Policy
from kvlab.registry import POLICIES


@POLICIES.register("h2o")
@dataclass
class H2O(Policy):
    """recent: the most recent tokens always kept (the paper splits the budget between heavy hitters and a
    recent window; here `recent` tokens of the budget go to the window). Best used with when="decode".

    The engine accumulates each cached key's attention mass in every layer's table, or in every (layer, KV
    head)'s under per-head budgets (adakv with scorer h2o: each head's own mass), from the attention-statistics
    output of the paged-attention kernels or their torch reference, which costs a second pass over the keys in
    every step on the torch path.
    """

    recent: int = 16
    needs_attention_stats: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.recent, bool) or not isinstance(self.recent, int) or self.recent < 0:
            raise ValueError(f"recent must be an integer >= 0, got {self.recent!r}")

    def score(self, layer_idx, keys, values, queries, attn_stats):
        if attn_stats is None:
            raise RuntimeError("h2o needs accumulated attention statistics, and the engine passed none")
        score = attn_stats.float().clone()  # [L, Hkv] attention received so far
        if self.recent:
            score[-self.recent:] = torch.inf
        return score

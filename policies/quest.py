"""Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
arXiv:2406.10774): keep every page, and at each decode step read only the pages whose keys could
score highest against the step's query, bounded from per-page channel-wise key min and max."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.policies.base import Policy
from kvlab.registry import POLICIES
from kvlab.policies.sparse_read import SparseReadPolicy


@POLICIES.register("quest")
@dataclass
class Quest(SparseReadPolicy, Policy):
    """budget: tokens read per decode step per layer (required): `budget // block_size` pages, always
    the first (attention-sink) page and the page holding the newest token. Nothing is evicted: the
    pool holds what the full cache holds; prefill, scoring and windowed layers stay dense.

    Criticality of page p for query head h (the paper's upper bound on q . k over the page's keys):
    U[h, p] = sum_d max(q_d * min_d, q_d * max_d). The paper selects pages per head; here a sequence's
    table is shared by the KV heads of a layer, so the heads are aggregated: each head's bounds become
    a softmax over pages (the attention mass the page could draw, `scale * U` plus the log of its token
    count), summed over all query heads, and the top pages of the sum are read.

    dense_layers: the first layers read densely (the paper leaves the first two layers dense: their
    attention is not sparse enough).

    `compression_ratio`, `when` and `every` (eviction schedules) do not apply: a ratio is refused,
    `when` / `every` are accepted and ignored (as by `full`), so sweeps over policies can pass them.
    """

    dense_layers: int = 2

    compresses: ClassVar[bool] = False  # nothing is evicted: the cache layout is the full cache's

    def __post_init__(self) -> None:
        if self.compression_ratio is not None:
            raise ValueError("quest reads `budget` tokens per decode step; compression_ratio is not supported, "
                             "give a budget")
        if self.budget is None:
            raise ValueError("quest needs a budget (tokens read per decode step per layer)")
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"budget must be an integer >= 1 (tokens read per decode step), got {self.budget!r}")
        if isinstance(self.dense_layers, bool) or not isinstance(self.dense_layers, int) or self.dense_layers < 0:
            raise ValueError(f"dense_layers must be an integer >= 0, got {self.dense_layers!r}")

    def reads_sparsely(self, layer_idx: int) -> bool:
        return layer_idx >= self.dense_layers

    def pages_read(self, block_size: int) -> int:
        pages = self.budget // block_size
        if pages < 2:
            raise ValueError(f"quest reads the sink page and the newest page at least: budget must be >= "
                             f"2 * block_size = {2 * block_size} tokens, got {self.budget}")
        return pages

    def page_scores(self, layer_idx, q, bounds, counts, scale):
        mass = quest_page_mass(q, bounds, counts, scale)  # [S, NB]
        mass[:, 0] = math.inf  # the sink page is always read
        return mass

    def score(self, layer_idx, keys, values, queries, attn_stats):
        return None  # never called: quest evicts nothing


def quest_bounds(q: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """q [S, Hq, D], bounds [S, NB, Hkv, 2D] ([max | -min]) -> U [S, Hkv, g, NB]:
    sum_d max(q_d min_d, q_d max_d) = [q+, (-q)+] . [max | -min] (g = Hq / Hkv query heads per KV head)."""
    S, Hq, D = q.shape
    Hkv = bounds.shape[2]
    qg = q.float().view(S, Hkv, Hq // Hkv, D)
    q2 = torch.cat([qg.clamp(min=0), qg.neg().clamp(min=0)], dim=-1)  # [S, Hkv, g, 2D]
    return torch.matmul(q2, bounds.float().permute(0, 2, 3, 1))  # [S, Hkv, g, NB]


def quest_page_mass(q, bounds, counts, scale) -> torch.Tensor:
    """[S, NB]: per query head, softmax over pages of scale * U + log(count); summed over heads."""
    logits = quest_bounds(q, bounds) * scale + counts.float().log()[:, None, None, :]  # empty pages: -inf
    return logits.softmax(dim=-1).sum(dim=(1, 2))

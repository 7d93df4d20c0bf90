"""The cache-policy interface: which cached tokens a sequence keeps.

kvpress's `ScorerPress` shape: the narrowest hook is `score` (one number per cached token per KV
head, higher = keep); the base class owns the budget (`budget` tokens kept per sequence per layer,
or kvpress's `compression_ratio`, the fraction removed), the top-k and the schedule (`when`). The
engine (kvlab.compressor) gathers a layer's cached keys and values, asks the policy which cache
indices to keep, and compacts the survivors into fewer pages through the block manager, so the
pages freed go back to the shared pool. Positions are untouched: kept tokens keep their RoPE
positions.

Lower-level hooks for policies that need more: `select` (the kept indices of one layer; override
for chunk-level or structured selection) and `layer_budget` (per-layer budget schedules, e.g.
PyramidKV). Wrappers compose by holding another policy.

The kept set is shared by the KV heads of a layer (scores are summed over heads), so the memory
freed is real; per-KV-head budgets (AdaKV) need tables per head and are not supported yet.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.registry import POLICIES

WHEN = ("prefill", "chunk", "decode")


@dataclass
class Policy(ABC):
    """Base class of eviction / compression policies; subclasses are dataclasses of their parameters."""

    budget: int | None = None  # tokens kept per sequence per layer (None: use compression_ratio)
    compression_ratio: float | None = None  # fraction of cached tokens removed (kvpress's convention; neither given: 0)
    when: str = "prefill"  # "prefill": once the prompt is in; "chunk": after every prefill chunk; "decode": also while decoding
    every: int = 64  # with when="decode": compress again after this many decode steps

    compresses: ClassVar[bool] = True  # False: the engine never calls the policy (full cache)
    needs_attention_stats: ClassVar[bool] = False  # True: the engine accumulates, per cached key, the attention
    # mass it received from every query since it was cached, and passes it to `score` as `attn_stats`

    @property
    def query_window(self) -> int:
        """Recent queries per layer `score` needs (0: none); the engine records them while computing."""
        return 0

    def __post_init__(self) -> None:
        if not self.compresses:
            return
        if self.budget is not None and self.compression_ratio is not None:
            raise ValueError(f"{type(self).__name__}: give a budget or a compression_ratio, not both")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 1):
            raise ValueError(f"budget must be an integer >= 1 (tokens kept per layer), got {self.budget!r}")
        if self.compression_ratio is not None and not 0.0 <= self.compression_ratio < 1.0:
            raise ValueError(f"compression_ratio must be in [0, 1) (fraction removed), got {self.compression_ratio!r}")
        if self.when not in WHEN:
            raise ValueError(f"when must be one of {', '.join(WHEN)}, got {self.when!r}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be an integer >= 1 (decode steps), got {self.every!r}")

    # -- the budget --------------------------------------------------------------
    def layer_budget(self, layer_idx: int, num_layers: int, num_cached: int) -> int:
        """Tokens one layer keeps out of `num_cached` (kvpress: max(1, int(n * (1 - ratio))))."""
        if self.budget is not None:
            return min(num_cached, self.budget)
        return min(num_cached, max(1, int(num_cached * (1.0 - (self.compression_ratio or 0.0)))))

    # -- the hooks ---------------------------------------------------------------
    @abstractmethod
    def score(
        self,
        layer_idx: int,
        keys: torch.Tensor,  # [L, Hkv, D] cached keys of one sequence (RoPE applied)
        values: torch.Tensor,  # [L, Hkv, D]
        queries: torch.Tensor | None,  # [W, Hq, D] the last `query_window` queries of this layer, if asked for
        attn_stats: torch.Tensor | None,  # [L, Hkv] attention mass each key received, if collected
    ) -> torch.Tensor | None:  # [L, Hkv] importance, or None to keep everything
        """Importance of every cached token per KV head."""

    def select(self, layer_idx: int, num_layers: int, keys: torch.Tensor, values: torch.Tensor,
               queries: torch.Tensor | None, attn_stats: torch.Tensor | None) -> list[int] | None:
        """Sorted cache indices one layer keeps, or None to keep all (default: top-k of the summed score)."""
        n = keys.shape[0]
        keep = self.layer_budget(layer_idx, num_layers, n)
        if keep >= n:
            return None
        scores = self.score(layer_idx, keys, values, queries, attn_stats)  # [L, Hkv]
        if scores is None:
            return None
        return sorted(scores.float().sum(dim=-1).topk(keep).indices.tolist())


POLICIES.base = Policy

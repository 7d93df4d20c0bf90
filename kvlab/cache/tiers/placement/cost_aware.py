"""Cost-aware placement: restore a page only where copying it back beats recomputing it.

A page of `block_size` tokens costs `block_size / prefill_tokens_per_s` seconds to recompute (a prefill of
its tokens; attention over the prefix before it is ignored, which favours recomputing short histories)
and `page_bytes / bandwidth` to restore from a tier (`host_bytes_per_s`, `disk_bytes_per_s`: measured copy
rates, e.g. by experiments/bench_kv_tiers.py). A page goes to the fastest tier where restoring is at least
`margin` times cheaper than recomputing; where no tier is, it is dropped (recomputed if it is needed
again). A full tier's victim is its least recently inserted page, spilled to the next tier only if that
tier passes the same test. In the spirit of LMCache's and Mooncake's store-vs-recompute trade-off
(Cheng et al. 2024, arXiv:2409.13761; Qin et al. 2024, arXiv:2407.00079).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.cache.tiers.placement.base import Key
from kvlab.cache.tiers.placement.lru import LRUPlacement
from kvlab.registry import PLACEMENTS


@PLACEMENTS.register("cost_aware")
@dataclass
class CostAwarePlacement(LRUPlacement):
    """LRU within a tier; a tier is used only where restoring beats recomputing by `margin`."""

    host_bytes_per_s: float = 5e9  # copy rate host tier -> pool
    disk_bytes_per_s: float = 1e9  # read rate disk tier -> pool (page cache warm or not)
    prefill_tokens_per_s: float = 500.0  # recompute rate of the model on this machine
    margin: float = 1.0  # restore only when it is this many times cheaper than recomputing

    def __post_init__(self) -> None:
        for name in ("host_bytes_per_s", "disk_bytes_per_s", "prefill_tokens_per_s", "margin"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost_aware.{name} must be > 0, got {getattr(self, name)}")

    def restore_seconds(self, tier: int) -> float:
        rate = self.host_bytes_per_s if self.kinds[tier] == "host" else self.disk_bytes_per_s
        return self.page_bytes / rate

    def recompute_seconds(self) -> float:
        return self.block_size / self.prefill_tokens_per_s

    def worth(self, tier: int) -> bool:
        """Is restoring a page from `tier` at least `margin` times cheaper than recomputing it?"""
        return self.restore_seconds(tier) * self.margin <= self.recompute_seconds()

    def where(self, key: Key) -> int | None:
        return next((t for t in range(len(self.kinds)) if self.worth(t)), None)

    def spill(self, key: Key, tier: int) -> int | None:
        return next((t for t in range(tier + 1, len(self.kinds)) if self.worth(t)), None)

"""Cost-aware placement: restore a page only where copying it back beats recomputing it.

Two decisions, one cost model. Where a page leaving the pool goes: the fastest tier where restoring one page
(`restore_seconds(tier, 1)`) is at least `margin` times cheaper than recomputing its `block_size` tokens; where no
tier is, it is dropped. And when a hit would take pages back from the tiers (`restore_pays`): restore them only if
that costs less than recomputing the tokens they hold, else the hit stops before them and they are recomputed.

    recompute(tokens)      = tokens / prefill_tokens_per_s          (the marginal cost: the step runs anyway)
    restore(tier, pages)   = latency_s[tier] + pages * page_bytes / bytes_per_s[tier]

The fixed term is what makes a crossover: a restore pays a latency whatever its size (the bookkeeping, the
reads' system calls), so below some history length (`crossover_tokens`) recomputing is cheaper. With `measured`
(the default) the rates are the engine's own as it runs: the recompute rate is the slope of a least-squares line
through the recent steps' (tokens, forward seconds), so a step's fixed cost does not count; each tier's latency
and per-page time are a line through its recent restores (pages, seconds: the copy and the file reads). The
parameters below are the priors used until there are samples. A full tier's victim is its least recently inserted page, spilled to the next tier only if
that tier passes the same test. In the spirit of LMCache's and Mooncake's store-vs-recompute trade-off (Cheng et
al. 2024, arXiv:2409.13761; Qin et al. 2024, arXiv:2407.00079).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvlab.cache.tiers.placement.base import Key
from kvlab.cache.tiers.placement.lru import LRUPlacement
from kvlab.registry import PLACEMENTS


@PLACEMENTS.register("cost_aware")
@dataclass
class CostAwarePlacement(LRUPlacement):
    """LRU within a tier; a tier is used, and a hit restored from it, only where restoring beats recomputing."""

    host_bytes_per_s: float = 5e9  # prior: copy rate host tier -> pool
    disk_bytes_per_s: float = 1e9  # prior: read rate disk tier -> pool (page cache warm or not)
    prefill_tokens_per_s: float = 500.0  # prior: recompute rate of the model on this machine
    host_latency_s: float = 2e-4  # prior: fixed cost of a restore from the host tier
    disk_latency_s: float = 2e-3  # prior: fixed cost of a restore from the disk tier (a read ahead's step)
    margin: float = 1.0  # restore only when it is this many times cheaper than recomputing
    measured: bool = True  # replace the priors by the engine's observed rates
    samples: dict = field(default_factory=dict, init=False, repr=False)  # tier -> deque of (pages, seconds)
    compute: deque = field(default_factory=lambda: deque(maxlen=64), init=False, repr=False)  # (tokens, seconds)

    def __post_init__(self) -> None:
        for name in ("host_bytes_per_s", "disk_bytes_per_s", "prefill_tokens_per_s", "margin"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost_aware.{name} must be > 0, got {getattr(self, name)}")
        for name in ("host_latency_s", "disk_latency_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost_aware.{name} must be >= 0, got {getattr(self, name)}")

    # -- the cost model ------------------------------------------------------------
    def _prior(self, tier: int) -> tuple[float, float]:
        """(latency s, seconds per page) of `tier` before any restore was observed."""
        host = self.kinds[tier] == "host"
        rate = self.host_bytes_per_s if host else self.disk_bytes_per_s
        return (self.host_latency_s if host else self.disk_latency_s), self.page_bytes / rate

    def restore_line(self, tier: int) -> tuple[float, float]:
        """(latency s, seconds per page) of restores from `tier`: a least-squares line through the observed
        (pages, seconds) when they span two sizes, else the prior's latency with the observed mean rate."""
        latency, per_page = self._prior(tier)
        obs = self.samples.get(tier, ())
        if not self.measured or not obs:
            return latency, per_page
        line = fit(obs)
        if line is None:
            mx, my = sum(x for x, _ in obs) / len(obs), sum(y for _, y in obs) / len(obs)
            return min(latency, my), max(my - latency, 0.0) / mx
        return line

    def restore_seconds(self, tier: int, pages: int = 1) -> float:
        latency, per_page = self.restore_line(tier)
        return latency + pages * per_page

    def tokens_per_s(self) -> float:
        """The marginal recompute rate: the slope of the observed steps' line (the prior until it exists)."""
        line = fit(self.compute) if self.measured else None
        return 1 / line[1] if line is not None and line[1] > 0 else self.prefill_tokens_per_s

    def recompute_seconds(self, tokens: int | None = None) -> float:
        return (self.block_size if tokens is None else tokens) / self.tokens_per_s()

    def worth(self, tier: int) -> bool:
        """Is restoring a page from `tier` at least `margin` times cheaper than recomputing it (per page, the
        latency spread over a run)?"""
        return self.restore_line(tier)[1] * self.margin <= self.recompute_seconds()

    def crossover_tokens(self, tier: int) -> float:
        """History length (tokens) above which restoring from `tier` beats recomputing (inf: never)."""
        latency, per_page = self.restore_line(tier)
        per_token = 1 / self.tokens_per_s() - self.margin * per_page / self.block_size
        return self.margin * latency / per_token if per_token > 0 else float("inf")

    # -- decisions -------------------------------------------------------------------
    def where(self, key: Key) -> int | None:
        return next((t for t in range(len(self.kinds)) if self.worth(t)), None)

    def spill(self, key: Key, tier: int) -> int | None:
        return next((t for t in range(tier + 1, len(self.kinds)) if self.worth(t)), None)

    def restore_pays(self, pages: dict[int, int], tokens: int) -> bool:
        cost = sum(self.restore_seconds(t, n) for t, n in pages.items())
        return cost * self.margin <= self.recompute_seconds(tokens)

    def observe_compute(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.compute.append((tokens, seconds))

    def observe_restore(self, tier: int, pages: int, seconds: float) -> None:
        self.samples.setdefault(tier, deque(maxlen=32)).append((pages, seconds))


def fit(points) -> tuple[float, float] | None:
    """(intercept >= 0, slope) of the least-squares line through (x, y) points; None unless two x differ."""
    points = list(points)
    if len({x for x, _ in points}) < 2:
        return None
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    if slope <= 0:
        return my, 0.0
    return max(my - slope * mx, 0.0), slope

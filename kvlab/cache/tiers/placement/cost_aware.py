"""Cost-aware placement: keep and restore a page only where that beats recomputing it.

Two decisions, one cost model (kvlab.cache.tiers.placement.cost_model: a pure function of rates and page counts).
Where a page leaving the pool goes: the fastest tier where keeping one page there (its demotion as the step pays
it, then its restore) is at least `margin` times cheaper than recomputing its `block_size` tokens; where no tier
is, it is dropped. And when a hit would take pages back from the tiers (`restore_pays`): restore them only if
that costs less than recomputing the tokens they hold (a restore's fixed latency, the reads ahead waited for
included, makes the crossover), else the hit stops before them and they are recomputed.

With `measured` (the default) the rates are the engine's own: the recompute cost is the curve through the
fastest forward of each size (noise on a shared machine only ever adds time) of the engine's start-up
calibration (`compute_sizes`: rounds of forwards of `block_size`, max(8 x `block_size`, 64) and
max(32 x `block_size`, 256) tokens timed before any request, at least `calibration_repeats`, more while within
`calibration_budget_s`): a parabola where it bends upward (a prefill's attention part grows with the square of
its length), else a straight line; without a calibration a Theil-Sen line through its recent steps, so a step's
fixed cost does not count and one slow step does not swing it; each tier's latency and
per-page time are a line through its restores (start-up calibration, `PagedKV.calibrate`, cold reads with
`cold_calibration`, then every real restore: the copy and the wall time of its reads ahead), its demotion cost
the median of the last `put`s on the step's thread plus `behind_share` of the tier's work for a page behind it
(a disk tier's file write on its writer thread and the file's later removal, in CPU seconds: on two shared cores
the writer runs on the step's time; tier_restore_cost.md measured the put alone at a fraction of what the step
pays). The parameters below are the priors used until there are samples. A full tier's victim is its least recently
inserted page, spilled to the next tier only if that tier passes the same test. In the spirit of LMCache's and
Mooncake's store-vs-recompute trade-off (Cheng et al. 2024, arXiv:2409.13761; Qin et al. 2024, arXiv:2407.00079).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import kvlab.cache.tiers.placement.cost_model as cost_model
from kvlab.cache.tiers.placement.base import Key
from kvlab.cache.tiers.placement.cost_model import Rates, fit, median, theil_sen  # noqa: F401 (fit: re-exported)
from kvlab.cache.tiers.placement.lru import LRUPlacement
from kvlab.registry import PLACEMENTS


MIN_PER_TOKEN_S = 1e-9  # the floor of the measured marginal recompute cost


@PLACEMENTS.register("cost_aware")
@dataclass
class CostAwarePlacement(LRUPlacement):
    """LRU within a tier; a tier is used, and a hit restored from it, only where restoring beats recomputing."""

    host_bytes_per_s: float = 5e9  # prior: copy rate host tier -> pool
    disk_bytes_per_s: float = 1e9  # prior: read rate disk tier -> pool (page cache warm or not)
    prefill_tokens_per_s: float = 500.0  # prior: recompute rate of the model on this machine
    host_latency_s: float = 2e-4  # prior: fixed cost of a restore from the host tier
    disk_latency_s: float = 2e-3  # prior: fixed cost of a restore from the disk tier (a read ahead's round trip)
    margin: float = 1.0  # restore only when it is this many times cheaper than recomputing
    measured: bool = True  # replace the priors by the engine's observed rates
    calibration_repeats: int = 3  # start-up rounds of forwards timed at least (0 with calibration_rounds=0: none)
    calibration_rounds: int = 30  # ... at most, while within calibration_budget_s
    calibration_budget_s: float = 0.1  # seconds of start-up forwards beyond the first calibration_repeats rounds
    cold_calibration: bool = False  # the start-up restores read cold files (synced, dropped from the OS page
    # cache: PagedKV.calibrate): pages that come back long after they went down
    behind_share: float = 1.0  # share of a tier's work behind the step (file write, removal: CPU seconds on its
    # writer thread) a demotion is charged: 1 where no core is free for it (a shared CPU machine), 0 where one is
    samples: dict = field(default_factory=dict, init=False, repr=False)  # tier -> deque of (pages, seconds)
    demotes: dict = field(default_factory=dict, init=False, repr=False)  # tier -> deque of seconds per page
    behind: dict = field(default_factory=dict, init=False, repr=False)  # tier -> its work behind the step a page
    compute: deque = field(default_factory=lambda: deque(maxlen=32), init=False, repr=False)  # (tokens, seconds)
    calibration: list = field(default_factory=list, init=False, repr=False)  # start-up (tokens, seconds)
    _cache: dict = field(default_factory=dict, init=False, repr=False)  # fitted lines until the next sample

    def __post_init__(self) -> None:
        for name in ("host_bytes_per_s", "disk_bytes_per_s", "prefill_tokens_per_s", "margin"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost_aware.{name} must be > 0, got {getattr(self, name)}")
        for name in ("host_latency_s", "disk_latency_s", "calibration_repeats", "calibration_rounds",
                     "calibration_budget_s", "behind_share"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost_aware.{name} must be >= 0, got {getattr(self, name)}")

    # -- the rates -----------------------------------------------------------------
    def _prior(self, tier: int) -> tuple[float, float]:
        """(latency s, seconds per page) of `tier` before any restore was observed."""
        host = self.kinds[tier] == "host"
        rate = self.host_bytes_per_s if host else self.disk_bytes_per_s
        return (self.host_latency_s if host else self.disk_latency_s), self.page_bytes / rate

    def restore_line(self, tier: int) -> tuple[float, float]:
        """(latency s, seconds per page) of restores from `tier`: a Theil-Sen line through the observed
        (pages, seconds) when they span two sizes, else the prior's latency with the observed mean rate."""
        if ("restore", tier) not in self._cache:
            latency, per_page = self._prior(tier)
            obs = self.samples.get(tier, ())
            line = theil_sen(obs) if self.measured and obs else (latency, per_page)
            if line is None:
                mx, my = sum(x for x, _ in obs) / len(obs), sum(y for _, y in obs) / len(obs)
                line = min(latency, my), max(my - latency, 0.0) / mx
            self._cache[("restore", tier)] = line
        return self._cache[("restore", tier)]

    def demote_seconds(self, tier: int) -> float:
        """Seconds per page the step pays to demote into `tier`: the median of the recent `put`s on its thread
        (0 until seen) plus `behind_share` of the tier's own work for the page off that thread (its file write
        behind and the file's removal, `observe_behind`)."""
        if not self.measured:
            return 0.0
        obs = self.demotes.get(tier)
        return (median(list(obs)) if obs else 0.0) + self.behind_share * self.behind.get(tier, 0.0)

    def compute_curve(self) -> tuple[float, float]:
        """(seconds per token, per token squared) of a prefill: the parabola through the fastest calibration
        forward of each of three sizes where it bends upward (the attention's part), else the straight line's
        slope (`tokens_per_s`) and no quadratic part."""
        if "curve" not in self._cache:
            curve = cost_model.floor_curve(self.calibration) if self.measured else None
            self._cache["curve"] = (max(curve[1], MIN_PER_TOKEN_S), curve[2]) if curve is not None else \
                (1 / self.tokens_per_s(), 0.0)
        return self._cache["curve"]

    def tokens_per_s(self) -> float:
        """The marginal recompute rate: the slope of the line through the fastest calibration forward of each
        size (a shared machine's noise only ever adds time), else of the observed steps' Theil-Sen line (the prior
        until either exists); a slope not above `MIN_PER_TOKEN_S` (a token costs nothing measurable beyond the
        step's fixed cost) counts as that floor: recomputing is then all but free."""
        if "compute" not in self._cache:
            line = cost_model.floor_line(self.calibration) or theil_sen(self.compute) if self.measured else None
            self._cache["compute"] = 1 / max(line[1], MIN_PER_TOKEN_S) if line is not None else self.prefill_tokens_per_s
        return self._cache["compute"]

    def rates(self) -> Rates:
        """The cost model's inputs now (kvlab.cache.tiers.placement.cost_model)."""
        per_token, per_token2 = self.compute_curve()
        return Rates(per_token, {t: self.restore_line(t) for t in range(len(self.kinds))},
                     {t: self.demote_seconds(t) for t in range(len(self.kinds))}, per_token2)

    def restore_seconds(self, tier: int, pages: int = 1) -> float:
        return cost_model.restore_seconds(self.rates(), {tier: pages})

    def recompute_seconds(self, tokens: int | None = None, start: int = 0) -> float:
        return cost_model.recompute_seconds(self.rates(), self.block_size if tokens is None else tokens, start)

    def worth(self, tier: int) -> bool:
        return cost_model.worth(self.rates(), tier, self.block_size, self.margin)

    def crossover_tokens(self, tier: int) -> float:
        """History length (tokens) above which restoring from `tier` beats recomputing (inf: never)."""
        return cost_model.crossover_tokens(self.rates(), tier, self.block_size, self.margin)

    # -- decisions -------------------------------------------------------------------
    def where(self, key: Key) -> int | None:
        return next((t for t in range(len(self.kinds)) if self.worth(t)), None)

    def spill(self, key: Key, tier: int) -> int | None:
        return next((t for t in range(tier + 1, len(self.kinds)) if self.worth(t)), None)

    def restore_pays(self, pages: dict[int, int], tokens: int, start: int = 0) -> bool:
        return cost_model.restore_pays(self.rates(), pages, tokens, self.margin, start)

    # -- what the engine tells it ----------------------------------------------------
    def compute_sizes(self) -> tuple[int, ...]:
        """The next calibration round: a short, a middle and a long forward (three sizes: the prefill's quadratic
        part is seen; the engine cuts one beyond its step budget or pool), while fewer than `calibration_repeats` rounds
        were timed, or fewer than `calibration_rounds` within `calibration_budget_s` (cheap models get more
        rounds: their millisecond forwards are noisy)."""
        rounds = len(self.calibration) // 3
        spent = sum(s for _, s in self.calibration)
        if not self.measured or rounds >= self.calibration_rounds or (
                rounds >= self.calibration_repeats and spent >= self.calibration_budget_s):
            return ()
        return self.block_size, max(8 * self.block_size, 64), max(32 * self.block_size, 256)

    def observe_calibration(self, tokens: int, seconds: float) -> None:
        """A start-up forward of `tokens` tokens took `seconds` (kept: the steady part of the compute fit)."""
        if tokens > 0 and seconds > 0:
            self.calibration.append((tokens, seconds))
            self._cache.pop("compute", None)
            self._cache.pop("curve", None)

    def observe_compute(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.compute.append((tokens, seconds))
            self._cache.pop("compute", None)
            self._cache.pop("curve", None)

    def observe_restore(self, tier: int, pages: int, seconds: float) -> None:
        self.samples.setdefault(tier, deque(maxlen=32)).append((pages, seconds))
        self._cache.pop(("restore", tier), None)

    def observe_demote(self, tier: int, pages: int, seconds: float) -> None:
        if pages > 0:
            self.demotes.setdefault(tier, deque(maxlen=32)).append(seconds / pages)

    def observe_behind(self, tier: int, seconds: float) -> None:
        self.behind[tier] = max(seconds, 0.0)

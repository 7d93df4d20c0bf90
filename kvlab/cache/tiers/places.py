"""Where each page that left the pool lives: which tier holds it, and the moves between tiers. Torch-free.

`Places` keeps one record per offloaded page (its key, a prefix-cache node's block in one layer group ->
its tier) and asks the placement (kvlab.cache.tiers.placement) every decision: which tier a page leaving
the pool goes to, which page a full tier lets go, and where that one goes (a slower tier, or nowhere).
Every data move it decides is made at once by its `mover`, the one door for KV moves
(kvlab.cache.paged_kv.PagedKV: `demote`, `restore_many`, `spill`, `discard`, `start_read`, `poll`), so no page
is ever in two places, or in none while it is recorded somewhere. A page that is dropped from the last tier, or
whose read failed, is reported to `on_drop` (the prefix cache forgets that block's entry: it will be recomputed).

Reads ahead: `fetch(keys)` starts the reads of the pages a request's hit needs from a slow tier and says whether
all of them are in memory (the scheduler admits the request only then); `prefetch(keys)` starts those the
placement wants read before the request is scheduled (a returning conversation, at `add_request`). A page whose
read failed (its file deleted or truncated after it was demoted) is forgotten with a warning: the request is
looked up again and recomputes that block. The engine's observed rates reach the placement through
`observe_compute` / `observe_restore` / `observe_demote` / `observe_behind` (the cost-aware placement's cost
model). A restore is observed as the request waited for it: from the scheduler's first `fetch` of its pages to the
end of the copies when no step ran in between (the reads' queue and round trip on the tier's worker, the engine's
wake-up when it blocked on them), else the copies and the reads' own span (the reads were hidden behind other
steps). A demotion: the step's own time (`put`), and the tier's work behind the step for one page (its file
write and removal on the writer thread, CPU seconds: `behind_seconds`).

Invariants (`check`): each key is in exactly one tier; no tier holds more pages than its capacity; the
tiers' own counts equal the records.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Hashable, Protocol

from kvlab.cache.tiers.placement.base import Placement


class Mover(Protocol):
    def movable(self, page: int) -> bool: ...
    def demote(self, page: int, tier: int, key: Hashable) -> None: ...
    def behind_seconds(self, tier: int) -> float: ...
    def restore_many(self, items: list[tuple[Hashable, int, int]]) -> dict[int, float]: ...
    def spill(self, key: Hashable, src: int, dst: int) -> None: ...
    def discard(self, key: Hashable, tier: int) -> None: ...
    def tier_len(self, tier: int) -> int: ...
    def ready(self, key: Hashable, tier: int) -> bool: ...
    def start_read(self, key: Hashable, tier: int) -> None: ...
    def poll(self) -> list[tuple[Hashable, str | None]]: ...
    def wait(self) -> None: ...
    def in_flight(self) -> int: ...


@dataclass
class TierStats:
    demoted: int = 0  # pages copied from the pool into a tier
    restored: int = 0  # pages copied back into the pool on a prefix hit
    spilled: int = 0  # pages moved to a slower tier to make room
    dropped: int = 0  # pages dropped from the tiers (recomputed if needed again)
    refused: int = 0  # pages leaving the pool that the placement sent nowhere
    failed_reads: int = 0  # pages a tier could not give back (recomputed instead)
    prefetched: int = 0  # reads the placement started when the request was added (before it was scheduled)
    fetched: int = 0  # reads started when the scheduler first looked at the request
    waits: int = 0  # times a request was passed over because a page of its hit was still being read
    recomputed: int = 0  # tier pages a hit left behind because recomputing them was cheaper (cost model)
    bytes_moved: int = 0  # bytes copied between the pool and the tiers, and between tiers
    move_seconds: float = 0.0  # time spent copying them
    hits: dict = field(default_factory=dict)  # tier kind -> pages restored from it


class Places:
    """The records of offloaded pages, the placement's decisions and the moves they make."""

    def __init__(self, kinds: list[str], capacities: list[int], placement: Placement, page_bytes: int,
                 block_size: int, mover: Mover | None = None):
        self.kinds, self.capacities = list(kinds), list(capacities)
        self.placement = placement
        placement.setup(self.kinds, self.capacities, page_bytes, block_size)
        self.page_bytes = page_bytes
        self.mover = mover
        self.tier_of: dict[Hashable, int] = {}
        self.held = [0] * len(kinds)
        self.claimed: set[Hashable] = set()  # about to be restored: no longer a victim
        self.reading: set[Hashable] = set()  # reads ahead started, not yet reported by the tier
        self.on_drop: Callable[[Hashable], None] | None = None
        self.asked: dict[Hashable, tuple[float, int]] = {}  # first `fetch` of a page: (perf_counter, steps then)
        self.steps = 0  # steps the engine computed (`observe_compute`)
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self.tier_of)

    def demote(self, key: Hashable, page: int) -> bool:
        """Pool page `page` (block `key`) leaves the pool: copied to the tier the placement picks, room made
        there first. False when it goes nowhere (the caller drops it)."""
        tier = self.placement.where(key) if self.mover.movable(page) else None
        if tier is None or not self._make_room(tier):
            self.stats.refused += 1
            return False
        started = time.perf_counter()
        self.mover.demote(page, tier, key)
        self.placement.observe_demote(tier, 1, time.perf_counter() - started)
        self.placement.observe_behind(tier, self.mover.behind_seconds(tier))
        self._add(key, tier)
        self.stats.demoted += 1
        return True

    def claim(self, keys: list[Hashable]) -> None:
        """`keys` are about to be restored (a request was admitted on them): no placement may pick them."""
        for key in keys:
            self.placement.removed(key)
            self.claimed.add(key)

    def restore(self, key: Hashable, page: int) -> None:
        """Block `key` comes back into pool page `page` (fresh, held by the table that hit it)."""
        self.restore_many([(key, page)])

    def restore_many(self, pairs: list[tuple[Hashable, int]]) -> None:
        """Blocks come back into fresh pool pages (key, page), moved together (one copy per pool tensor and tier)."""
        items = []
        asked = [self.asked.pop(key) for key, _ in pairs if key in self.asked]
        for key, page in pairs:
            tier = self.tier_of.pop(key)
            self.held[tier] -= 1
            self.claimed.discard(key)
            self.placement.removed(key)
            items.append((key, tier, page))
        seconds = self.mover.restore_many(items)
        if asked and all(steps == self.steps for _, steps in asked) and seconds:
            # no step ran since the scheduler first asked for these pages: the request waited from then to now
            # (the reads' queue and round trip, the engine's wake-up, the copies); the slowest tier's share
            slowest = max(seconds)
            seconds[slowest] = max(seconds[slowest], time.perf_counter() - min(t for t, _ in asked)
                                   - sum(s for t, s in seconds.items() if t != slowest))
        for tier, s in seconds.items():
            self.placement.observe_restore(tier, sum(1 for _, t, _ in items if t == tier), s)
        for key, tier, _ in items:
            self.placement.hit(key)
            self.stats.restored += 1
            self.stats.hits[self.kinds[tier]] = self.stats.hits.get(self.kinds[tier], 0) + 1

    # -- reading ahead -------------------------------------------------------------
    def fetch(self, keys: list[Hashable]) -> bool:
        """Start the reads `keys` need (a request's hit, about to be scheduled); True once every one is in memory.
        A failed read forgets its page (see `poll`): the caller looks the request up again."""
        now = time.perf_counter()
        for key in keys:
            tier = self.tier_of.get(key)
            if tier is not None:
                self.asked.setdefault(key, (now, self.steps))
            if tier is not None and key not in self.reading and not self.mover.ready(key, tier):
                self._start(key, tier)
                self.stats.fetched += 1
        self.poll()
        return all(key in self.tier_of and self.mover.ready(key, self.tier_of[key]) for key in keys)

    def prefetch(self, keys: list[Hashable]) -> int:
        """A request was added whose prefix hits `keys`: start the reads the placement wants now; how many."""
        n = 0
        for key in keys:
            tier = self.tier_of.get(key)
            if tier is not None and not self.mover.ready(key, tier) and key not in self.reading \
                    and self.placement.prefetch(key, tier):
                self._start(key, tier)
                n += 1
        self.stats.prefetched += n
        return n

    def _start(self, key: Hashable, tier: int) -> None:
        if key in self.reading:
            return
        self.reading.add(key)
        self.placement.removed(key)  # being read: the most recently used page of its tier
        self.placement.inserted(key, tier)
        self.mover.start_read(key, tier)

    def poll(self) -> list[Hashable]:
        """Take the finished reads; a failed one's page is forgotten (warned, counted, `on_drop`). The keys lost."""
        lost = []
        for key, error in self.mover.poll():
            self.reading.discard(key)
            if error is None or key not in self.tier_of:
                continue
            warnings.warn(f"a tier could not read back a cached page ({error}): it is recomputed", RuntimeWarning,
                          stacklevel=3)
            self.stats.failed_reads += 1
            self.discard(key)
            lost.append(key)
            if self.on_drop is not None:
                self.on_drop(key)
        return lost

    def in_flight(self) -> bool:
        """Are reads still running (a request may be waiting on one)?"""
        return bool(self.reading)

    def wait(self) -> None:
        """Block until a read finishes, then take it (`poll`)."""
        if self.reading:
            self.mover.wait()
        self.poll()

    def observe_compute(self, tokens: int, seconds: float) -> None:
        """A step computed `tokens` prompt tokens in `seconds` (the cost model's recompute rate)."""
        self.steps += 1
        self.placement.observe_compute(tokens, seconds)

    def discard(self, key: Hashable) -> None:
        """Forget `key` and drop its tier copy (the pool holds the block again, or it is lost)."""
        tier = self.tier_of.pop(key)
        self.held[tier] -= 1
        self.claimed.discard(key)
        self.reading.discard(key)
        self.asked.pop(key, None)
        self.placement.removed(key)
        self.mover.discard(key, tier)

    def drain(self) -> list[Hashable]:
        """Drop every page from every tier (the engine closes); the keys dropped."""
        keys = list(self.tier_of)
        for key in keys:
            self.discard(key)
        return keys

    def _add(self, key: Hashable, tier: int) -> None:
        self.tier_of[key] = tier
        self.held[tier] += 1
        self.placement.inserted(key, tier)

    def _make_room(self, tier: int) -> bool:
        """Victims leave full `tier` (spilled down or dropped) until it has room; False if none may."""
        while self.held[tier] >= self.capacities[tier]:
            victim = self.placement.victim(tier)
            if victim is None:
                return False
            if victim in self.claimed or self.tier_of.get(victim) != tier:
                raise ValueError(f"placement {type(self.placement).__name__} named {victim!r} as tier {self.kinds[tier]}'s "
                                 f"victim, which that tier does not hold (or a request claimed it): a placement must "
                                 f"forget a page on removed()")
            self._evict(victim, tier)
        return True

    def _evict(self, key: Hashable, tier: int) -> None:
        dst = self.placement.spill(key, tier)
        self.placement.removed(key)
        if dst is not None and dst > tier and self._make_room(dst):
            self.tier_of[key] = dst
            self.held[tier] -= 1
            self.held[dst] += 1
            self.mover.spill(key, tier, dst)
            self.placement.inserted(key, dst)
            self.stats.spilled += 1
            return
        self.tier_of.pop(key)
        self.held[tier] -= 1
        self.reading.discard(key)
        self.asked.pop(key, None)
        self.mover.discard(key, tier)
        self.stats.dropped += 1
        if self.on_drop is not None:
            self.on_drop(key)

    def check(self) -> None:
        """Every key in one tier, no tier over its capacity, the tiers' counts equal to the records."""
        counts = [0] * len(self.kinds)
        for tier in self.tier_of.values():
            counts[tier] += 1
        if counts != self.held:
            raise AssertionError(f"tier records {counts} differ from the held counts {self.held}")
        for t, (n, cap) in enumerate(zip(counts, self.capacities)):
            if n > cap:
                raise AssertionError(f"tier {self.kinds[t]} holds {n} pages, over its capacity {cap}")
            if self.mover is not None and self.mover.tier_len(t) != n:
                raise AssertionError(f"tier {self.kinds[t]} stores {self.mover.tier_len(t)} pages, records say {n}")

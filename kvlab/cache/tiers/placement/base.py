"""Placement: which tier a page leaving the pool goes to, and which page a full tier lets go. Torch-free.

A page evicted from the prefix cache (kvlab.cache.prefix_cache) is not dropped when tiers sit below the
pool (`EngineConfig.offload`): the placement decides where it goes. Tiers are numbered fastest first
(`host` before `disk`). A placement is a small dataclass registered in `PLACEMENTS` that sees:

    setup(kinds, capacities, page_bytes, block_size)   the tiers below the pool (kinds: "host", "disk")
    where(key) -> tier | None      a page leaves the pool: the tier it goes to (None: dropped, recomputed)
    inserted(key, tier)            it is now held in `tier`
    victim(tier) -> key | None     `tier` is full: which of its pages leaves it (None: keep them all, the
                                   incoming page is dropped instead)
    spill(key, tier) -> tier | None  the victim's next place: a slower tier, or None (dropped)
    removed(key)                   it left its tier (restored or dropped): no longer a victim
    hit(key)                       a request took it back into the pool (frequency policies count these)
    prefetch(key, tier) -> bool    a request was just added whose prefix hits `key` in a slow tier: read it now,
                                   before the request is scheduled? (default: yes)
    restore_pays(pages, tokens, start) -> bool   a hit would restore `pages` ({tier: count}) to skip computing
                                   `tokens` tokens behind `start` kept ones: restore (True, default) or recompute
    observe_compute(tokens, s)     a step computed `tokens` tokens in `s` seconds (the engine's observed rate)
    observe_restore(tier, n, s)    `n` pages came back from `tier` in `s` seconds (the reads' wall time included)
    observe_demote(tier, n, s)     `n` pages went down to `tier` in `s` seconds (what the step's thread paid: a
                                   row copy, and the file write where the tier does not write behind)
    observe_behind(tier, s)        the tier's own work for one page, off the step's thread (a disk tier's file
                                   write behind and the file's later removal, CPU seconds on its writer thread:
                                   on cores with none free, time the step loses too)
    compute_sizes() -> sizes       the next round of prompt lengths the engine times forwards of at start, asked
                                   until it is empty (calibration; default none), each told to
    observe_calibration(tokens, s)

Keys are stable per (prefix-cache node, layer group): a block that goes down, comes back and goes down
again keeps its key, so a policy can learn how often it returns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Hashable

from kvlab.registry import PLACEMENTS

Key = Hashable


@dataclass
class Placement(ABC):
    """Base class of placements; subclasses are dataclasses of their parameters."""

    prefetch_ahead: bool = True  # read a returning request's slow-tier pages as soon as it is added
    kinds: list = field(default_factory=list, init=False, repr=False)  # tier kinds, fastest first
    capacities: list = field(default_factory=list, init=False, repr=False)  # pages each tier holds at most
    page_bytes: int = field(default=0, init=False, repr=False)
    block_size: int = field(default=0, init=False, repr=False)

    def setup(self, kinds: list[str], capacities: list[int], page_bytes: int, block_size: int) -> None:
        self.kinds, self.capacities = list(kinds), list(capacities)
        self.page_bytes, self.block_size = page_bytes, block_size

    def where(self, key: Key) -> int | None:
        """The tier a page leaving the pool goes to: the fastest."""
        return 0 if self.kinds else None

    @abstractmethod
    def inserted(self, key: Key, tier: int) -> None:
        """`key` is now held in `tier`."""

    @abstractmethod
    def victim(self, tier: int) -> Key | None:
        """Which page of full `tier` leaves it (it stays tracked until `removed`); None: none may."""

    @abstractmethod
    def removed(self, key: Key) -> None:
        """`key` left its tier (restored into the pool, moved down or dropped)."""

    def spill(self, key: Key, tier: int) -> int | None:
        """Where a victim of `tier` goes: the next slower tier, or None (dropped) below the last."""
        return tier + 1 if tier + 1 < len(self.kinds) else None

    def hit(self, key: Key) -> None:
        """A request took `key` back into the pool."""

    def prefetch(self, key: Key, tier: int) -> bool:
        """Start reading `key` from slow `tier` as soon as a request whose prefix hits it is added (else when the
        scheduler first looks at the request)?"""
        return self.prefetch_ahead

    def restore_pays(self, pages: dict[int, int], tokens: int, start: int = 0) -> bool:
        """Restore `pages` ({tier: pages}) rather than recompute the `tokens` tokens they hold, behind the `start`
        tokens of the hit before them?"""
        return True

    def observe_compute(self, tokens: int, seconds: float) -> None:
        """A step computed `tokens` tokens in `seconds`."""

    def observe_restore(self, tier: int, pages: int, seconds: float) -> None:
        """`pages` pages came back from `tier` in `seconds` (one run)."""

    def observe_demote(self, tier: int, pages: int, seconds: float) -> None:
        """`pages` pages went down to `tier` in `seconds` (what the step's thread paid)."""

    def observe_behind(self, tier: int, seconds: float) -> None:
        """`tier`'s work behind the step for one page is now `seconds` (CPU seconds on its own worker)."""

    def compute_sizes(self) -> tuple[int, ...]:
        """Prompt lengths (tokens) whose forward the engine times at start, each told to `observe_compute`
        (none: the placement learns from the engine's steps only)."""
        return ()

    def observe_calibration(self, tokens: int, seconds: float) -> None:
        """A start-up forward of `tokens` tokens took `seconds` (`compute_sizes`)."""
        self.observe_compute(tokens, seconds)


PLACEMENTS.base = Placement

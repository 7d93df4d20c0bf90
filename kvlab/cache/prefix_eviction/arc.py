"""Adaptive Replacement Cache (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
FAST 2003), adapted to cached-free pages (asked of vLLM and LMCache, never merged there).

Registered pages are *recent* (T1: used by one request so far) or *frequent* (T2: hit at least once).
Only cached-free pages can be evicted, least recently freed first within each list. Evicted contents
are remembered as ghosts (B1 from T1, B2 from T2, by block hash): when a later request registers a
block whose content is a B1 ghost, T1 was too small, so the target size `p` of T1 grows (a B2 ghost
shrinks it), and the page starts in T2. `evict` takes from T1 while it is above its target, else T2.
The ghost lists hold at most as many entries as there are registered pages.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvlab.cache.prefix_eviction.base import PrefixEviction
from kvlab.registry import PREFIX_EVICTIONS


@PREFIX_EVICTIONS.register("arc")
@dataclass
class ARC(PrefixEviction):
    """Recency (T1) against frequency (T2), with the split tuned online by ghost hits."""

    _t1: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)  # parked recent pages
    _t2: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)  # parked frequent pages
    _b1: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)  # ghost keys evicted from T1
    _b2: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)  # ghost keys evicted from T2
    _frequent: set = field(default_factory=set, init=False, repr=False)  # registered pages in T2
    _keys: dict = field(default_factory=dict, init=False, repr=False)  # registered page -> block hash
    _p: float = field(default=0.0, init=False, repr=False)  # target number of parked T1 pages

    def register(self, page: int, key: int) -> None:
        self._keys[page] = key
        c = len(self._keys)
        if key in self._b1:
            self._p = min(self._p + max(1.0, len(self._b2) / len(self._b1)), c)
            del self._b1[key]
            self._frequent.add(page)
        elif key in self._b2:
            self._p = max(self._p - max(1.0, len(self._b1) / len(self._b2)), 0.0)
            del self._b2[key]
            self._frequent.add(page)

    def hit(self, page: int) -> None:
        self._frequent.add(page)

    def park(self, pages: list[int]) -> None:
        for page in reversed(pages):
            (self._t2 if page in self._frequent else self._t1)[page] = None

    def unpark(self, page: int) -> None:
        (self._t2 if page in self._t2 else self._t1).pop(page)

    def evict(self) -> int:
        if self._t1 and (len(self._t1) > self._p or not self._t2):
            page, ghosts = self._t1.popitem(last=False)[0], self._b1
        else:
            page, ghosts = self._t2.popitem(last=False)[0], self._b2
        ghosts[self._keys[page]] = None
        while len(ghosts) > max(len(self._keys), 1):
            ghosts.popitem(last=False)
        return page

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def forget(self, page: int) -> None:
        self._frequent.discard(page)
        self._keys.pop(page, None)

"""Segmented LRU (Karedla, Love & Wherry, "Caching strategies to improve disk system performance", 1994).

Two LRU segments of cached-free pages: *probation* for pages no later request has reused, and
*protected* for pages that were hit at least once. Probation is evicted first; protected holds at
most `protected_fraction` of the cached-free pages, its least recently freed page being demoted to
probation when it overflows. A one-off prompt's pages therefore never push out a shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvlab.cache.prefix_eviction.base import PrefixEviction
from kvlab.registry import PREFIX_EVICTIONS


@PREFIX_EVICTIONS.register("slru")
@dataclass
class SLRU(PrefixEviction):
    """LRU in two segments: pages never reused go before pages that were hit."""

    protected_fraction: float = 0.8  # largest share of the cached-free pages kept in the protected segment

    _probation: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)
    _protected: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)
    _hits: set = field(default_factory=set, init=False, repr=False)  # registered pages reused at least once

    def __post_init__(self) -> None:
        if not isinstance(self.protected_fraction, (int, float)) or not 0.0 <= self.protected_fraction <= 1.0:
            raise ValueError(f"slru.protected_fraction must be in [0, 1], got {self.protected_fraction!r}")

    def park(self, pages: list[int]) -> None:
        for page in reversed(pages):
            (self._protected if page in self._hits else self._probation)[page] = None
        while len(self._protected) > self.protected_fraction * len(self):
            self._probation[self._protected.popitem(last=False)[0]] = None  # demoted, newest of probation

    def unpark(self, page: int) -> None:
        (self._protected if page in self._protected else self._probation).pop(page)

    def evict(self) -> int:
        segment = self._probation if self._probation else self._protected
        return segment.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def hit(self, page: int) -> None:
        self._hits.add(page)

    def forget(self, page: int) -> None:
        self._hits.discard(page)

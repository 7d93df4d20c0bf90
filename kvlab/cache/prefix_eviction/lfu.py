"""Least frequently used first (LFU; asked of vLLM and LMCache as an alternative to LRU).

Every registered page counts the requests that used it (its first owner, then one per hit). The
cached-free page with the lowest count goes first; ties go least recently freed first, a request's
tail before its head (as LRU). A page's count starts again when it is unregistered.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from kvlab.cache.prefix_eviction.base import PrefixEviction
from kvlab.registry import PREFIX_EVICTIONS


@PREFIX_EVICTIONS.register("lfu")
@dataclass
class LFU(PrefixEviction):
    """Evict the cached-free page used by the fewest requests; ties: least recently freed."""

    _uses: dict = field(default_factory=dict, init=False, repr=False)  # page -> requests that used it
    _parked: dict = field(default_factory=dict, init=False, repr=False)  # page -> heap key it was parked with
    _heap: list = field(default_factory=list, init=False, repr=False)  # (uses, tick, page), stale entries skipped
    _tick: int = field(default=0, init=False, repr=False)

    def park(self, pages: list[int]) -> None:
        for page in reversed(pages):
            self._tick += 1
            key = (self._uses.get(page, 1), self._tick, page)
            self._parked[page] = key
            heapq.heappush(self._heap, key)

    def unpark(self, page: int) -> None:
        del self._parked[page]  # its heap entry goes stale

    def evict(self) -> int:
        while True:
            key = heapq.heappop(self._heap)
            if self._parked.get(key[2]) == key:
                del self._parked[key[2]]
                return key[2]

    def __len__(self) -> int:
        return len(self._parked)

    def hit(self, page: int) -> None:
        self._uses[page] = self._uses.get(page, 1) + 1

    def forget(self, page: int) -> None:
        self._uses.pop(page, None)

"""Least recently used first (vLLM's prefix-cache eviction, arXiv:2309.06180 / vLLM v1 `FreeKVCacheBlockQueue`).

Cached-free pages queue in the order they were freed; the oldest goes first. Within one request the
pages are queued tail first, so a request's last pages are evicted before its first ones: the
beginning of a prompt (a system prompt, say) is what later requests share most.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvlab.cache.prefix_eviction.base import PrefixEviction
from kvlab.registry import PREFIX_EVICTIONS


@PREFIX_EVICTIONS.register("lru")
@dataclass
class LRU(PrefixEviction):
    """Evict the page freed longest ago; a request's tail before its head."""

    _queue: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)  # page -> None, oldest first

    def park(self, pages: list[int]) -> None:
        for page in reversed(pages):
            self._queue[page] = None

    def unpark(self, page: int) -> None:
        del self._queue[page]

    def evict(self) -> int:
        return self._queue.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._queue)

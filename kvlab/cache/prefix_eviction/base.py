"""Prefix-cache eviction: which cached-free page is reused first when the pool runs out. Torch-free.

A page is *cached-free* when no table holds it any more but it is still registered in the prefix
cache (`kvlab.cache.prefix_cache`): a later request with the same prefix can take it back (a hit), until
its memory is needed for something else. The allocator hands never-registered free pages out first;
only when none is left does it ask the eviction policy for a victim among the cached-free pages,
and the prefix cache unregisters it before it is reused (so it can never give a stale hit).

A policy is a small dataclass registered in `PREFIX_EVICTIONS` that sees four events:

    park(pages)   pages of one table that just became cached-free, in table order (prefix first)
    unpark(page)  a hit took a cached-free page back into a table
    register(page, key)  the page was registered for the block with hash `key` (ghost-list policies)
    hit(page)     a request reused a registered page (free or in use): frequency policies count these
    forget(page)  the page was unregistered (evicted): drop anything remembered about it
and answers `evict()` -> the victim page (it is removed from the policy) and `len()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvlab.registry import PREFIX_EVICTIONS


@dataclass
class PrefixEviction(ABC):
    """Base class of prefix-cache eviction policies; subclasses are dataclasses of their parameters."""

    @abstractmethod
    def park(self, pages: list[int]) -> None:
        """`pages` (of one table, in table order) are now cached-free and may be evicted."""

    @abstractmethod
    def unpark(self, page: int) -> None:
        """A hit took `page` back into a table: it is no longer evictable."""

    @abstractmethod
    def evict(self) -> int:
        """Remove and return the cached-free page to reuse now (called only when len(self) > 0)."""

    @abstractmethod
    def __len__(self) -> int:
        """Cached-free pages this policy holds."""

    def register(self, page: int, key: int) -> None:
        """`page` now holds the block whose chained hash is `key` (a hint: hashes may collide)."""

    def hit(self, page: int) -> None:
        """A request reused registered page `page` (whether it was free or in use)."""

    def forget(self, page: int) -> None:
        """`page` was unregistered: its next contents are a different block."""


PREFIX_EVICTIONS.base = PrefixEviction

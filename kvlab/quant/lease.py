"""Residual rows leased from the pool: an open page's full-precision row lives in free pages' codes.

A residual row (one page of K/V in the compute dtype) costs `k` pages of a packed format's codes
(int4 with fp32 rows: 8). Instead of an area reserved up front for `max_num_seqs` sequences, the
cache leases `k` free pages from the allocator when a page opens and gives them back when it is
sealed, so rows cost pages only while a sequence's window is open and a pool with few running
sequences holds what the format's bits promise. The lease is an allocator table of its own (a
negative key, never a sequence's), so the pages are out of the free list, counted as used, and
every allocator plugin supports it (one that would reserve more than `k` pages for it, such as
`contiguous` with `reserve="max_model_len"`, leases nothing: its pages are sealed early).

Leases never take the free pages the running sequences need to grow: `keep_free` pages per live
table stay free (the window's pages plus the partly filled one), so rows give way before the
scheduler would have to preempt; a page that gets no row is sealed early (`early_seals`).
Bookkeeping only: no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kvlab.allocators.base import Allocator


class PageLessor:
    """Leases of free pages for residual rows, through one allocator."""

    def __init__(self, allocator: Allocator, block_size: int, keep_free: int):
        self.allocator = allocator
        self.block_size = block_size
        self.keep_free = keep_free  # free pages kept per live sequence table (for its growth)
        self.keys: set[int] = set()
        self._next = 0

    def lease(self, n: int) -> tuple[int, list[int]] | None:
        """(key, n free pages) out of the free list, or None when they cannot be spared."""
        a, tokens = self.allocator, n * self.block_size
        live = len(a.tables) - len(self.keys)  # sequence tables
        if a.num_free_blocks - n < self.keep_free * live or a.reservation(tokens, tokens) > tokens \
                or not a.can_allocate(tokens, tokens):
            return None
        self._next += 1
        key = -self._next
        a.allocate(key, tokens, tokens)
        self.keys.add(key)
        return key, a.block_table(key)

    def give_back(self, key: int) -> None:
        self.allocator.free(key)
        self.keys.discard(key)

    def held(self) -> Callable[[int], bool]:
        """page -> whether a sequence's table holds it (leases excluded)."""
        a = self.allocator
        if hasattr(a, "num_owners"):
            return lambda page: a.num_owners(page) > 0
        pages = {p for key, table in a.tables.items() if key >= 0 for p in table}
        return pages.__contains__


def lessor_for(quant, allocator: Allocator, block_size: int) -> PageLessor | None:
    """The lessor of a packed format with a residual window (None for any other format): it keeps
    free, per live table, the pages of one window plus the partly filled one."""
    if not quant.packed or quant.residual is None:
        return None
    return PageLessor(allocator, block_size, keep_free=-(-quant.residual // block_size) + 1)

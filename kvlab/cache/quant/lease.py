"""Residual rows leased from the pool: an open page's full-precision row lives in free pages' codes.

A residual row (one page of K/V in the compute dtype) costs `k` pages of a packed format's codes
(int4 with fp32 rows: 8). Instead of an area reserved up front for `max_num_seqs` sequences, the
cache leases `k` free pages from the allocator when a page opens and gives them back when it is
sealed, so rows cost pages only while a sequence's window is open and a pool with few running
sequences holds what the format's bits promise. The lease is an allocator table of its own (a
negative key, never a sequence's), so the pages are out of the free list, counted as used, and
every allocator plugin supports it (one that would reserve more than `k` pages for it, such as
`contiguous` with `reserve="max_model_len"`, leases nothing: its pages are sealed early).

A lease never fails in the engine: the block manager counts the rows each scheduled write will
lease (RowClaims) and admits, grows or preempts so that their pages stay free, as it does for the
sequences' own pages. A page is therefore open exactly while its tokens are in the window, whatever
else runs. (A write outside the claims that finds no free pages seals its page early, counted in the
area's `early_seals`; the engine's stats report that count, which stays 0.) Bookkeeping only: no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kvlab.cache.allocators.base import Allocator


class PageLessor:
    """Leases of free pages for residual rows, through one allocator."""

    def __init__(self, allocator: Allocator, block_size: int):
        self.allocator = allocator
        self.block_size = block_size
        self.keys: set[int] = set()
        self._next = 0

    def lease(self, n: int) -> tuple[int, list[int]] | None:
        """(key, n free pages) out of the free list, or None when there are none (or the allocator would
        reserve more than n pages for them)."""
        a, tokens = self.allocator, n * self.block_size
        if a.reservation(tokens, tokens) > tokens or not a.can_allocate(tokens, tokens):
            return None
        self._next += 1
        while -self._next in a.tables:  # another negative key (a kept turn's table, kvlab.cache.kept_turns)
            self._next += 1
        key = -self._next
        a.allocate(key, tokens, tokens)
        self.keys.add(key)
        return key, a.block_table(key)

    def give_back(self, key: int) -> None:
        self.allocator.free(key)
        self.keys.discard(key)

    def held(self) -> Callable[[int], bool]:
        """page -> whether a sequence's table holds it (leases excluded), or a pending copy-on-write copy
        still reads it (its sequence may have been freed since: the copy, applied before the next forward,
        takes the row over, kvlab.cache.packed_layout.PackedLayout.copy_blocks)."""
        a = self.allocator
        sources = {s for s, _ in getattr(a, "pending_copies", ())}
        if hasattr(a, "num_owners"):
            return lambda page: a.num_owners(page) > 0 or page in sources
        pages = {p for key, table in a.tables.items() if key >= 0 for p in table} | sources
        return pages.__contains__


class RowClaims:
    """The rows a step's writes will lease, counted when the step is scheduled, so the scheduler
    keeps their pages free (or preempts) and a lease never fails: which pages are open, and so what
    every query reads, follows from the tokens alone, never from how full the pool is.

    Writing `n` tokens at cache index `length` of a table opens the pages that hold the new tokens and
    stay in the window (kvlab.engine.attention.leaving_window: page j is open while (j + 1) * bs > len -
    residual); a page already open keeps its row unless a write will copy it (shared by several
    tables: copy-on-write gives the copy a row of its own). Rows of pages sealed in a step come back
    at the next step's start, before it is scheduled."""

    def __init__(self, pages_per_row: int, residual: int, block_size: int, has_row: Callable[[int], bool],
                 num_owners: Callable[[int], int] | None):
        self.pages_per_row, self.residual, self.block_size = pages_per_row, residual, block_size
        self.has_row, self.num_owners = has_row, num_owners
        self.window_rows = -(-residual // block_size) + 1  # most pages of one table open at once

    def new_rows(self, table: list[int], length: int, n: int, held: int = 0) -> int:
        """Rows writing `n` tokens after the first `length` cache indices of `table` leases; the last `held` of
        them a token tree's tentative nodes, which the window does not count (their pages stay open)."""
        bs, end = self.block_size, length + n
        first = max(length // bs, max(0, end - held - self.residual) // bs)
        return sum(1 for j in range(first, (end - 1) // bs + 1)
                   if j >= len(table) or not self._keeps_row(table[j]))

    def first_rows(self, start: int, n: int) -> int:
        """Rows a first chunk of `n` tokens at cache index `start` of a fresh table leases (a prefix hit's
        pages before `start` are sealed: kvlab.cache.block_manager.BlockManager.shareable)."""
        return self.new_rows([], start, n)

    def most_first_rows(self, start: int, n: int) -> int:
        """The most rows a first chunk of up to `n` tokens at cache index `start` leases: the pages it spans,
        at most a window's."""
        return min(self.window_rows, (start + n - 1) // self.block_size - start // self.block_size + 1) if n > 0 else 0

    def lone_rows(self, length: int, window: int | None = None) -> int:
        """Rows a table of `length` cache indices holds while one more token is written: its pages in the window
        (open since their tokens came in; with a sliding `window`, its pages released out of that window are not
        held), and the written page's when it opens one. A lone sequence computing a token a step never holds more."""
        bs = self.block_size
        residual = self.residual if window is None else min(self.residual, window - 1)
        held = max(0, -(-length // bs) - max(0, length - residual) // bs)
        opens = length % bs == 0 and (length // bs + 1) * bs > length + 1 - self.residual
        return held + opens

    def _keeps_row(self, page: int) -> bool:
        return page >= 0 and self.has_row(page) and (self.num_owners is None or self.num_owners(page) <= 1)


def lessor_for(quant, allocator: Allocator, block_size: int) -> PageLessor | None:
    """The lessor of a packed format with a residual window (None for any other format). Leases are
    claimed when a step is scheduled (RowClaims), so the lessor keeps no pages back of its own."""
    if not quant.packed or quant.residual is None:
        return None
    return PageLessor(allocator, block_size)


def row_claims(area, residual: int) -> RowClaims | None:
    """The claims of a cache's leased rows (None: no lessor, or an allocator that reserves more than a
    lease's pages for it, so nothing is ever leased and pages are sealed as they are written)."""
    if area is None or area.lessor is None:
        return None
    lessor = area.lessor
    a, tokens = lessor.allocator, area.k * lessor.block_size
    if a.reservation(tokens, tokens) > tokens:
        return None
    owners = getattr(a, "num_owners", None)
    return RowClaims(area.k, residual, lessor.block_size, lambda page: area.row(page) >= 0, owners)

"""Paged allocation (PagedAttention, Kwon et al. 2023, arXiv:2309.06180).

Fixed-size blocks taken on demand from a free list; a block table per sequence
maps logical blocks to physical ones. Blocks carry reference counts so a fork
(parallel sampling, shared prefixes) shares them; the first write into a shared,
partly filled block copies it (copy-on-write). Waste is bounded by the empty
slots of each sequence's last block.

With prefix caching (`prefix_cache` set by the block manager) a registered page whose last owner
lets go is *parked* (cached-free: findable by later requests) instead of freed; `_take` hands out
never-registered free pages first, then evicts a parked page chosen by the eviction policy.

With kept compressed turns (`kept_turns`, kvlab/cache/kept_turns.py: EngineConfig.reuse_compressed) the
store's tables are tables here; a page only they hold counts as free, and when no free or parked page is
left `_take` drops the least recently used turn (freeing its tables) until one is. With a packed format's
residual window a kept turn's open pages keep their full-precision residual rows (leased pages,
kvlab.cache.quant.lease): those count as free with the page (`row_pages`), and dropping the turn gives them
back at once (`release_rows`), before any page it freed is taken again.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

from kvlab.cache.allocators.base import NULL_BLOCK, Allocator, OutOfBlocks
from kvlab.registry import ALLOCATORS


@ALLOCATORS.register("paged")
@dataclass
class PagedAllocator(Allocator):
    """Blocks on demand from a free list, ref-counted, copy-on-write on shared blocks."""

    watermark: float = 0.0  # fraction of blocks kept free when admitting new sequences

    def __post_init__(self) -> None:
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"paged.watermark must be in [0, 1), got {self.watermark}")

    def _reset(self) -> None:
        self.free_blocks: deque[int] = deque(range(self.num_blocks))
        self.ref_counts = [0] * self.num_blocks
        self.prefix_cache = None  # kvlab.cache.prefix_cache.PrefixCache: owned here (given at assembly)
        self.kept_turns = None  # kvlab.cache.kept_turns.KeptTurns: owned here (given at assembly)
        # a packed format's residual rows (given at assembly; None: none): page -> pages its open row holds
        # (0 when sealed), and the cache's release of the rows of pages no table holds any more
        self.row_pages: Callable[[int], int] | None = None
        self.release_rows: Callable[[list[int]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Pages no sequence's table holds: free ones, cached-free (parked) ones, and those only kept turns hold."""
        return len(self.free_blocks) + (self.prefix_cache.num_parked if self.prefix_cache else 0) + self.num_kept_only

    @property
    def num_kept_only(self) -> int:
        """Pages held by kept turns' tables and no other table (dropping every turn frees them)."""
        if not self.kept_turns:
            return 0
        held = Counter(b for k in self.kept_turns.table_keys() for b in self.tables[k] if b != NULL_BLOCK)
        copied = {s for s, _ in self.pending_copies}  # a pending copy takes such a page's row over
        return sum(1 + (0 if b in copied else self._row_pages(b)) for b, n in held.items() if self.ref_counts[b] == n)

    def _row_pages(self, page: int) -> int:
        """Pages the residual row of open `page` holds (0: sealed, or no residual rows)."""
        return self.row_pages(page) if self.row_pages is not None else 0

    def kept_pages(self, keys: list[int]) -> list[int]:
        """Of the pages of tables `keys` (a kept turn's), those no table but a kept turn's holds: a request
        admitted onto the turn takes them out of the free count (an open one's residual row stays the turn's)."""
        held = Counter(b for k in self.kept_turns.table_keys() for b in self.tables[k] if b != NULL_BLOCK)
        return [b for b in {b for k in keys for b in self.tables[k] if b != NULL_BLOCK} if self.ref_counts[b] == held[b]]

    def drop_kept_turn(self) -> None:
        """Free the tables of the least recently used kept turn."""
        self.free_kept_tables(self.kept_turns.evict().keys)

    def free_kept_tables(self, keys: list[int]) -> None:
        """Free a kept turn's tables; the residual rows of its open pages that no table holds now go back
        to the pool at once (their leased pages become free with the turn's own)."""
        pages = {b for k in keys for b in self.tables[k] if b != NULL_BLOCK}
        for key in keys:
            self.free(key)
        if self.release_rows is not None:
            self.release_rows(sorted(b for b in pages if self.ref_counts[b] == 0))

    def _take(self) -> int:
        while not self.free_blocks and not (self.prefix_cache is not None and self.prefix_cache.num_parked) \
                and self.kept_turns:
            self.drop_kept_turn()  # pool pressure: the least recently used compressed turn goes
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.prefix_cache is not None and self.prefix_cache.num_parked:
            block = self.prefix_cache.evict()  # unregistered: never a stale hit
        else:
            raise OutOfBlocks("paged pool is out of blocks")
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int, parked: list[int] | None = None) -> None:
        """Drop one reference; a page nobody holds is freed, or parked if registered in the prefix
        cache (collected in `parked` when given, so a table's pages are parked together in order)."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.prefix_cache is not None and self.prefix_cache.is_registered(block):
                if parked is None:
                    self.prefix_cache.park([block])
                else:
                    parked.append(block)
            else:
                self.free_blocks.append(block)

    def allocate_cached(self, seq_id: int, pages: list[int], num_tokens: int) -> None:
        """A new table holding cached `pages` (NULL_BLOCK where not needed: before a sliding window),
        shared by reference, for its first `num_tokens` slots (the last page may be used only in part:
        it is copied before the first write); `append_slots` then gives it room for new tokens. (Take back every
        cached page a sequence needs before appending to any table: appending may evict parked pages.)"""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        for page in pages:
            if page != NULL_BLOCK:
                if self.ref_counts[page] == 0:
                    self.prefix_cache.unpark(page)
                self.ref_counts[page] += 1
        self.tables[seq_id] = list(pages)
        if not (len(pages) - 1) * self.block_size < num_tokens <= len(pages) * self.block_size and pages:
            raise ValueError(f"{num_tokens} cached tokens do not end in the last of {len(pages)} pages")
        self.lengths[seq_id] = num_tokens

    def take_into(self, seq_id: int, index: int) -> int:
        """A fresh page into entry `index` of `seq_id`'s table (NULL there: a prefix hit's block that was in a
        tier below the pool, restored into it); the page."""
        table = self.tables[seq_id]
        if table[index] != NULL_BLOCK:
            raise ValueError(f"entry {index} of table {seq_id} holds page {table[index]} already")
        table[index] = self._take()
        return table[index]

    def privatize(self, seq_id: int, only: set[int] | None = None) -> int:
        """Give `seq_id` its own copy of every page it shares with another table or the prefix cache (copies
        in pending_copies, applied before the next forward; the originals stay with their other owners, or
        parked, findable); returns how many. `only`: just the table's pages at these indices. Fresh pages are
        taken before any original is let go, so no copy's source is reused as another's destination."""
        table = self.tables[seq_id]
        shared = [(i, b) for i, b in enumerate(table)
                  if b != NULL_BLOCK and self._shared(b) and (only is None or i in only)]
        if len(shared) > self.num_free_blocks:
            raise OutOfBlocks(f"copying {len(shared)} shared pages of sequence {seq_id} needs as many free blocks")
        fresh = [self._take() for _ in shared]
        parked: list[int] = []
        for (i, block), page in zip(shared, fresh):
            table[i] = page
            self.pending_copies.append((block, page))
            self._release(block, parked)
        if parked:
            self.prefix_cache.park(parked)
        return len(shared)

    def _shared(self, block: int) -> bool:
        """Must a write into `block` copy it first? Another table holds it, or the prefix cache does
        (a cached page used only in part by a token-granularity hit)."""
        return self.ref_counts[block] > 1 or (self.prefix_cache is not None and self.prefix_cache.is_registered(block))

    def num_owners(self, page: int) -> int:
        """Tables holding `page` (its reference count)."""
        return self.ref_counts[page]

    def is_parked(self, page: int) -> bool:
        """A registered page that no table holds (taking it back uses up a free page)."""
        return self.ref_counts[page] == 0

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - int(self.watermark * self.num_blocks)

    def can_allocate(self, num_tokens: int, max_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_admissible_blocks

    def allocate(self, seq_id: int, num_tokens: int, max_tokens: int) -> None:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not self.can_allocate(num_tokens, max_tokens):
            raise OutOfBlocks(f"sequence {seq_id} needs {self.blocks_for(num_tokens)} blocks; {self.num_free_blocks} "
                              f"free, {self.num_blocks - self.usable_blocks} kept back by the watermark")
        self.tables[seq_id] = [self._take() for _ in range(self.blocks_for(num_tokens))]
        self.lengths[seq_id] = num_tokens

    def _blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        length, table = self.lengths[seq_id], self.tables[seq_id]
        needed = self.blocks_for(length + num_new_tokens) - len(table)
        if length % self.block_size and num_new_tokens and self._shared(table[-1]):
            needed += 1  # copy-on-write of the shared, partly filled last block
        return max(needed, 0)

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        return self._blocks_needed(seq_id, num_new_tokens) <= self.num_free_blocks

    def blocks_to_append(self, seq_id: int, num_new_tokens: int) -> float:
        return self._blocks_needed(seq_id, num_new_tokens)

    def append_slots(self, seq_id: int, num_new_tokens: int) -> None:
        if not self.can_append(seq_id, num_new_tokens):
            raise OutOfBlocks(f"no room to append {num_new_tokens} tokens to sequence {seq_id}")
        table, length = self.tables[seq_id], self.lengths[seq_id]
        if length % self.block_size and num_new_tokens and self._shared(table[-1]):
            shared = table[-1]
            table[-1] = self._take()
            self._release(shared)
            self.pending_copies.append((shared, table[-1]))
        while len(table) < self.blocks_for(length + num_new_tokens):
            table.append(self._take())
        self.lengths[seq_id] = length + num_new_tokens

    def free(self, seq_id: int) -> None:
        parked: list[int] = []
        for block in self.tables.pop(seq_id):
            if block != NULL_BLOCK:
                self._release(block, parked)
        if parked:
            self.prefix_cache.park(parked)
        del self.lengths[seq_id]

    def fork(self, parent_id: int, child_id: int) -> None:
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        table = list(self.tables[parent_id])
        for block in table:
            if block != NULL_BLOCK:
                self.ref_counts[block] += 1
        self.tables[child_id] = table
        self.lengths[child_id] = self.lengths[parent_id]

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.lengths[seq_id]:
            raise ValueError(f"cannot truncate sequence {seq_id} of {self.lengths[seq_id]} tokens to {num_tokens}")
        table = self.tables[seq_id]
        if num_tokens % self.block_size and table[self.blocks_for(num_tokens) - 1] == NULL_BLOCK:
            raise ValueError(f"cannot truncate sequence {seq_id} into blocks it already released")
        while len(table) > self.blocks_for(num_tokens):
            block = table.pop()
            if block != NULL_BLOCK:
                self._release(block)
        self.lengths[seq_id] = num_tokens

    def release_before(self, seq_id: int, token_index: int) -> int:
        table = self.tables[seq_id]
        return self._release_entries(table, range(min(token_index // self.block_size, len(table))))

    def release_blocks(self, seq_id: int, block_indices: list[int]) -> int:
        table, indices = self.tables[seq_id], sorted(set(block_indices))
        wrong = [i for i in indices if not 0 <= i < len(table)]
        if wrong:  # checked before any is released
            raise ValueError(f"sequence {seq_id} has no block {wrong[0]} (it holds {len(table)})")
        return self._release_entries(table, indices)

    def _release_entries(self, table: list[int], indices) -> int:
        """Release the pages at these table indices (their entries become NULL_BLOCK); how many there were."""
        released = 0
        for i in indices:
            if table[i] != NULL_BLOCK:
                self._release(table[i])
                table[i] = NULL_BLOCK
                released += 1
        return released

    def compact(self, seq_id: int, keep: list[int]) -> list[tuple[int, int]]:
        """Keep cache indices `keep`, moved to the front. A destination block is written only if this table
        holds it alone and the prefix cache does not (`_shared`); a released, shared or cached one is
        replaced by a fresh block, unless compaction leaves it as it is (every slot of it keeps its own
        index: e.g. a protected shared prefix). Blocks are released before fresh ones are taken (the
        moves read every source before writing: a block released and taken again is safe)."""
        self._check_keep(seq_id, keep)
        table, bs = self.tables[seq_id], self.block_size
        old = list(table)
        n_blocks = self.blocks_for(len(keep))
        fresh = [i for i in range(n_blocks)
                 if old[i] == NULL_BLOCK or (self._shared(old[i]) and not self._unchanged(i, keep))]
        dropped = [old[i] for i in fresh if old[i] != NULL_BLOCK] + [b for b in old[n_blocks:] if b != NULL_BLOCK]
        if len(fresh) > self.num_free_blocks + sum(1 for b in dropped if self.ref_counts[b] == 1):
            raise OutOfBlocks(f"compacting sequence {seq_id} needs {len(fresh)} free blocks")
        del table[n_blocks:]
        parked: list[int] = []
        for block in dropped:
            self._release(block, parked)  # a cached one stays findable (parked) with its contents
        if parked:
            self.prefix_cache.park(parked)
        for i in fresh:
            table[i] = self._take()
        moves = [(old[j // bs] * bs + j % bs, table[i // bs] * bs + i % bs) for i, j in enumerate(keep)]
        self.lengths[seq_id] = len(keep)
        return [(s, d) for s, d in moves if s != d]

    def _unchanged(self, block_index: int, keep: list[int]) -> bool:
        """Does compaction to `keep` leave table block `block_index` as it is (each slot keeps its index)?"""
        lo, hi = block_index * self.block_size, min((block_index + 1) * self.block_size, len(keep))
        return all(keep[j] == j for j in range(lo, hi))

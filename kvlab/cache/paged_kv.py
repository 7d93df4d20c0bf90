"""The one door for KV moves: page tables and tensors changed together.

A move of KV changes where tokens live in the page tables (the block manager) and what the pool
tensors hold (the KV cache). `PagedKV` is the only place that does both, each as one call:

    apply_copies()                  copy-on-write: the pages the allocator duplicated since the last
                                    forward are copied before the forward writes into them
    compact(seq, group, keep)       a policy keeps cache indices `keep`: the table shrinks, the survivors'
                                    K/V move to the front (a shared or cached page is never written)
    compact_heads(seq, group, keep, protected)
                                    per-head budgets: KV head h keeps keep[h], moved into the same slots
    move_path(seq, num_nodes, nodes)
                                    a token tree's accepted path (of its `num_nodes` tentative slots after
                                    the root, the last committed token): node nodes[j]'s K/V moves to cache
                                    index root + j, in each group's own indices, bit for bit; the rejected
                                    nodes' slots are zeroed, and pages the path pushed out of a residual
                                    window are sealed (then `rollback` drops the rest)
    rollback(seq, num_tokens)       rejected tentative tokens: their slots go (an open packed page is
                                    re-encoded on its next write; nothing to move)

Callers (the model runner, the compressor, the speculator) read through the block manager and the
cache as before; they move KV only through here.
"""

from __future__ import annotations

import torch

from kvlab.cache.block_manager import BlockManager
from kvlab.cache.kv_cache import KVCache
from kvlab.sequence import Sequence


class PagedKV:
    def __init__(self, block_manager: BlockManager, cache: KVCache):
        self.block_manager = block_manager
        self.cache = cache

    def apply_copies(self) -> int:
        """Copy the pages copy-on-write duplicated (src -> dst, every part and residual row); how many."""
        copies = self.block_manager.take_copies()
        self.cache.copy_blocks(copies, self.block_manager.take_whole_copies())
        return len(copies)

    def compact(self, seq: Sequence, group: int, keep: list[int]) -> None:
        """`seq` keeps only cache indices `keep` of `group`, moved to the front, in tables and tensors."""
        self.cache.move_slots(self.block_manager.compact(seq, group, keep))

    def compact_heads(self, seq: Sequence, group: int, keep: list[list[int]], protected: int = 0) -> None:
        """KV head h keeps cache indices keep[h] (every head as many): the table shrinks to that many slots
        (the pages after them are freed) and head h's survivors move into them, in order. The first
        `protected` indices (every head keeps them in place) are not moved."""
        bm = self.block_manager
        n, m = bm.cached_lens([seq], group)[0], len(keep[0])
        device = self.cache.k(bm.groups[group].layers[0]).device
        old = torch.tensor(bm.slot_ids(seq, group, 0, n), dtype=torch.long, device=device)  # [n]
        # the table's new layout: its pages up to `protected` stay as they are, every later one is written
        # (an index shifted by one there tells the allocator so); the moves are the per-head ones below
        bm.compact(seq, group, list(range(protected)) + list(range(protected + 1, m + 1)))
        new = torch.tensor(bm.slot_ids(seq, group, protected, m), dtype=torch.long, device=device)  # [m - p]
        src = old[torch.tensor(keep, dtype=torch.long, device=device)[:, protected:]]  # [Hkv, m - p]
        self.cache.move_head_slots(src, new)

    def move_path(self, seq: Sequence, num_nodes: int, nodes: list[int]) -> None:
        """Accepted tree node nodes[j - 1] (its slot after the root's, at cache index root + node) -> cache
        index root + j, in every layer group (before `rollback` drops everything past the path). The root
        (the last committed token) is the slot before the tree's `num_nodes` tentative ones: its cache index
        is the group's own (a compressing policy keeps fewer slots than tokens, per layer).

        Packed formats: the step's window counted only committed tokens, so the nodes are still in open pages'
        full-precision rows (or a token-local codec's codes); the path moves bit for bit, the rejected nodes'
        slots are zeroed, and the pages the path pushed out of the window are sealed now, from the same K/V
        plain decoding would have written there (kvlab.engine.attention.leaving_window)."""
        bm, moves, rejected, sealed = self.block_manager, [], [], set()
        for g in range(len(bm.groups)):
            end = bm.cached_lens([seq], g)[0]
            root = end - num_nodes - 1
            slots = bm.slot_ids(seq, g, root + 1, end)  # node i's slot: slots[i - 1]
            moves += [(slots[node - 1], slots[j - 1]) for j, node in enumerate(nodes, start=1) if node != j]
            rejected += slots[len(nodes):]
            if self.cache.residual is not None:
                sealed |= left_window(bm.block_tables([seq], g)[0], root + 1, root + 1 + len(nodes),
                                      self.cache.residual, bm.block_size)
        self.cache.move_tentative(moves)
        self.cache.clear_slots(rejected)
        self.cache.seal(sealed)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Drop `seq`'s last `num_tokens` slots in every group (rejected tentative tokens)."""
        self.block_manager.rollback(seq, num_tokens)


def left_window(table: list[int], before: int, after: int, residual: int, block_size: int) -> set[int]:
    """Pages of `table` that leave a residual window of `residual` tokens as its committed cache indices grow
    from `before` to `after` (page j leaves once (j + 1) * bs <= length - residual)."""
    first, last = max(0, before - residual) // block_size, max(0, after - residual) // block_size
    return {p for p in table[first:last] if p >= 0}

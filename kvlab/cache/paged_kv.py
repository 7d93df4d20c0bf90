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

With tiers below the pool (`attach_tiers`; docs/design.md, "Tiers below the pool") it is also the mover
of `kvlab.cache.tiers.places.Places`, which calls it at the moment its bookkeeping decides a move:

    demote(page, tier, key)         an evicted prefix-cache page -> a tier (before the page is reused)
    restore_many([(key, tier, page)])  tiers' pages -> fresh pool pages a prefix hit took (then registered), one
                                    copy a page (kvlab.cache.tiers.rows)
    spill(key, src, dst)            a tier's victim -> a slower tier
    discard(key, tier)              a tier's copy goes (dropped, or the pool holds the block again)
    start_read(key, tier) / poll() / wait()   a slow tier's read ahead (into host memory, never into the pool)

Callers (the model runner, the compressor, the speculator) read through the block manager and the
cache as before; they move KV only through here.
"""

from __future__ import annotations

import time
from typing import Hashable

import torch

from kvlab.cache.block_manager import BlockManager
from kvlab.cache.kv_cache import KVCache
from kvlab.cache.tiers.places import Places
from kvlab.cache.tiers.rows import PageRows
from kvlab.cache.tiers.tier import Tier
from kvlab.sequence import Sequence


class PagedKV:
    def __init__(self, block_manager: BlockManager, cache: KVCache):
        self.block_manager = block_manager
        self.cache = cache
        self.tiers: list[Tier] = []
        self.places: Places | None = None
        self._rows: PageRows | None = None

    # -- tiers below the pool ------------------------------------------------------
    def attach_tiers(self, tiers: list[Tier], places: Places) -> None:
        """Pages evicted from the prefix cache go down to `tiers` (fastest first) as `places` decides."""
        self.tiers, self.places = tiers, places
        places.mover = self
        self.block_manager.prefix_cache.attach_places(places)

    @property
    def rows(self) -> PageRows:
        """A page as one row of bytes (every page-indexed pool tensor's slice at its offset)."""
        if self._rows is None:
            self._rows = PageRows(self.cache.page_tensors(), self.cache.page_block())
        return self._rows

    def page_parts(self, page: int) -> list[torch.Tensor]:
        """Views of everything the pool holds for `page`: `t[page]` of every page-indexed tensor, K before V
        (a packed format's codes, scales and zero points: a quantised page moves as what it stores)."""
        return [t[page] for t in self.cache.page_tensors()]

    def page_nbytes(self) -> int:
        """Bytes of one page's row in a tier (its parts, each aligned: kvlab.cache.tiers.rows)."""
        return self.rows.row_bytes

    def _timed(self, nbytes: int, started: float) -> None:
        self.places.stats.bytes_moved += nbytes
        self.places.stats.move_seconds += time.perf_counter() - started

    def demote(self, page: int, tier: int, key: Hashable) -> None:
        """Copy pool `page` into `tiers[tier]` under `key` (the page is about to be reused)."""
        if not self.movable(page):
            raise RuntimeError(f"page {page} is open in a residual row: only sealed pages leave the pool")
        started = time.perf_counter()
        self.tiers[tier].put(key, lambda row: self.rows.gather([page], row))
        self._timed(self.rows.nbytes, started)

    def behind_seconds(self, tier: int) -> float:
        """`tiers[tier]`'s work for one page off the step's thread (CPU seconds; 0 for the host tier)."""
        return self.tiers[tier].behind_seconds()

    def restore(self, key: Hashable, tier: int, page: int) -> None:
        """Copy `key` from `tiers[tier]` into pool `page`, bit for bit; the tier's copy goes."""
        self.restore_many([(key, tier, page)])

    def restore_many(self, items: list[tuple[Hashable, int, int]]) -> dict[int, float]:
        """Copy each (key, tier, page) from its tier into its pool page, bit for bit (one copy a page where the pool
        is one allocation); the tiers' copies go. Seconds per tier: the copy, and the file reads a slow
        tier made for these pages (ahead, on its worker, or now)."""
        seconds = {}
        for t in sorted({tier for _, tier, _ in items}):
            started = time.perf_counter()
            keys = [key for key, tier, _ in items if tier == t]
            pages = [page for _, tier, page in items if tier == t]
            read = self.tiers[t].read_seconds(keys)
            for key, page in zip(keys, pages):  # one copy a page (a gathered run of rows measured slower)
                self.tiers[t].load(key, lambda row, page=page: self.rows.scatter(row, [page]))
            self._timed(self.rows.nbytes * len(keys), started)
            seconds[t] = time.perf_counter() - started + read + self.tiers[t].read_seconds(keys)
        return seconds

    def calibrate(self, sizes: tuple[int, ...] = (1, 8), repeats: int = 3) -> None:
        """Time demotions and restores of runs of `sizes` pages through each tier, `repeats` times after one
        unobserved warm-up (the null page, written back as it is: no pool content changes), and tell the
        placement (`observe_demote`, `observe_restore`): the cost model's start-up rates. A restore is timed
        as a request pays it: the reads ahead started, waited for (the worker's round trip), and copied in;
        written-behind pages are flushed first, so the reads come from the files; where the placement asks for
        cold reads (`cold_calibration`: its pages come back long after they went down), a tier that can drop its
        files from the OS page cache (`drop_cached`) does so before they are read."""
        null = self.cache.page_tensors()[0].shape[0] - 1
        placement = self.places.placement
        cold = bool(getattr(placement, "cold_calibration", False))
        for t, tier in enumerate(self.tiers):
            for i, n in enumerate([sizes[0], *[n for _ in range(repeats) for n in sizes]]):
                keys = [("calibrate", j) for j in range(n)]
                if len(tier) + n > tier.capacity:
                    continue
                started = time.perf_counter()
                for key in keys:
                    tier.put(key, lambda row: self.rows.gather([null], row))
                demoted = time.perf_counter() - started
                tier.flush()
                if cold and hasattr(tier, "drop_cached"):  # read back from the device, as pages written long ago
                    tier.drop_cached(keys)
                started = time.perf_counter()
                for key in keys:
                    tier.start_read(key)
                failed = set()
                while not all(tier.ready(key) or key in failed for key in keys):
                    failed |= {key for key, error in tier.poll() if error is not None}
                    if not all(tier.ready(key) or key in failed for key in keys):
                        tier.wait()
                for key in keys:
                    if key not in failed:
                        tier.load(key, lambda row: self.rows.scatter(row, [null]))
                    else:
                        tier.drop(key)
                if i and not failed:  # the first run warms the worker up
                    placement.observe_demote(t, n, demoted)
                    placement.observe_restore(t, n, time.perf_counter() - started)
            tier.flush()  # the calibration files' removals behind, timed too
            placement.observe_behind(t, tier.behind_seconds())

    def spill(self, key: Hashable, src: int, dst: int) -> None:
        """Move `key` from `tiers[src]` to the slower `tiers[dst]` (row to row)."""
        started = time.perf_counter()
        self.tiers[src].load(key, lambda row: self.tiers[dst].put(key, lambda out: out.copy_(row)))
        self._timed(self.rows.nbytes, started)

    def movable(self, page: int) -> bool:
        """Does the pool hold all of `page` in its parts (not open in a residual row, which stays behind)?"""
        return self.cache.area is None or int(self.cache.area.row_of[page]) < 0

    def discard(self, key: Hashable, tier: int) -> None:
        self.tiers[tier].drop(key)

    def tier_len(self, tier: int) -> int:
        return len(self.tiers[tier])

    def ready(self, key: Hashable, tier: int) -> bool:
        return self.tiers[tier].ready(key)

    def start_read(self, key: Hashable, tier: int) -> None:
        self.tiers[tier].start_read(key)

    def poll(self) -> list[tuple[Hashable, str | None]]:
        return [done for tier in self.tiers for done in tier.poll()]

    def wait(self) -> None:
        """Block until a read in flight in some tier finishes."""
        for tier in self.tiers:
            if tier.in_flight:
                tier.wait()
                return

    def in_flight(self) -> int:
        return sum(tier.in_flight for tier in self.tiers)

    def close_tiers(self) -> None:
        """Drain the tiers (every offloaded page dropped, the prefix cache forgets them) and close them."""
        if self.places is not None:
            self.block_manager.prefix_cache.drain()
        for tier in self.tiers:
            tier.close()

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

    def seal_accepted(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """A verified chain's first `num_accepted` of `num_drafted` tentative tokens are committed: the pages they
        pushed out of the residual window are sealed now, as `move_path` seals a tree's (the batch-invariant
        window counted committed tokens only, kvlab.engine.attention.left_window). Their rows come back at the
        next step's start, so a sequence holds only its window's rows when it next grows (the block manager's
        `capacity_error` counts no more: RowClaims.lone_rows); left open, they would wait for the next write.
        Sealing earlier changes no bit read (a page that left the window is read quantised either way)."""
        bm, sealed = self.block_manager, set()
        if self.cache.residual is None or not num_accepted:
            return
        for g in range(len(bm.groups)):
            root = bm.cached_lens([seq], g)[0] - num_drafted - 1  # the last committed token's cache index
            sealed |= left_window(bm.block_tables([seq], g)[0], root + 1, root + 1 + num_accepted,
                                  self.cache.residual, bm.block_size)
        self.cache.seal(sealed)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Drop `seq`'s last `num_tokens` slots in every group (rejected tentative tokens)."""
        self.block_manager.rollback(seq, num_tokens)


def left_window(table: list[int], before: int, after: int, residual: int, block_size: int) -> set[int]:
    """Pages of `table` that leave a residual window of `residual` tokens as its committed cache indices grow
    from `before` to `after` (page j leaves once (j + 1) * bs <= length - residual)."""
    first, last = max(0, before - residual) // block_size, max(0, after - residual) // block_size
    return {p for p in table[first:last] if p >= 0}

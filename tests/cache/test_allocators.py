"""Allocator invariants under random operation sequences (hypothesis state machines), plus examples.

Each machine drives one allocator through random allocate / append_slots /
fork / truncate / release_before / free / take_copies steps, guarded by the
matching can_* check (and when can_* says no, the action must raise
OutOfBlocks and change nothing), and checks after every step that no block is
leaked or double-owned and that the free space adds up. Torch-free.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlab.cache.allocators.base import NULL_BLOCK, OutOfBlocks
from kvlab.registry import ALLOCATORS

BLOCK_SIZES = [1, 4, 16]
MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])


def make(name: str, num_blocks: int, block_size: int, max_model_len: int | None = None, **params):
    a = ALLOCATORS.build(name, **params)
    a.setup(num_blocks, block_size, max_model_len)
    return a


class AllocatorMachine(RuleBasedStateMachine):
    """Shared rules; subclasses set `name` / `params` and add allocator-specific invariants."""

    name = ""
    params: dict = {}

    @initialize(block_size=st.sampled_from(BLOCK_SIZES), num_blocks=st.integers(1, 24), data=st.data())
    def setup(self, block_size, num_blocks, data):
        self.max_model_len = data.draw(st.integers(1, num_blocks * block_size), label="max_model_len")
        self.a = make(self.name, num_blocks, block_size, self.max_model_len, **self.params, **self.draw_params(data))
        self.bs = block_size
        self.lengths: dict[int, int] = {}  # model: seq_id -> tokens
        self.released: dict[int, int] = {}  # model: seq_id -> leading blocks released by release_before
        self.next_id = 0
        self.allocate(num_tokens=1, extra=0)  # one sequence from the start: every rule is enabled at once
        assert self.lengths == {0: 1}

    # -- helpers ---------------------------------------------------------------
    def draw_params(self, data) -> dict:
        """Allocator parameters drawn per example (on top of the class's fixed `params`)."""
        return {}

    def _snapshot(self):
        return copy.deepcopy({k: v for k, v in vars(self.a).items()})

    def _pick(self, data, label="seq"):
        return data.draw(st.sampled_from(sorted(self.lengths)), label=label)

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _expect_out_of_blocks(self, action):
        before = self._snapshot()
        with pytest.raises(OutOfBlocks):
            action()
        assert self._snapshot() == before, "a refused action changed the allocator"

    # -- rules -----------------------------------------------------------------
    @rule(num_tokens=st.integers(1, 48), extra=st.integers(0, 32))
    def allocate(self, num_tokens, extra):
        seq = self._new_id()
        if self.a.can_allocate(num_tokens, num_tokens + extra):
            free_before = self.a.num_free_blocks
            self.a.allocate(seq, num_tokens, num_tokens + extra)
            self.lengths[seq], self.released[seq] = num_tokens, 0
            taken = free_before - self.a.num_free_blocks
            assert taken == self.a.blocks_for(self.a.reservation(num_tokens, num_tokens + extra))
            kept_back = self.a.num_blocks - self.a.usable_blocks
            assert self.a.num_free_blocks >= kept_back, "admission ate into the blocks kept back"
        else:
            event("allocate refused")
            self._expect_out_of_blocks(lambda: self.a.allocate(seq, num_tokens, num_tokens + extra))

    @precondition(lambda self: self.lengths)
    @rule(n=st.integers(0, 20), data=st.data())
    def append(self, n, data):
        seq = self._pick(data)
        if self.a.can_append(seq, n):
            self.a.append_slots(seq, n)
            self.lengths[seq] += n
        else:
            event("append refused")
            self._expect_out_of_blocks(lambda: self.a.append_slots(seq, n))

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data):
        seq = self._pick(data)
        self.a.free(seq)
        del self.lengths[seq], self.released[seq]
        assert seq not in self.a.tables and seq not in self.a.lengths

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def truncate(self, data):
        seq = self._pick(data)
        # never back into released blocks: their tokens are gone (truncate only rolls back recent tokens)
        lo = min(self.released[seq] * self.bs, self.lengths[seq])
        k = data.draw(st.integers(lo, self.lengths[seq]), label="truncate_to")
        self.a.truncate(seq, k)
        self.lengths[seq] = k
        self.released[seq] = min(self.released[seq], self.a.blocks_for(k))

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def truncate_past_the_end_is_refused(self, data):
        seq = self._pick(data)
        before = self._snapshot()
        with pytest.raises(ValueError, match="cannot truncate"):
            self.a.truncate(seq, self.lengths[seq] + 1)
        assert self._snapshot() == before

    @rule()
    def take_copies(self):
        pending = list(self.a.pending_copies)
        assert self.a.take_copies() == pending
        assert self.a.pending_copies == []

    # -- invariants shared by every allocator -----------------------------------
    @invariant()
    def lengths_match_the_model(self):
        if not hasattr(self, "a"):
            return
        assert self.a.lengths == self.lengths
        assert set(self.a.tables) == set(self.lengths)

    @invariant()
    def slot_ids_are_distinct_and_in_the_pool(self):
        if not hasattr(self, "a"):
            return
        pool = self.a.num_blocks * self.bs
        for seq, length in self.lengths.items():
            start = self.released[seq] * self.bs
            slots = self.a.slot_ids(seq, start, length)
            assert len(set(slots)) == len(slots), f"seq {seq} has repeated slots"
            assert all(0 <= s < pool for s in slots), f"seq {seq} has a slot outside the pool: {slots}"

    @invariant()
    def used_plus_free_is_the_pool(self):
        if not hasattr(self, "a"):
            return
        assert 0 <= self.a.num_free_blocks <= self.a.num_blocks
        assert self.a.num_used_blocks + self.a.num_free_blocks == self.a.num_blocks

    @invariant()
    def pending_copies_are_between_distinct_blocks(self):
        if not hasattr(self, "a"):
            return
        for src, dst in self.a.pending_copies:
            assert src != dst and 0 <= src < self.a.num_blocks and 0 <= dst < self.a.num_blocks


class PagedMachine(AllocatorMachine):
    name = "paged"

    def draw_params(self, data) -> dict:
        # watermark 0 half the time; otherwise admission keeps int(watermark * num_blocks) blocks back
        watermark = data.draw(st.sampled_from([0.0, 0.0, 0.1, 0.25, 0.5, 0.9]), label="watermark")
        if watermark:
            event("watermark set")
        return {"watermark": watermark}

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data, "parent")
        child = self._new_id()
        free_before = self.a.num_free_blocks
        self.a.fork(parent, child)  # sharing needs no free block: never refused
        assert self.a.num_free_blocks == free_before
        assert self.a.block_table(child) == self.a.block_table(parent)
        self.lengths[child], self.released[child] = self.lengths[parent], self.released[parent]

    @precondition(lambda self: self.lengths)
    @rule(n=st.integers(1, 20), data=st.data())
    def append_writes_only_private_blocks(self, n, data):
        self._append_private(self._pick(data), n)

    @precondition(lambda self: self.lengths)
    @rule(n=st.integers(1, 6), write_child=st.booleans(), data=st.data())
    def fork_then_write(self, n, write_child, data):
        self.fork(data)
        child = self.next_id - 1
        self._append_private(child if write_child else self._pick(data, "writer"), n)

    def _append_private(self, seq, n):
        """Copy-on-write: new tokens never land in a block another sequence also holds."""
        table = list(self.a.block_table(seq))
        length = self.lengths[seq]
        last = table[-1] if table else None
        shared_partial = last is not None and length % self.bs and self.a.ref_counts[last] > 1
        if not self.a.can_append(seq, n):
            self._expect_out_of_blocks(lambda: self.a.append_slots(seq, n))
            return
        self.a.append_slots(seq, n)
        self.lengths[seq] += n
        for slot in self.a.slot_ids(seq, length, length + n):
            assert self.a.ref_counts[slot // self.bs] == 1, "a new token was written into a shared block"
        if shared_partial:
            event("copy-on-write")
            new_last = self.a.block_table(seq)[len(table) - 1]
            assert new_last != last
            assert (last, new_last) in self.a.pending_copies

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def release_before(self, data):
        seq = self._pick(data)
        index = data.draw(st.integers(0, self.lengths[seq]), label="token_index")
        table_before = list(self.a.block_table(seq))
        free_before = self.a.num_free_blocks
        released = self.a.release_before(seq, index)
        table = self.a.block_table(seq)
        whole = min(index // self.bs, len(table))
        assert released == sum(1 for b in table_before[:whole] if b != NULL_BLOCK)
        assert table[:whole] == [NULL_BLOCK] * whole
        assert table[whole:] == table_before[whole:], "a block holding a token at/after the index was released"
        assert self.a.num_free_blocks >= free_before  # shared blocks stay with their other owners
        self.released[seq] = max(self.released[seq], whole)
        if released:
            event("release_before freed blocks")

    @invariant()
    def ref_counts_match_table_entries(self):
        if not hasattr(self, "a"):
            return
        owners = [0] * self.a.num_blocks
        for seq, table in self.a.tables.items():
            assert len(table) == self.a.blocks_for(self.a.lengths[seq])
            for b in table:
                if b != NULL_BLOCK:
                    owners[b] += 1
        assert self.a.ref_counts == owners

    @invariant()
    def free_list_is_exactly_the_unowned_blocks(self):
        if not hasattr(self, "a"):
            return
        free = list(self.a.free_blocks)
        assert len(free) == len(set(free)), f"free list has duplicates: {free}"
        assert set(free) == {b for b, r in enumerate(self.a.ref_counts) if r == 0}
        owned = {b for t in self.a.tables.values() for b in t if b != NULL_BLOCK}
        assert self.a.num_free_blocks + len(owned) == self.a.num_blocks


class ContiguousMachine(AllocatorMachine):
    name = "contiguous"
    params = {"reserve": "max_model_len"}

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data, "parent")
        child = self._new_id()
        n = self.a.reserved[parent]
        if any(length >= n for _, length in self.a.runs):
            copies_before = len(self.a.pending_copies)
            self.a.fork(parent, child)
            self.lengths[child], self.released[child] = self.lengths[parent], 0
            assert self.a.reserved[child] == n
            used = self.a.blocks_for(self.lengths[parent])
            new = self.a.pending_copies[copies_before:]
            assert new == list(zip(self.a.block_table(parent)[:used], self.a.block_table(child)[:used]))
        else:  # no run big enough: refused, nothing changes
            event("fork refused")
            self._expect_out_of_blocks(lambda: self.a.fork(parent, child))

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def release_before(self, data):
        seq = self._pick(data)
        index = data.draw(st.integers(0, self.lengths[seq]), label="token_index")
        before = self._snapshot()
        assert self.a.release_before(seq, index) == 0  # a reservation is held whole
        assert self._snapshot() == before

    @invariant()
    def reservations_are_disjoint_runs(self):
        if not hasattr(self, "a"):
            return
        owned: set[int] = set()
        for seq, table in self.a.tables.items():
            n = self.a.reserved[seq]
            assert n >= 1 and table == list(range(table[0], table[0] + n))
            assert self.a.lengths[seq] <= n * self.bs
            assert owned.isdisjoint(table), f"seq {seq} overlaps another reservation"
            owned.update(table)
        assert set(self.a.reserved) == set(self.a.tables)
        free = [b for start, n in self.a.runs for b in range(start, start + n)]
        assert owned.isdisjoint(free)
        assert len(free) + len(owned) == self.a.num_blocks

    @invariant()
    def free_runs_are_sorted_disjoint_and_merged(self):
        if not hasattr(self, "a"):
            return
        runs = self.a.runs
        assert all(n > 0 and 0 <= start and start + n <= self.a.num_blocks for start, n in runs)
        for (s0, n0), (s1, _) in zip(runs, runs[1:]):
            assert s0 + n0 < s1, f"free runs overlap, are unsorted or are not merged: {runs}"
        assert self.a.num_free_blocks == sum(n for _, n in runs)
        assert self.a.num_free_blocks + sum(self.a.reserved.values()) == self.a.num_blocks


class ContiguousRequestMachine(ContiguousMachine):
    params = {"reserve": "request"}


TestPagedAllocator = PagedMachine.TestCase
TestPagedAllocator.settings = MACHINE_SETTINGS
TestContiguousAllocator = ContiguousMachine.TestCase
TestContiguousAllocator.settings = MACHINE_SETTINGS
TestContiguousRequestAllocator = ContiguousRequestMachine.TestCase
TestContiguousRequestAllocator.settings = MACHINE_SETTINGS


# -- examples ----------------------------------------------------------------------
def test_contiguous_external_fragmentation_counts_holes_too_small_for_the_request():
    a = make("contiguous", 10, 4, reserve="request")
    for seq, tokens in enumerate([8, 12, 8]):  # blocks [0,2) [2,5) [5,7); free [7,10)
        a.allocate(seq, tokens, tokens)
    a.free(1)  # hole [2,5)
    assert a.runs == [(2, 3), (7, 3)]
    assert a.num_free_blocks == 6
    assert not a.can_allocate(16, 16)  # 4 blocks needed, 6 free, but no run of 4
    with pytest.raises(OutOfBlocks):
        a.allocate(9, 16, 16)
    assert a.external_fragmentation(16) == 6 * 4  # both holes are useless to it
    assert a.external_fragmentation(12) == 0  # a 3-block request fits either hole
    assert make("paged", 10, 4).external_fragmentation(16) == 0
    a.free(2)  # [2,5) + [5,7) + [7,10) merge into one run
    assert a.runs == [(2, 8)]
    assert a.can_allocate(16, 16)


def test_contiguous_reserves_the_request_by_default_and_max_model_len_when_asked():
    a = make("contiguous", 16, 4, max_model_len=32, reserve="max_model_len")
    a.allocate(0, 5, 6)
    assert a.reserved[0] == 8 and a.allocated_slots(0) == 32
    b = make("contiguous", 16, 4, max_model_len=32)
    assert b.reserve == "request"
    b.allocate(0, 5, 6)
    assert b.reserved[0] == 2 and b.allocated_slots(0) == 8
    assert not b.can_append(0, 4)  # 9 tokens outgrow the 8-slot reservation
    with pytest.raises(OutOfBlocks, match="outgrow"):
        b.append_slots(0, 4)


def test_contiguous_pow2_reserves_the_request_rounded_up_to_a_power_of_two():
    a = make("contiguous", 128, 1, max_model_len=48, reserve="pow2")  # Orca (Pow2), Kwon et al. Fig. 2
    a.allocate(0, 5, 9)
    assert a.allocated_slots(0) == 16  # 9 -> 16
    a.allocate(1, 3, 8)
    assert a.allocated_slots(1) == 8  # a power of two stays
    a.allocate(2, 3, 40)
    assert a.allocated_slots(2) == 48  # 64 would pass max_model_len: capped there
    with pytest.raises(ValueError, match="pow2"):
        ALLOCATORS.build("contiguous", reserve="pow3")


def test_paged_release_before_frees_only_whole_blocks_before_the_index():
    a = make("paged", 8, 4)
    a.allocate(0, 10, 10)  # blocks for tokens 0-3, 4-7, 8-9
    b0, b1, b2 = a.block_table(0)
    assert a.release_before(0, 3) == 0  # block 0 still holds token 3
    assert a.release_before(0, 7) == 1  # tokens 0-3 are all before 7; block 1 holds 7
    assert a.block_table(0) == [NULL_BLOCK, b1, b2]
    assert a.num_free_blocks == 6 and b0 in a.free_blocks
    assert a.release_before(0, 7) == 0  # idempotent
    assert a.release_before(0, 8) == 1
    assert a.block_table(0) == [NULL_BLOCK, NULL_BLOCK, b2]
    assert a.allocated_slots(0) == 4
    a.free(0)
    assert a.num_free_blocks == 8 and sorted(a.free_blocks) == list(range(8))


def test_paged_release_before_keeps_a_block_still_shared_by_a_fork():
    a = make("paged", 8, 4)
    a.allocate(0, 8, 8)
    a.fork(0, 1)
    shared = a.block_table(0)[0]
    assert a.release_before(0, 4) == 1
    assert a.ref_counts[shared] == 1 and shared not in a.free_blocks  # the fork still reads it
    assert a.block_table(1)[0] == shared
    assert a.num_free_blocks == 6


def test_paged_fork_then_append_copies_the_shared_partial_last_block():
    a = make("paged", 8, 4)
    a.allocate(0, 6, 6)  # last block half full
    a.fork(0, 1)
    assert a.num_free_blocks == 6  # nothing copied yet
    parent_last = a.block_table(0)[-1]
    a.append_slots(1, 1)
    child_last = a.block_table(1)[-1]
    assert child_last != parent_last
    assert a.block_table(1)[0] == a.block_table(0)[0]  # the full first block stays shared
    assert a.take_copies() == [(parent_last, child_last)]
    assert a.ref_counts[parent_last] == 1 and a.ref_counts[child_last] == 1
    a.append_slots(0, 1)  # the parent now owns its last block alone: no copy
    assert a.block_table(0)[-1] == parent_last and a.take_copies() == []


def test_paged_fork_on_a_block_boundary_needs_no_copy():
    a = make("paged", 8, 4)
    a.allocate(0, 8, 8)
    a.fork(0, 1)
    a.append_slots(1, 1)
    assert a.pending_copies == []
    assert a.block_table(1)[:2] == a.block_table(0)
    assert len(a.block_table(1)) == 3


def test_paged_copy_on_write_counts_the_copy_when_checking_room():
    a = make("paged", 2, 4)
    a.allocate(0, 6, 6)  # both blocks
    a.fork(0, 1)
    assert a.num_free_blocks == 0
    assert not a.can_append(1, 1)  # writing needs a private copy of the shared last block
    with pytest.raises(OutOfBlocks):
        a.append_slots(1, 1)
    a.free(0)
    assert a.can_append(1, 1)  # sole owner again: write in place
    a.append_slots(1, 1)
    assert a.pending_copies == [] and a.num_free_blocks == 0


def test_paged_watermark_keeps_blocks_back_from_admission():
    a = make("paged", 10, 4, watermark=0.2)
    assert a.can_allocate(32, 32)  # 8 blocks <= 10 - 2
    assert not a.can_allocate(33, 33)  # 9 blocks would eat into the 2 kept back
    with pytest.raises(ValueError, match="watermark"):
        ALLOCATORS.build("paged", watermark=1.0)


def test_paged_watermark_refuses_allocate_exactly_when_can_allocate_does():
    a = make("paged", 16, 1, watermark=0.5)  # 8 of 16 blocks kept back from admission
    assert not a.can_allocate(12, 12)  # 12 blocks free would fit, but only 8 may be admitted
    with pytest.raises(OutOfBlocks, match="watermark"):
        a.allocate(0, 12, 12)
    assert a.num_free_blocks == 16 and a.tables == {}
    assert a.can_allocate(8, 8)
    a.allocate(0, 8, 8)
    a.append_slots(0, 4)  # growth may use the reserve: only admission is held back
    assert a.num_free_blocks == 4 and not a.can_allocate(1, 1)
    with pytest.raises(OutOfBlocks):
        a.allocate(1, 1, 1)


def test_setup_rejects_an_empty_pool():
    with pytest.raises(ValueError, match="at least one block"):
        make("paged", 0, 4)
    with pytest.raises(ValueError, match="block_size"):
        make("contiguous", 4, 0)


def test_paged_release_blocks_checks_every_index_before_releasing_any():
    """An index past the table is refused before any page goes (the policy's eviction either happens or not)."""
    a = ALLOCATORS.build("paged")
    a.setup(8, 4)
    a.allocate(0, 12, 12)
    table, free = list(a.block_table(0)), a.num_free_blocks
    with pytest.raises(ValueError, match="has no block 5"):
        a.release_blocks(0, [0, 5])
    assert a.block_table(0) == table and a.num_free_blocks == free
    assert a.release_blocks(0, [2, 0, 2]) == 2 and a.block_table(0) == [NULL_BLOCK, table[1], NULL_BLOCK]
    assert a.release_before(0, 8) == 1 and a.block_table(0) == [NULL_BLOCK] * 3 and a.num_free_blocks == free + 3

"""Pages under speculation: allocator invariants over random propose / accept-k / reject-all /
preempt / finish sequences, chains and token trees (a hypothesis state machine; torch-free, no model).

It drives the real Scheduler, BlockManager and paged allocator the way the engine does: drafts
set before scheduling, tentative slots appended by the scheduler, `advance` with the rejected
counts (rollback), the emitted tokens appended, out-of-window pages released. After every step no
page is leaked or double-freed, reference counts match the tables, and every running sequence
holds exactly the slots of its computed tokens (no tentative slot survives a step). Token trees:
the drafts get random parents (a tree in preorder), the scheduler may cut them to a prefix (still a
tree), and verification accepts one root-to-node path (its depth is what stays). Tree drafting's
branches: forks of a running sequence that grow slots of their own (copy-on-write on the shared
last page) and are freed, as the tree draft does in its pool.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlab.cache.allocators.base import NULL_BLOCK
from kvlab.cache.allocators.paged import PagedAllocator
from kvlab.cache.block_manager import BlockManager, LayerGroup
from kvlab.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.sequence import Sequence, SequenceStatus

BLOCK, NUM_BLOCKS, WINDOW = 2, 40, 6


class SpeculationMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        groups = [LayerGroup((0,)), LayerGroup((1,), sliding_window=WINDOW)]
        self.bm = BlockManager(groups, PagedAllocator(), NUM_BLOCKS, BLOCK, max_model_len=64, max_chunk=12)
        self.scheduler = Scheduler(self.bm, max_num_seqs=6, max_num_batched_tokens=12)
        self.next_id = 0

    @rule(prompt=st.integers(1, 14), max_tokens=st.integers(1, 12))
    def add(self, prompt, max_tokens):
        seq = Sequence(self.next_id, [7] * prompt, SamplingParams(max_tokens=max_tokens), prompt + max_tokens, 0.0)
        self.next_id += 1
        if self.bm.capacity_error(seq) is None:
            self.scheduler.add(seq)

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(data=st.data())
    def step(self, data):
        # propose: up to 4 drafts for every running decoding sequence (never past max_tokens)
        for seq in self.scheduler.running:
            room = min(4, seq.max_len - seq.num_tokens - 1)
            decoding = seq.num_uncomputed_tokens == 1
            seq.draft_token_ids = [9] * data.draw(st.integers(0, room)) if decoding and room > 0 else []
            tree = seq.draft_token_ids and data.draw(st.booleans())
            seq.draft_parents = [data.draw(st.integers(-1, i - 1)) for i in range(len(seq.draft_token_ids))] \
                if tree else []
        batch = self.scheduler.schedule()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):  # tentative slots are appended
            assert self.bm.cached_lens([seq], 0)[0] == seq.num_computed_tokens + n
            assert n == seq.num_uncomputed_tokens + len(seq.draft_token_ids) or not seq.draft_token_ids
        # verify: accept all (accept-k), none (reject-all) or a prefix; emit one more token
        rejected, emitted = {}, []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            k = len(seq.draft_token_ids)
            if seq.num_computed_tokens + n - k < seq.num_tokens:
                continue  # a prefill chunk that samples nothing
            parents = seq.draft_parents
            assert len(parents) in (0, k) and all(-1 <= p < i for i, p in enumerate(parents)), "not a tree"
            if parents:  # accept the path to a random node (or none): its depth
                node = data.draw(st.integers(-1, k - 1))
                accepted = 0
                while node >= 0:
                    node, accepted = parents[node], accepted + 1
            else:
                accepted = data.draw(st.sampled_from([0, k, data.draw(st.integers(0, k))]))
            rejected[seq.seq_id] = k - accepted
            emitted.append((seq, seq.draft_token_ids[:accepted] + [3]))
        self.scheduler.advance(batch, rejected)
        for seq, tokens in emitted:
            for token in tokens:
                seq.token_ids.append(token)
                if seq.num_tokens >= seq.max_len or data.draw(st.integers(0, 9)) == 0:  # max_tokens or a stop
                    self.scheduler.finish(seq, "stop")
                    break
        for seq in self.scheduler.running:
            self.bm.release_out_of_window(seq)

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def branch(self, data):
        """A tree draft's branches: forks of a sequence that grow their own slots, then are freed."""
        parent = data.draw(st.sampled_from(self.scheduler.running))
        forks = []
        for _ in range(data.draw(st.integers(1, 3))):
            fork = Sequence(-1 - len(forks), list(parent.token_ids), parent.params, parent.max_len, 0.0)
            self.bm.fork(parent, fork)
            forks.append(fork)
            grow = data.draw(st.integers(0, 3))
            if self.bm.can_append(fork, grow):
                self.bm.append(fork, grow)
        self.bm.take_copies()  # the copy-on-write copies a runner would make
        for fork in forks:
            self.bm.free(fork)

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def preempt(self, data):
        self.scheduler.preempt(data.draw(st.sampled_from(self.scheduler.running)))

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def finish(self, data):
        self.scheduler.finish(data.draw(st.sampled_from(self.scheduler.running)), "abort")

    @invariant()
    def pages_are_accounted_for(self):
        a = self.bm.allocator
        refs = [0] * NUM_BLOCKS
        for table in a.tables.values():
            for block in table:
                if block != NULL_BLOCK:
                    refs[block] += 1
        assert refs == a.ref_counts, "reference counts disagree with the tables"
        assert len(set(a.free_blocks)) == len(a.free_blocks), "a page is free twice"
        assert sorted(a.free_blocks) == [b for b in range(NUM_BLOCKS) if refs[b] == 0], "a page leaked"

    @invariant()
    def sequences_hold_exactly_their_computed_tokens(self):
        a = self.bm.allocator
        for seq in self.scheduler.running:
            for g in range(len(self.bm.groups)):
                key = self.bm.key(seq, g)
                assert a.num_tokens(key) == seq.num_computed_tokens, "a tentative slot survived the step"
                assert len(a.tables[key]) == a.blocks_for(seq.num_computed_tokens)
        for seq in self.scheduler.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.draft_token_ids and not seq.draft_parents
            assert all(self.bm.key(seq, g) not in a.tables for g in range(len(self.bm.groups)))

    def teardown(self):
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq, "abort")
        assert self.bm.allocator.num_free_blocks == NUM_BLOCKS


SpeculationMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSpeculationPages = SpeculationMachine.TestCase

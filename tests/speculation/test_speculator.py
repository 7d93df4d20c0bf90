"""The speculator's bookkeeping (kvlab/speculation/speculator.py) without a model: a scripted draft, a
fake target's logits rows and a hand-built pool. Proposals are cut to what fits, greedy verification
accepts the prefix the target agrees with and adds its token, the rejected tentative slots are what
rollback frees, a token tree's accepted path is moved after the last committed token, the adaptive
length follows acceptance, and a finished or aborted sequence leaves nothing behind."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kvlab.cache.allocators.paged import PagedAllocator
from kvlab.cache.block_manager import BlockManager, LayerGroup
from kvlab.cache.kv_cache import KVCache
from kvlab.cache.paged_kv import PagedKV
from kvlab.registry import QUANT_FORMATS, load_plugins
from kvlab.sampling_params import SamplingParams
from kvlab.sequence import Sequence
from kvlab.speculation.drafts.base import DraftModel, Proposal
from kvlab.speculation.speculator import Speculator

V, BS, HKV, DIM = 32, 4, 1, 4


@dataclass
class Scripted(DraftModel):
    """Proposes `script[seq_id]` (tokens, parents or None), cut to the length asked for."""

    script: dict = field(default_factory=dict)
    forgotten: list = field(default_factory=list)
    registry_name = "scripted"

    def propose(self, seqs, lengths, generators):
        return [Proposal(self.script[s.seq_id][0][:n], None, self.script[s.seq_id][1]) for s, n in zip(seqs, lengths)]

    def forget(self, seq_id):
        self.forgotten.append(seq_id)

    def num_tracked(self):
        return len(set(self.script) - set(self.forgotten))


def decoding(seq_id: int, prompt: int = 5, max_tokens: int = 10) -> Sequence:
    """A sequence that has sampled one token after its prompt: that token is the one left to compute."""
    seq = Sequence(seq_id, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), prompt + max_tokens, 0.0)
    seq.token_ids.append(7)
    seq.num_computed_tokens = prompt
    return seq


def target(argmaxes: list[int]) -> torch.Tensor:
    """Logits rows whose greedy token is argmaxes[i]."""
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


def pool():
    load_plugins()
    groups = [LayerGroup((0,))]
    bm = BlockManager(groups, PagedAllocator(), 16, BS, 64, 64)
    cache = KVCache(groups, 16, BS, HKV, DIM, QUANT_FORMATS.build("fp32"), torch.float32, "cpu")
    return bm, cache, PagedKV(bm, cache)


def test_propose_drafts_only_decoding_sequences_and_leaves_room_for_the_bonus_token():
    draft = Scripted(num_tokens=4, script={0: ([3, 4, 5, 6], None), 1: ([8, 9, 10, 11], None),
                                           2: ([1, 1, 1, 1], None)})
    spec = Speculator(draft, V)
    near_end = decoding(1, max_tokens=3)  # 6 tokens of at most 8: one draft and the bonus token
    prefilling = decoding(2)
    prefilling.num_computed_tokens = 2
    seqs = [decoding(0), near_end, prefilling]
    spec.propose(seqs, {})
    assert [s.draft_token_ids for s in seqs] == [[3, 4, 5, 6], [8], []]


def test_a_draft_outside_the_vocabulary_is_refused_and_leaves_no_drafts():
    spec = Speculator(Scripted(num_tokens=2, script={0: ([3, V], None)}), V)
    seq = decoding(0)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        spec.propose([seq], {})
    assert seq.draft_token_ids == []


@pytest.mark.parametrize("agree,emitted", [(0, [20]), (2, [3, 4, 20]), (4, [3, 4, 5, 6, 20])])
def test_greedy_verification_accepts_the_prefix_the_target_agrees_with_and_its_token(agree, emitted):
    spec = Speculator(Scripted(num_tokens=4, script={0: ([3, 4, 5, 6], None)}), V)
    seq = decoding(0)
    spec.propose([seq], {})
    rows = [3, 4, 5, 6][:agree] + [20] + [21] * (4 - agree)  # the target's token after each prefix
    out = SimpleNamespace(verify_rows=[(seq, [0, 1, 2, 3, 4])], logits=target(rows))
    got, rejected = spec.verify(out, {})
    assert got == [(seq, emitted)] and rejected == {0: 4 - agree}
    assert (spec.num_drafted, spec.num_accepted, spec.num_emitted) == (4, agree, agree + 1)
    assert spec.tried == [1] * min(agree + 1, 4) + [0] * (3 - agree) and spec.took == [1] * agree + [0] * (4 - agree)


def test_two_sequences_in_one_batch_are_verified_on_their_own_rows():
    spec = Speculator(Scripted(num_tokens=3, script={0: ([3, 4, 5], None), 1: ([8, 9], None)}), V)
    a, b = decoding(0), decoding(1)
    spec.propose([a, b], {})
    out = SimpleNamespace(verify_rows=[(a, [0, 1, 2, 3]), (b, [4, 5, 6])], logits=target([3, 9, 9, 9, 8, 9, 30]))
    got, rejected = spec.verify(out, {})
    assert got == [(a, [3, 9]), (b, [8, 9, 30])] and rejected == {0: 2, 1: 0}


def test_rollback_of_the_rejected_drafts_frees_their_tentative_slots():
    """Six committed tokens (the last one computed this step) and four drafts in tentative slots: ten slots
    in three pages; two drafts rejected leave eight slots in two pages, holding the committed tokens'
    and the accepted drafts' K/V."""
    bm, cache, kv = pool()
    spec = Speculator(Scripted(num_tokens=4, script={0: ([3, 4, 5, 6], None)}), V, kv)
    seq = decoding(0)
    bm.allocate(seq, 5)
    spec.propose([seq], {})
    bm.append(seq, 1 + len(seq.draft_token_ids))
    slots = torch.tensor(bm.slot_ids(seq, 0, 0, 10))
    k = torch.randn(10, HKV, DIM)
    cache.begin_step([slots])
    cache.store(0, k, -k, slots)
    assert bm.num_used_blocks() == 3
    _, rejected = spec.verify(SimpleNamespace(verify_rows=[(seq, [0, 1, 2, 3, 4])], logits=target([3, 4, 9, 9, 9])),
                              {})
    kv.rollback(seq, rejected[seq.seq_id])
    assert bm.cached_lens([seq], 0)[0] == 8 and bm.num_used_blocks() == 2
    got_k, got_v = cache.read_slots(0, torch.tensor(bm.slot_ids(seq, 0, 0, 8)), torch.float32)
    assert torch.equal(got_k, k[:8]) and torch.equal(got_v, -k[:8])


def test_a_token_trees_accepted_path_moves_after_the_last_committed_token():
    """Nodes 1 and 2 are children of the root, 3 a child of 2: the target takes 2 then 3, so their K/V
    (cache indices 7 and 8) move to 6 and 7, and rollback drops one slot."""
    bm, cache, kv = pool()
    spec = Speculator(Scripted(num_tokens=3, script={0: ([3, 4, 5], [-1, -1, 1])}), V, kv)
    seq = decoding(0)
    bm.allocate(seq, 5)
    spec.propose([seq], {})
    assert seq.draft_parents == [-1, -1, 1]
    bm.append(seq, 4)
    slots = torch.tensor(bm.slot_ids(seq, 0, 0, 9))
    k = torch.randn(9, HKV, DIM)
    cache.begin_step([slots])
    cache.store(0, k, k, slots)
    out = SimpleNamespace(verify_rows=[(seq, [0, 1, 2, 3])], logits=target([4, 9, 5, 22]))
    got, rejected = spec.verify(out, {})
    assert got == [(seq, [4, 5, 22])] and rejected == {0: 1}
    kv.rollback(seq, rejected[0])
    assert torch.equal(cache.read_slots(0, torch.tensor(bm.slot_ids(seq, 0, 0, 8)), torch.float32)[0],
                       k[[0, 1, 2, 3, 4, 5, 7, 8]])
    assert spec.num_tree_nodes == 3 and (spec.num_drafted, spec.num_accepted) == (2, 2)  # depth 2, both taken


def test_a_sliding_window_cuts_a_tree_that_could_reach_past_it_to_its_first_child_chain():
    kv = SimpleNamespace(block_manager=SimpleNamespace(groups=[LayerGroup((0,)), LayerGroup((1,), sliding_window=8)]))
    spec = Speculator(Scripted(num_tokens=4, script={0: ([3, 4, 5, 6], [-1, 0, -1, 2])}), V, kv)
    seq = decoding(0)  # 6 tokens + 4 drafts > the window of 8
    spec.propose([seq], {})
    assert seq.draft_token_ids == [3, 4] and seq.draft_parents == []


def test_the_adaptive_length_grows_on_a_full_accept_and_shrinks_on_a_rejection():
    spec = Speculator(Scripted(num_tokens=2, adaptive=True, max_num_tokens=3, script={0: ([3, 4, 5], None)}), V)
    seq = decoding(0)
    for argmaxes, length in (([3, 4, 9], 3), ([3, 4, 5, 9], 3), ([9, 9, 9, 9], 2)):
        spec.propose([seq], {})
        spec.verify(SimpleNamespace(verify_rows=[(seq, list(range(len(argmaxes))))], logits=target(argmaxes)), {})
        assert spec.length(seq) == length


def test_finished_and_aborted_sequences_are_forgotten_a_dropped_one_keeps_its_length():
    draft = Scripted(num_tokens=2, adaptive=True, script={0: ([3, 4], None), 1: ([3, 4], None)})
    spec = Speculator(draft, V)
    a, b = decoding(0), decoding(1)
    spec.propose([a, b], {})
    spec.verify(SimpleNamespace(verify_rows=[(a, [0, 1, 2]), (b, [3, 4, 5])], logits=target([3, 4, 9] * 2)), {})
    assert spec.num_tracked() == 2 + 2
    spec.on_sequence("dropped", a)
    assert spec.length(a) == 3 and spec.num_tracked() == 4
    spec.on_sequence("aborted", a)
    spec.on_sequence("finished", b)
    assert spec.num_tracked() == 0 and draft.forgotten == [0, 1] and spec.length(a) == 2

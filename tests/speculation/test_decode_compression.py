"""Drafts with a policy compressing during decode (when="decode"; policies/verify_rows.py): a verify step never
runs past the sequence's next compression point, only the rows verification kept reach the policy (their
queries, their attention mass, row by row), and a point the kept rows did not reach is not compressed. So at
every compression the policy sees what plain decoding showed it, and the output is the draft-free one."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.cache.allocators.paged import PagedAllocator
from kvlab.cache.block_manager import BlockManager, LayerGroup
from kvlab.cache.kv_cache import KVCache
from kvlab.cache.paged_kv import PagedKV
from kvlab.policies.base import Policy
from kvlab.policies.compressor import Compressor
from kvlab.policies.verify_rows import add_rows, row_mass
from kvlab.registry import QUANT_FORMATS, load_plugins
from kvlab.sampling_params import SamplingParams as Params
from kvlab.sequence import Sequence
from kvlab.testing import check_combination
from kvlab.testing.builtin_args import DRAFT_ARGS, POLICY_ARGS, TINY

pytestmark = pytest.mark.usefixtures("one_thread")
BS, HKV, HQ, DIM, LAYERS = 4, 2, 4, 8, (0, 1)
DECODING = sorted(set(POLICY_ARGS) - {"adakv", "rocketkv"})  # the built-ins that accept when="decode"
EVERY = 4  # a compression every 4 tokens: a 12-token answer crosses three points


def decode_args(policy: str, draft: str, every: int = EVERY) -> dict:
    return dict(policy=policy, policy_args={**POLICY_ARGS[policy], "when": "decode", "every": every},
                draft=draft, draft_args=DRAFT_ARGS[draft])


# -- the combination suite --------------------------------------------------------------------------------

@pytest.mark.parametrize("policy, draft", [("snapkv", "ngram"), ("h2o", "model")])  # the rest: heavy, below
def test_a_draft_over_a_cache_compressed_during_decode_is_exact(policy, draft):
    assert check_combination(**decode_args(policy, draft)) == "exact"


@pytest.mark.heavy
@pytest.mark.parametrize("policy", DECODING)
@pytest.mark.parametrize("draft", sorted(DRAFT_ARGS))
def test_every_draft_over_every_policy_compressing_during_decode_is_exact(policy, draft):
    assert check_combination(**decode_args(policy, draft)) == "exact"


def test_the_decode_capable_built_ins_are_those_listed():
    from kvlab.registry import POLICIES

    load_plugins()
    accept = []
    for name, args in POLICY_ARGS.items():
        try:
            POLICIES.build(name, **args, when="decode", every=EVERY)
            accept.append(name)
        except ValueError:
            pass
    assert sorted(accept) == DECODING


# -- what the policy sees at each compression, with and without the draft -----------------------------------

def compressions(monkeypatch, **engine_args) -> tuple[list, list[list[int]], dict]:
    """Every compression of a greedy run on two prompts: (seq id, tokens computed, its recorded queries and
    accumulated mass per layer), the outputs, and the engine's stats."""
    seen = []
    compress = Compressor.compress

    def recording(self, seq, queries, mass=None):
        seen.append((seq.seq_id, seq.num_computed_tokens, {k: q.clone() for k, q in queries.items()},
                     {k: m.clone() for k, m in (mass or {}).items()}))
        return compress(self, seq, queries, mass)

    monkeypatch.setattr(Compressor, "compress", recording)
    llm = LLM(TINY, kv_cache_memory="4MiB", **engine_args)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, llm.model_config.vocab_size, (n,), generator=g).tolist() for n in (41, 57)]
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
    stats = llm.stats()
    monkeypatch.setattr(Compressor, "compress", compress)
    return seen, out, stats


@pytest.mark.parametrize("policy, draft", [("snapkv", "ngram"), ("h2o", "tree")])
def test_at_every_compression_the_policy_sees_what_plain_decoding_showed_it(monkeypatch, policy, draft):
    args = decode_args(policy, draft)
    want, want_out, _ = compressions(monkeypatch, **{**args, "draft": None, "draft_args": {}})
    got, got_out, stats = compressions(monkeypatch, **args)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]  # drafts kept and rejected
    assert got_out == want_out
    got, want = (sorted(seen, key=lambda c: c[:2]) for seen in (got, want))  # per sequence, in token order
    assert [(s, n) for s, n, *_ in got] == [(s, n) for s, n, *_ in want]  # the same points, none crossed
    for (_, n, got_q, got_m), (_, _, want_q, want_m) in zip(got, want):
        assert got_q.keys() == want_q.keys() and got_m.keys() == want_m.keys()
        for layer in want_q:
            torch.testing.assert_close(got_q[layer], want_q[layer], atol=1e-5, rtol=1e-4, msg=f"queries at {n}")
        for layer in want_m:
            torch.testing.assert_close(got_m[layer], want_m[layer], atol=1e-5, rtol=1e-4, msg=f"mass at {n}")


# -- the compressor without a model ------------------------------------------------------------------------

@dataclass
class Recording(Policy):
    """Reads a window of `window` queries and remembers what it got."""

    window: int = 3

    def __post_init__(self):
        super().__post_init__()
        self.seen: list[dict[int, torch.Tensor]] = []

    @property
    def query_window(self) -> int:
        return self.window

    def score(self, layer_idx, keys, values, queries, attn_stats):
        if layer_idx == LAYERS[0]:
            self.seen.append({})
        self.seen[-1][layer_idx] = queries
        return torch.einsum("lhd,qd->lh", keys.float(), queries.float().sum(1))


def make(policy: Policy):
    load_plugins()
    groups = [LayerGroup((layer,)) for layer in LAYERS]  # a table per layer, as a compressing policy gets
    bm = BlockManager(groups, PagedAllocator(), 32, BS, 64, 64)
    cache = KVCache(groups, 32, BS, HKV, DIM, QUANT_FORMATS.build("fp32"), torch.float32, "cpu")
    return bm, cache, Compressor(policy, PagedKV(bm, cache), torch.float32)


def step(bm, cache, comp, seq, n, queries, gen, kept=None):
    """`seq` computes its next `n` tokens (its uncomputed one, then its drafts), verification keeps the
    rows `kept` (all if None), the rest rolled back; the compressor hears of it as the engine tells it."""
    start = seq.num_computed_tokens
    bm.allocate(seq, n) if start == 0 else bm.append(seq, n)
    rows, due = comp.query_rows(seq, n), comp.due(seq, n)
    cache.begin_step([torch.tensor(bm.slot_ids(seq, g, start, start + n)) for g in LAYERS])
    for layer in LAYERS:
        slots = torch.tensor(bm.slot_ids(seq, layer, start, start + n))
        cache.store(layer, torch.randn(n, HKV, DIM, generator=gen), torch.randn(n, HKV, DIM, generator=gen), slots)
    rejected = n - len(kept) if kept is not None else 0
    if rejected:
        bm.rollback(seq, rejected)
    seq.num_computed_tokens += n - rejected
    seq.draft_token_ids = []
    comp.after_step([seq], [n], [due], {layer: [q[n - rows:n]] for layer, q in queries.items()},
                    kept={seq.seq_id: kept} if kept is not None else None)
    return rows, due


def test_a_rejected_rows_query_is_not_recorded_and_a_point_not_reached_is_not_compressed():
    policy = Recording(budget=6, window=3, when="decode", every=4, per_head=False)
    bm, cache, comp = make(policy)
    seq = Sequence(0, list(range(3, 12)), Params(max_tokens=8), 20, 0.0)  # a prompt of 8, a token sampled
    seq.num_prompt_tokens = 8
    gen = torch.Generator().manual_seed(0)
    prompt = {layer: torch.randn(8, HQ, DIM, generator=gen) for layer in LAYERS}
    step(bm, cache, comp, seq, 8, prompt, gen)  # compressed at the prompt's end (8)
    assert comp.calls == 1 and comp.next_point(seq) == 12
    seq.draft_token_ids = [5, 6, 7]  # a verify step up to the point: computed 8 + 4 rows
    verify = {layer: torch.randn(4, HQ, DIM, generator=gen) for layer in LAYERS}
    rows, due = step(bm, cache, comp, seq, 4, verify, gen, kept=[0, 1])  # two drafts rejected
    assert (rows, due) == (4, True)  # every row recorded, and due had every row been kept
    assert comp.calls == 1 and seq.num_computed_tokens == 10  # the point (12) not reached: not compressed
    for layer in LAYERS:  # the window: the prompt's last query, then the two kept rows'
        assert torch.equal(comp._queries[0][layer], torch.cat([prompt[layer][7:], verify[layer][:2]]))
    seq.token_ids += [5, 13]
    seq.draft_token_ids = [14]  # to the point: the last row is token 11
    tree = {layer: torch.randn(2, HQ, DIM, generator=gen) for layer in LAYERS}
    step(bm, cache, comp, seq, 2, tree, gen, kept=[0, 1])
    assert comp.calls == 2 and seq.num_computed_tokens == 12  # reached: compressed at 12
    for layer in LAYERS:
        assert torch.equal(policy.seen[-1][layer], torch.cat([verify[layer][1:2], tree[layer]]))


def test_a_token_trees_kept_path_is_what_is_recorded():
    """A tree's kept rows are the root's and the accepted path's, not a prefix of the step's rows."""
    policy = Recording(budget=6, window=8, when="decode", every=4, per_head=False)
    bm, cache, comp = make(policy)
    seq = Sequence(0, list(range(3, 12)), Params(max_tokens=8), 20, 0.0)
    seq.num_prompt_tokens = 8
    gen = torch.Generator().manual_seed(1)
    step(bm, cache, comp, seq, 8, {layer: torch.randn(8, HQ, DIM, generator=gen) for layer in LAYERS}, gen)
    seq.draft_token_ids, seq.draft_parents = [5, 6, 7], [-1, -1, 1]  # two children of the root, one grandchild
    rows = {layer: torch.randn(4, HQ, DIM, generator=gen) for layer in LAYERS}
    step(bm, cache, comp, seq, 4, rows, gen, kept=[0, 2, 3])  # the path root -> node 2 -> node 3
    assert comp.calls == 1
    for layer in LAYERS:
        assert torch.equal(comp._queries[0][layer][-3:], rows[layer][[0, 2, 3]])


def test_a_kept_rows_mass_is_its_own_one_query_attention_added_in_token_order():
    """row_mass against the softmax written out: row i of r kept, at cache index L - r + i, sees keys 0 .. L - r + i."""
    load_plugins()
    groups = [LayerGroup((0,))]
    bm = BlockManager(groups, PagedAllocator(), 8, BS, 64, 64)
    cache = KVCache(groups, 8, BS, HKV, DIM, QUANT_FORMATS.build("fp32"), torch.float32, "cpu")
    seq = Sequence(0, list(range(3, 13)), Params(max_tokens=4), 14, 0.0)
    bm.allocate(seq, 10)
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(10, HKV, DIM, generator=gen)
    cache.begin_step([torch.tensor(bm.slot_ids(seq, 0, 0, 10))])
    cache.store(0, keys, torch.randn(10, HKV, DIM, generator=gen), torch.tensor(bm.slot_ids(seq, 0, 0, 10)))
    q = torch.randn(3, HQ, DIM, generator=gen)  # the last three tokens' queries
    got = row_mass(cache, 0, bm.block_tables([seq], 0)[0], 10, q, BS, 0.5, None)  # [3, Hkv, 10]
    k = keys.repeat_interleave(HQ // HKV, dim=1)  # [10, Hq, D]
    for i in range(3):
        seen = 8 + i
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i], k[:seen]) * 0.5, dim=-1)  # [Hq, seen]
        want = p.view(HKV, HQ // HKV, seen).sum(1)  # [Hkv, seen]
        torch.testing.assert_close(got[i, :, :seen], want)
        assert not got[i, :, seen:].any()
    old = torch.rand(7, HKV)
    total = add_rows(old, got, 10)
    want = old.clone()
    for i in range(3):
        step_mass = got[i, :, :8 + i].T.clone()
        step_mass[:want.shape[0]] += want
        want = step_mass
    assert torch.equal(total, want)


def test_a_kept_rows_mass_in_per_head_tables_is_each_kv_heads_own():
    """Per-head budgets (a table per (layer, KV head), pages of one head): the compressor recomputes a verify step's
    kept rows' mass per table from the query heads of that table's KV head only, each head as the full-heads
    softmax gives it (kvlab.policies.compressor.Compressor._verified_mass)."""
    load_plugins()
    groups = [LayerGroup((0,), head=h) for h in range(HKV)]
    bm = BlockManager(groups, PagedAllocator(), 16, BS, 64, 64)
    cache = KVCache(groups, 16, BS, HKV, DIM, QUANT_FORMATS.build("fp32"), torch.float32, "cpu")
    comp = Compressor(Recording(budget=4, when="decode", every=2), PagedKV(bm, cache), torch.float32)
    seq = Sequence(0, list(range(3, 13)), Params(max_tokens=4), 14, 0.0)
    bm.allocate(seq, 10)
    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(10, HKV, DIM, generator=gen)
    slots = [torch.tensor(bm.slot_ids(seq, g, 0, 10)) for g in range(HKV)]
    cache.begin_step(slots)
    for h in range(HKV):
        cache.store(0, keys, torch.randn(10, HKV, DIM, generator=gen), slots[h], head=h)
    q = torch.randn(3, HQ, DIM, generator=gen)  # the kept rows: the last three tokens
    k = keys.repeat_interleave(HQ // HKV, dim=1)  # [10, Hq, D]
    for h, g in enumerate(range(HKV)):
        got = comp._verified_mass(seq, g, 10, {0: q}, None)  # [10, 1]
        want = torch.zeros(10)
        for i in range(3):
            seen = 8 + i
            p = torch.softmax(torch.einsum("hd,lhd->hl", q[i], k[:seen]) * DIM ** -0.5, dim=-1)  # [Hq, seen]
            want[:seen] += p.view(HKV, HQ // HKV, seen).sum(1)[h]
        assert got.shape == (10, 1)
        torch.testing.assert_close(got[:, 0], want)

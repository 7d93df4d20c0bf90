"""The `self_compressed` draft's copied views (kvlab/speculation/drafts/view_copy.py): a token-granular view
(token_view.py: SnapKV, H2O, ... over the target's own keys and queries), a quantised view (QuantSpec: the copy
stored in a format's pages, int4's codes and scales with its open pages in rows) and any view over a packed
target (int8 / int4). The draft never changes
output: greedy equals plain decoding for each view kind over fp32, fp8 and int4 targets, batched and chunked,
under preemption; sampled outputs keep their distribution; the copy is refreshed by position, taken from the
byte budget, and the target's pool is never written.

Tiny random Llama (2 layers, vocab 256). Packed targets run in `batch_invariant=True` mode, where a rounding
format's cache is the same whatever the schedule (speculation verifies several tokens a step)."""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.registry import DRAFTS, QUANT_FORMATS, load_plugins
from kvlab.speculation.drafts.token_view import QueryLog, gather_heads, indices
from kvlab.speculation.drafts.view_copy import ViewCopy, copy_nbytes
from kvlab.cache.block_manager import LayerGroup
from kvlab.testing import check_draft
from kvlab.testing.drafts import check_nothing_left

from helpers import MODEL, chi2_critical, two_sample_chi_square

pytestmark = pytest.mark.usefixtures("one_thread")
SNAPKV = {"policy": "snapkv", "policy_args": {"budget": 24, "window_size": 8}, "num_tokens": 3, "refresh": 16}
H2O = {"policy": "h2o", "policy_args": {"budget": 24}, "num_tokens": 3, "refresh": 16}
QUANT = {"policy": "streaming_llm", "policy_args": {"budget": 32}, "num_tokens": 3, "quant": "int4", "refresh": 16}
TOKEN_INT4 = {**SNAPKV, "quant": "int4"}
PAGE = {"policy": "streaming_llm", "policy_args": {"budget": 32}, "num_tokens": 3, "refresh": 16}
VIEWS = {"token": SNAPKV, "token_h2o": H2O, "quant": QUANT, "token_int4": TOKEN_INT4, "page": PAGE}
TARGETS = {"fp32": {}, "fp8": {"quant": "fp8_e4m3"}, "int4": {"quant": "int4", "batch_invariant": True}}


def long_prompts(n: int) -> list[list[int]]:
    from kvlab.testing.policies import prompts as policy_prompts

    return policy_prompts(256, lengths=(61, 40, 23, 50, 45))[:n]


def run(draft_args, batch, max_tokens, **engine):
    engine = {"block_size": 16, "kv_cache_memory": "4MiB", **engine}
    llm = LLM(MODEL, draft="self_compressed", draft_args=draft_args, **engine)
    outs = llm.generate(batch, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    check_nothing_left(llm, "self_compressed")
    return [o.token_ids for o in outs], llm.stats(), llm


# -- the parts (no model) ----------------------------------------------------------------
def test_view_copy_slots_go_least_recently_used_first_and_never_to_a_round_member():
    copy = ViewCopy([LayerGroup((0, 1))], 2, 3, 4, 1, 8, torch.float32, torch.device("cpu"), QUANT_FORMATS.build("auto"))
    assert copy.take([7, 8]) == [0, 1]
    copy.refreshed[(0, 0)], copy.selected[(0, 0)] = (7, 16), 5
    assert copy.take([8]) == [1]  # 8 used last: 7 is the least recently used
    assert copy.take([9]) == [0] and (0, 0) not in copy.refreshed  # 7's slot, its selection dropped
    assert copy.take([8, 9]) == [1, 0]
    with pytest.raises(ValueError, match="holds 2"):
        copy.take([1, 2, 3])
    copy.forget(8)
    assert copy.num_held() == 1 and copy.table(1, 0) == [3, 4, 5]
    assert copy.nbytes() == copy_nbytes(QUANT_FORMATS.build("auto"), 1, 2, 2, 3, 4, 1, 8, torch.float32)


def test_query_log_keeps_positions_and_windows_by_position():
    log = QueryLog(keep=4)
    log.record(1, [0, 1, 2], {0: torch.arange(3.0)[:, None, None].expand(3, 2, 2)})
    log.record(1, [3, 4, 5], {0: torch.arange(3.0, 6.0)[:, None, None].expand(3, 2, 2)})
    got = log.window(1, 0, 5, 3)  # positions 2, 3, 4
    assert got[:, 0, 0].tolist() == [2.0, 3.0, 4.0]
    assert log.window(1, 0, 2, 2) is None  # positions 0, 1 left the log (keep 4 behind position 5)
    log.forget(1)
    assert log.num_tracked() == 0


def test_indices_and_gather_follow_the_policys_kept_sets():
    assert indices(None, 3, 2).tolist() == [[0, 1, 2], [0, 1, 2]]
    assert indices([0, 2], 3, 2).tolist() == [[0, 2], [0, 2]]
    x = torch.arange(12.0).view(3, 2, 2)  # [L=3, Hkv=2, D=2]
    got = gather_heads(x, indices([[0, 2], [1, 2]], 3, 2))
    assert got[:, 0].tolist() == [x[0, 0].tolist(), x[2, 0].tolist()]
    assert got[:, 1].tolist() == [x[1, 1].tolist(), x[2, 1].tolist()]


def int4_copy(pages: int = 4, open_pages: int = 3) -> ViewCopy:
    load_plugins()
    return ViewCopy([LayerGroup((0,))], 1, pages, 16, 2, 16, torch.float32, torch.device("cpu"),
                    QUANT_FORMATS.build("int4"), open_pages)


def test_an_int4_view_stores_codes_and_keeps_only_its_open_pages_in_rows():
    """A page a write covers whole is encoded (int4 codes, scales, zero points: exactly the codec's round trip of
    its tokens); the page where a write ends stays open, its tokens exact in a residual row; `close` gives back the
    rows past the draft's page. The copy costs the codes plus its few rows, a fraction of the decoded copy."""
    copy, x = int4_copy(), torch.randn(40, 2, 16)
    kv = lambda a, b: [(x[a:b], -x[a:b])]  # noqa: E731
    copy.write(0, 0, 0, kv(0, 21))  # the selection: page 0 whole, page 1 partly
    store = copy.cache.k(0)
    assert store.parts["data"].dtype == torch.uint8 and copy.num_open() == 1
    codec = copy.cache.codecs[0]
    sealed = codec.decode(codec.encode(x[None, :16], torch.ones(1, 16, dtype=torch.bool)), torch.float32)[0]
    got = copy.cache.read_slots(0, torch.arange(21), torch.float32)[0]
    assert torch.equal(got[:16], sealed) and not torch.equal(got[:16], x[:16])
    assert torch.equal(got[16:], x[16:21])  # open: as written
    copy.write(0, 0, 21, kv(21, 37))  # the tokens since the refresh: page 2 [32, 37) opens, page 1 stays open
    copy.write(0, 0, 37, kv(37, 40))  # a draft's tokens in page 2
    assert copy.num_open() == 2
    copy.write(0, 0, 40, kv(0, 12))  # a longer chain reaches page 3
    assert copy.num_open() == 3
    copy.close(0, 0, 21, 37)  # page 3 (past the draft's first page, 2) gives its row back
    assert copy.num_open() == 2
    decoded = copy_nbytes(QUANT_FORMATS.build("auto"), 1, 1, 1, 4, 16, 2, 16, torch.float32)
    assert copy.nbytes() == copy_nbytes(QUANT_FORMATS.build("int4"), 1, 1, 1, 4, 16, 2, 16, torch.float32, 3)
    assert copy.nbytes() < decoded  # 5 pages of codes + 3 rows against 5 decoded pages
    copy.check_rows()


def test_an_int4_views_pages_do_not_depend_on_how_the_steps_wrote_them():
    """The same tokens written in one step, or over several with draft tokens in between (later overwritten),
    give the same copy, bit for bit: the page where the selection ends is never encoded, a page is encoded only
    from a write that covers all of it, and a draft's tentative tokens go to open rows."""
    x, draft = torch.randn(52, 2, 16), torch.randn(8, 2, 16)
    kv = lambda t, a, b: [(t[a:b], t[a:b] * 2)]  # noqa: E731
    one, steps = int4_copy(), int4_copy()
    one.write(0, 0, 0, kv(x, 0, 21))
    one.write(0, 0, 21, kv(x, 21, 52))
    steps.write(0, 0, 0, kv(x, 0, 21))
    for end in (23, 30, 33, 40, 45, 50):  # each step copies the tokens since the refresh, then drafts 3 tokens
        steps.write(0, 0, 21, kv(x, 21, end))
        steps.close(0, 0, 21, end)
        steps.write(0, 0, end, kv(draft, 0, 3))
    steps.write(0, 0, 21, kv(x, 21, 52))
    slots = torch.arange(52)
    for side in (0, 1):
        assert torch.equal(one.cache.read_slots(0, slots, torch.float32)[side],
                           steps.cache.read_slots(0, slots, torch.float32)[side])
    assert one.num_open() == steps.num_open() == 2  # the selection's last page and the partial page 3
    for a, b in zip(one.cache.page_tensors(), steps.cache.page_tensors()):  # the encoded pages 0 and 2, bit for bit
        assert torch.equal(a[[0, 2]], b[[0, 2]])


def test_what_a_copied_view_cannot_be_is_refused():
    load_plugins()
    with pytest.raises(ValueError, match="query-aware page selection"):
        DRAFTS.build("self_compressed", policy="quest", policy_args={"budget": 64})
    with pytest.raises(ValueError, match="give policy_args.budget"):
        DRAFTS.build("self_compressed", policy="snapkv", policy_args={"compression_ratio": 0.5})
    with pytest.raises(ValueError, match="refresh must be an integer >= 1"):
        DRAFTS.build("self_compressed", refresh=0)
    with pytest.raises(Exception, match="int5"):
        DRAFTS.build("self_compressed", quant="int5")
    with pytest.raises(ValueError, match="needs policy_args.budget"):  # a full view copied: of no fixed size
        LLM(MODEL, draft="self_compressed", draft_args={"policy": "full", "policy_args": {}}, quant="int4",
            kv_cache_memory="4MiB")


# -- the engine ------------------------------------------------------------------------
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_greedy_output_is_plain_decodings_for_every_view_over_every_target(view, target):
    batch = long_prompts(3)
    got, stats, llm = run(VIEWS[view], batch, 20, **TARGETS[target])
    assert got == plain_on(batch, 20, target)
    assert stats["spec_drafted_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    copied = view != "page" or llm.engine.quant.packed  # a page view over a packed target (int4, fp8) is copied
    assert (stats["spec_view_bytes"] > 0) == copied


def plain_on(batch, max_tokens, target):
    llm = LLM(MODEL, block_size=16, kv_cache_memory="4MiB", **TARGETS[target])
    return [o.token_ids for o in llm.generate(batch, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]


@pytest.mark.parametrize("target", ["fp32", "int4"])
def test_one_at_a_time_and_chunked_prefill_match_plain(target):
    batch = long_prompts(5)
    want = plain_on(batch, 16, target)
    for args in (SNAPKV, QUANT):
        alone = [run(args, [p], 16, **TARGETS[target])[0][0] for p in batch]
        chunked, _, _ = run(args, batch, 16, max_prefill_chunk=8, max_num_batched_tokens=24, **TARGETS[target])
        assert alone == want and chunked == want


def test_the_copy_is_refreshed_by_position_and_reads_the_targets_queries(monkeypatch):
    """Every selection is made at a multiple of `refresh`, the same points batched or alone; SnapKV's scores read
    the target's own queries of the window before the point (as many as the window, recorded as computed)."""
    from kvlab.speculation.drafts.self_compressed import SelfCompressedDraft
    from kvlab.speculation.drafts.token_view import TokenView

    points, windows = [], []
    select, token_select = SelfCompressedDraft._select, TokenView.select

    def watched(self, seq, slot, g, table, P, *rest):
        points.append((tuple(seq.token_ids[:seq.num_prompt_tokens]), P))
        return select(self, seq, slot, g, table, P, *rest)

    def seen(self, layer, keys, values, queries, seq_len=None):
        windows.append((keys.shape[0] if seq_len is None else seq_len, None if queries is None else queries.shape[0]))
        return token_select(self, layer, keys, values, queries, seq_len)

    monkeypatch.setattr(SelfCompressedDraft, "_select", watched)
    monkeypatch.setattr(TokenView, "select", seen)
    batch = long_prompts(3)
    run(SNAPKV, batch, 40)
    together = sorted(set(points))
    points.clear()
    for p in batch:
        run(SNAPKV, [p], 40)
    assert sorted(set(points)) == together and all(P % 16 == 0 for _, P in together)
    assert windows and all(q == min(8, P) for P, q in windows if P > 0), windows


def test_the_copy_comes_out_of_the_byte_budget_and_stats_say_how_much():
    _, stats, llm = run(SNAPKV, long_prompts(1), 4)
    _, _, without = run({**PAGE, "policy_args": {"budget": 24}}, long_prompts(1), 4)
    view = stats["spec_view_bytes"]
    draft = llm.engine.speculator.draft
    assert view == draft._copy.nbytes() and stats["spec_view_pages"] == draft._copy.num_pages()
    cache = without.engine.cache  # pool pages, the page view's scratch (outside the budget) and the null page
    per_block = cache.pool_nbytes() / (without.engine.block_manager.num_blocks + len(cache.scratch_pages) + 1)
    budget = 4 * 2 ** 20
    assert without.engine.block_manager.num_blocks == int(budget // per_block)
    assert llm.engine.block_manager.num_blocks == int((budget - view) // per_block) < int(budget // per_block)


@pytest.mark.parametrize("target", ["fp32", "int4"])
def test_the_draft_never_writes_the_targets_pool(monkeypatch, target):
    """Every target pool tensor (a packed format's codes, scales and leased residual rows) is bit-for-bit what it
    was before the draft proposed."""
    from kvlab.speculation.drafts.self_compressed import SelfCompressedDraft

    propose, checked = SelfCompressedDraft.propose, []

    def watched(self, seqs, lengths, generators):
        before = [t.clone() for t in self._cache.page_tensors()]
        out = propose(self, seqs, lengths, generators)
        assert all(torch.equal(b, t) for b, t in zip(before, self._cache.page_tensors())), \
            "the draft wrote into the target's pool"
        checked.append(len(seqs))
        return out

    monkeypatch.setattr(SelfCompressedDraft, "propose", watched)
    batch = long_prompts(3)
    got, _, _ = run(SNAPKV, batch, 12, **TARGETS[target])
    assert got == plain_on(batch, 12, target) and checked


@pytest.mark.parametrize("view,target", [("token", "fp32"), ("quant", "fp8"), ("page", "fp8"), ("token", "fp8")])
def test_conformance_suite_with_preemption(view, target):
    """check_draft: greedy at batch 4 as plain decoding, again in a pool that preempts, seeded sampling
    reproducible, nothing left; two copy slots, so rounds share them. fp8_e4m3 packs its pages (per-token
    scales): the packed target here (int4's residual leases leave a pool this small unschedulable even without
    a draft)."""
    args = {**VIEWS[view], "max_batch": 2}
    view_bytes = LLM(MODEL, draft="self_compressed", draft_args=args, block_size=4, kv_cache_memory="4MiB",
                     **TARGETS[target]).stats()["spec_view_bytes"]
    pool = {"fp32": 40 * 1024, "fp8": 21 * 576}[target]  # pages that preempt (21 fp8 pages of 4 tokens)
    check_draft("self_compressed", args, model=MODEL, small_pool=view_bytes + pool, block_size=4, **TARGETS[target])


@pytest.mark.parametrize("quant", [None, pytest.param("int4", marks=pytest.mark.heavy)])  # int4: ~25 s (page plans)
def test_sampled_outputs_follow_the_plain_distribution_through_a_token_view(quant):
    """1,000 seeded sampled requests (temperature 1, top-k 4) with a one-layer draft over an 8-token SnapKV view,
    decoded or stored as int4 codes: the 2nd and 3rd output tokens are distributed as plain sampling's
    (two-sample chi-square at 99.9%)."""
    n, prompt = 1000, [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 1, 2]
    engine = dict(block_size=4, kv_cache_memory="64MiB", max_num_seqs=n, max_num_batched_tokens=n * 16)
    sp = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=i, ignore_eos=True) for i in range(n)]
    plain_out = [o.token_ids for o in LLM(MODEL, **engine).generate([prompt] * n, sp)]
    args = {"policy": "snapkv", "policy_args": {"budget": 8, "window_size": 4}, "refresh": 8, "layers": 1,
            "num_tokens": 2, "max_batch": 256, "quant": quant}
    llm = LLM(MODEL, draft="self_compressed", draft_args=args, **engine)
    spec_out = [o.token_ids for o in llm.generate([prompt] * n, sp)]
    stats = llm.stats()
    assert stats["spec_drafted_tokens"] >= n and 0 < stats["spec_acceptance_rate"] < 1
    assert [o[0] for o in spec_out] == [o[0] for o in plain_out]
    for index in (1, 2):
        stat, df = two_sample_chi_square([o[index] for o in plain_out], [o[index] for o in spec_out])
        assert stat < chi2_critical(df), f"output token {index}: chi2 {stat:.1f} >= {chi2_critical(df):.1f}"


def test_an_int4_view_costs_a_fraction_of_the_decoded_one_and_the_target_gets_the_rest():
    """The same 256-token SnapKV view decoded (fp32) and stored as int4 codes: the int4 copy (codes, scales, zero
    points, and the two full-precision rows a slot's draft chain writes) is under a third of the decoded copy's
    bytes, and the target's pool gets the difference; over an fp32 target greedy output is plain decoding's."""
    batch, view = long_prompts(3), {**SNAPKV, "policy_args": {"budget": 256, "window_size": 8}}
    decoded, stats_f, llm_f = run(view, batch, 12, kv_cache_memory="8MiB")
    coded, stats_q, llm_q = run({**view, "quant": "int4"}, batch, 12, kv_cache_memory="8MiB")
    assert decoded == coded == plain_on(batch, 12, "fp32")
    view_f, view_q = stats_f["spec_view_bytes"], stats_q["spec_view_bytes"]
    draft = llm_q.engine.speculator.draft
    assert view_q == draft._copy.nbytes() and draft._copy.cache.k(0).parts["data"].dtype == torch.uint8
    assert view_q < view_f / 3, (view_q, view_f)  # 18 pages of codes and 2 rows a slot against 18 decoded pages
    assert llm_q.engine.block_manager.num_blocks > llm_f.engine.block_manager.num_blocks
    assert stats_q["spec_acceptance_rate"] > 0


def test_an_int4_view_of_every_token_accepts_nearly_what_the_exact_view_does():
    """A 256-token view (every token of these prompts) read exactly accepts every draft; stored as int4 codes (the
    open pages exact in their rows) it accepts nearly as much, and as int2 less: the draft reads what the copy's
    format holds, the newest tokens and its own drafts at full precision."""
    batch, view = long_prompts(4), {**SNAPKV, "policy_args": {"budget": 256, "window_size": 8}}
    rate = {q: run({**view, "quant": q}, batch, 24, kv_cache_memory="8MiB")[1]["spec_acceptance_rate"]
            for q in (None, "int4", "int2")}
    assert rate[None] == 1.0 and rate["int4"] >= 0.9 and rate["int2"] < rate["int4"], rate


@pytest.mark.parametrize("view", ["token", "token_h2o"])
def test_a_prefix_hit_leaves_the_token_views_query_window_to_compute(view):
    """A repeated prompt hits the prefix cache; its refresh point's query window (the last window + refresh - 1
    prompt tokens at most) is computed by the request itself, not taken from the hit (the view's scores read
    those queries: a hit over them left none and the selection raised)."""
    dargs = VIEWS[view]
    prompt = list(range(3, 91))  # 88 tokens: 5 full pages of 16, the first refresh point at 80
    engine = dict(block_size=16, kv_cache_memory="16MiB", enable_prefix_caching=True)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = LLM(MODEL, **engine).generate([prompt], sp)[0].token_ids
    llm = LLM(MODEL, draft="self_compressed", draft_args=dargs, **engine)
    assert llm.generate([prompt], sp)[0].token_ids == plain
    llm.reset_stats()
    assert llm.generate([prompt], sp)[0].token_ids == plain  # the hit: the same output
    stats, tail = llm.stats(), llm.engine.speculator.draft.prompt_query_tail()
    assert tail >= dargs["refresh"] - 1 + 8 and 0 < stats["prefix_hit_tokens"] <= len(prompt) - tail
    assert stats["spec_verifications"] > 0


def test_candidates_are_the_kept_positions_then_every_one_since():
    from kvlab.speculation.drafts.token_view import candidates

    kept = torch.tensor([[0, 3, 5], [1, 2, 6]])  # [Hkv, S], all before since = 8
    assert candidates(kept, 8, 11).tolist() == [[0, 3, 5, 8, 9, 10], [1, 2, 6, 8, 9, 10]]


def test_a_kept_rescore_reads_the_candidates_only_and_a_static_score_keeps_a_best_set_of_all(monkeypatch):
    """rescore `kept` (the default) scores the previous selection and the tokens since it, reading only those
    from the target (after a sequence's first refresh), where `all` reads [0, P); with a score that depends on
    each key alone (KNorm: keep the smallest key norms) the best `budget` of those candidates are a best `budget`
    of [0, P) (ties aside: a norm is RoPE-invariant, so a repeated token ties in layer 0), checked against the
    target's keys at every refresh, each KV head; outputs are plain decoding's either way."""
    from kvlab.speculation.drafts.self_compressed import SelfCompressedDraft

    knorm = {"policy": "knorm", "policy_args": {"budget": 24}, "num_tokens": 3, "refresh": 16}
    select, read = SelfCompressedDraft._select, SelfCompressedDraft._read
    reads, inside, checked = [], [], []

    def watched(self, seq, slot, g, table, P, since=None):
        reads.append((self.rescore, since, P, []))
        inside.append(True)
        n = select(self, seq, slot, g, table, P, since)
        inside.pop()
        for layer in self._bm.groups[g].layers:
            norms = read(self, layer, table, range(P))[0].float().norm(dim=-1).T  # [Hkv, P]
            for h, kept in enumerate(self._kept[(slot, layer)].tolist()):
                dropped = sorted(set(range(P)) - set(kept))
                assert len(kept) == min(P, 24)
                assert not dropped or norms[h, kept].max() <= norms[h, dropped].min(), (P, layer, h)
                checked.append(P)
        return n

    def counted(self, layer, table, tokens):
        tokens = list(tokens)
        if inside:  # a read of the selection (not of the tokens since it)
            reads[-1][3].append(len(tokens))
        return read(self, layer, table, tokens)

    monkeypatch.setattr(SelfCompressedDraft, "_select", watched)
    monkeypatch.setattr(SelfCompressedDraft, "_read", counted)
    batch = long_prompts(3)
    plain = LLM(MODEL, block_size=16, kv_cache_memory="4MiB").generate(
        batch, SamplingParams(max_tokens=40, ignore_eos=True))
    for rescore in ("all", "kept"):
        outs, stats, _ = run({**knorm, "rescore": rescore}, batch, 40)
        assert outs == [o.token_ids for o in plain] and stats["spec_verifications"] > 0
    assert len([P for P in checked if P > 24]) > 12
    merged = [(P, sizes) for rescore, since, P, sizes in reads if rescore == "kept" and since is not None]
    assert merged, reads  # refreshes that merged (each sequence's after its first)
    heads = 2  # llama-tiny's KV heads
    for P, sizes in merged:  # the union of the heads' candidates: at most heads x budget + refresh, never P
        assert sizes and all(n <= heads * 24 + 16 and n < P for n in sizes if P > heads * 24 + 16), (P, sizes)
    assert all(max(sizes) == P for rescore, since, P, sizes in reads if rescore == "all" and sizes)


def test_rescore_is_checked():
    with pytest.raises(ValueError, match="rescore must be"):
        DRAFTS.build("self_compressed", **{**SNAPKV, "rescore": "some"})

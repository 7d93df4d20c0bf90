"""Sparse reading at decode (kvlab.policies.sparse_read) and the two policies built on it, quest and rocketkv.

The seam is checked against references computed here from the raw keys (no page summaries, no
reduced plans): Quest's page selection by its upper bound and a dense attention masked to the
selected pages. The Triton path runs the same reduced plans under TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is imported

import pytest  # noqa: E402

from kvlab import LLM, SamplingParams  # noqa: E402
from kvlab.kernels.attention_plan import NULL_BLOCK, plan_paged_attention  # noqa: E402
from kvlab.cache.block_manager import equal_groups  # noqa: E402
from kvlab.kernels import ops  # noqa: E402
from kvlab.cache.kv_cache import KVCache  # noqa: E402
from kvlab.registry import POLICIES, QUANT_FORMATS  # noqa: E402
from kvlab.policies.sparse_read import SparseRead, SparseStep  # noqa: E402
from kvlab.speculation.tree_verifier import ancestor_mask  # noqa: E402
from kvlab.testing import check_combination, check_policy  # noqa: E402
from kvlab.testing.builtin_args import DRAFT_ARGS, POLICY_ARGS, SPARSE_ARGS, TINY  # noqa: E402
from kvlab.testing.combinations import shared_prompts  # noqa: E402

HKV, G, D, BS = 2, 2, 16, 4
SCALE = D ** -0.5


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# -- references, from the raw keys ---------------------------------------------------
def quest_reference_pages(q, keys, budget_pages, bs=BS, scale=SCALE):
    """q [Hq, D], keys [n, Hkv, D] -> the set of page indices Quest reads (sink and newest forced):
    per head, the softmax over pages of scale * max-bound + log(count), summed over heads."""
    n, hkv = keys.shape[:2]
    g = q.shape[0] // hkv
    nb = -(-n // bs)
    mass = torch.zeros(nb)
    for h in range(q.shape[0]):
        bounds = []
        for p in range(nb):
            k = keys[p * bs : min(n, (p + 1) * bs), h // g].float()  # [count, D]
            lo, hi = k.min(dim=0).values, k.max(dim=0).values
            bounds.append(float(torch.maximum(q[h] * lo, q[h] * hi).sum()) * scale + math.log(k.shape[0]))
        mass += torch.tensor(bounds).softmax(dim=0)
    mass[0] = mass[nb - 1] = math.inf
    return set(mass.topk(budget_pages).indices.tolist())


def masked_attention(q, keys, values, visible):
    """q [Hq, D], keys/values [n, Hkv, D], visible [n] bool -> [Hq, D] attention over the visible keys."""
    out = torch.empty(HKV * G, D)
    for h in range(HKV * G):
        k, v = keys[visible, h // G], values[visible, h // G]
        out[h] = (q[h] @ k.T * SCALE).softmax(dim=0) @ v
    return out


# -- the seam, on a hand-built pool -----------------------------------------------------
def make_cache(budget: int, quant: str = "fp32"):
    groups = equal_groups([None, None])  # one group of 2 layers
    cache = KVCache(groups, 64, BS, HKV, D, QUANT_FORMATS.build(quant), torch.float32, "cpu")
    policy = POLICIES.build("quest", budget=budget, dense_layers=0)
    cache.sparse_read = SparseRead(policy, cache, BS, HKV, D, torch.float32, "cpu")
    return cache


def write(cache, layer, table, keys, values, start=0, chunk=5):
    """Write tokens start.. of one sequence through `store`, in chunks (summaries built incrementally)."""
    for a in range(start, keys.shape[0], chunk):
        idx = torch.arange(a, min(a + chunk, keys.shape[0]))
        slots = torch.tensor([table[i // BS] * BS + i % BS for i in idx.tolist()])
        cache.store(layer, keys[idx], values[idx], slots)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("with_extend", [True, False])
def test_sparse_read_equals_attention_masked_to_the_pages_quest_selects(backend, with_extend):
    """Rows: a long decode (reduced to 3 of 6 pages), a short decode with a released page (fits:
    dense), an extend (dense) and a decode whose table has a released page (every live page fits the
    budget: equals dense).
    Without the extend row the plan is decode-only (the torch path's tensor-built part)."""
    g = torch.Generator().manual_seed(0)
    cache = make_cache(budget=3 * BS)
    # pages previously used by something else: stale content that a write at offset 0 must reset
    cache.store(1, torch.randn(64 * BS, HKV, D, generator=g) * 9, torch.zeros(64 * BS, HKV, D),
                torch.arange(64 * BS))
    lens, q_lens = [23, 9, 14, 15], [1, 1, 5, 1]
    perm = torch.randperm(64, generator=g).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at : at + -(-n // BS)])
        at += len(tables[-1])
    released = {1: 1, 3: 1}  # row -> its released page (cache indices 4..7 are never read)
    for b, j in released.items():
        tables[b][j] = NULL_BLOCK
    keys = [torch.randn(n, HKV, D, generator=g) for n in lens]
    values = [torch.randn(n, HKV, D, generator=g) for n in lens]
    for b in range(4):
        if b in released:  # write around the released page
            live = [p for p in tables[b] if p != NULL_BLOCK]
            write(cache, 1, tables[b], keys[b][:4], values[b][:4])
            write(cache, 1, [live[0], 0] + live[1:], keys[b], values[b], start=8)
        else:
            write(cache, 1, tables[b], keys[b], values[b])
    rows = [0, 1, 2, 3] if with_extend else [0, 1, 3]
    cu = [0]
    for b in rows:
        cu.append(cu[-1] + q_lens[b])
    q = torch.randn(cu[-1], HKV * G, D, generator=g)
    plan = plan_paged_attention(cu, [lens[b] for b in rows], [tables[b] for b in rows], BS, None, "cpu",
                                null_block=cache.null_page)
    step = SparseStep(cache.sparse_read, decode=[q_lens[b] == 1 for b in rows])
    reduced = step.plan(1, q, plan, SCALE)
    assert reduced.seq_lens == tuple({0: 2 * BS + 3, 3: 2 * BS + 3}.get(b, lens[b]) for b in rows)  # newest last
    with ops.backend(backend):
        got = ops.run_paged_attention(q, cache.k(1), cache.v(1), reduced, SCALE)
        dense = ops.run_paged_attention(q, cache.k(1), cache.v(1), plan, SCALE)
    tol = dict(atol=2e-5, rtol=1e-5)
    pages = quest_reference_pages(q[0], keys[0], 3)  # row 0: exactly the pages Quest's bound selects
    assert set(step.selected[1][0].tolist()) == pages and {0, 5} <= pages
    for r, b in enumerate(rows):
        for i in range(q_lens[b]):
            t = cu[r] + i
            pos = lens[b] - q_lens[b] + i  # causal: the query sees cache indices <= pos
            visible = torch.arange(lens[b]) <= pos
            if b == 0:
                visible &= torch.tensor([j // BS in pages for j in range(lens[b])])
            if b in released:
                visible &= ~((torch.arange(lens[b]) >= 4) & (torch.arange(lens[b]) < 8))
            torch.testing.assert_close(got[t], masked_attention(q[t], keys[b], values[b], visible), **tol)
            if b != 0:  # rows that fit, or do not decode, read everything: the dense output
                torch.testing.assert_close(got[t], dense[t], **tol)
    assert not torch.allclose(got[0], dense[0], atol=1e-3)  # the dropped pages mattered


def test_page_summaries_are_exact_after_writes_copies_and_compaction():
    g = torch.Generator().manual_seed(1)
    cache = make_cache(budget=2 * BS)
    s = cache.sparse_read.summaries
    keys = torch.randn(10, HKV, D, generator=g)
    write(cache, 0, [7, 3, 9], keys, keys, chunk=3)
    for j, p in enumerate([7, 3, 9]):
        torch.testing.assert_close(s.kmin(0)[p], keys[j * BS : (j + 1) * BS].min(dim=0).values)
        torch.testing.assert_close(s.kmax(0)[p], keys[j * BS : (j + 1) * BS].max(dim=0).values)
    cache.copy_blocks([(9, 11)])  # copy-on-write
    torch.testing.assert_close(s.kmax(0)[11], keys[8:10].max(dim=0).values)
    assert not s.bounds[0][s.null_page].any()  # the null page reads as zero
    # compaction keeps cache indices 0, 5, 6, 9 -> 0..3 (all in page 7); the page is refreshed before the next step
    cache.move_slots([(3 * BS + 1, 7 * BS + 1), (3 * BS + 2, 7 * BS + 2), (9 * BS + 1, 7 * BS + 3)])
    assert s.stale == {7, 11}  # the copy too: it is recomputed over the tokens it holds
    # two tables: [7, 3] writes one token at index 4; [7, 3, 11] (a hit ending inside page 11, after index 8)
    plan = plan_paged_attention([0, 1, 2], [5, 10], [[7, 3], [7, 3, 11]], BS, None, "cpu")
    cache.sparse_read.begin_step([], [], [plan])
    kept = keys[[0, 5, 6, 9]]
    torch.testing.assert_close(s.kmin(0)[7], kept.min(dim=0).values)
    torch.testing.assert_close(s.kmax(0)[7], kept.max(dim=0).values)
    torch.testing.assert_close(s.kmax(0)[11], keys[8])  # the copy holds index 8 only, not 9
    assert not s.stale


def test_a_copy_holding_every_token_of_its_source_keeps_the_summary_of_the_keys_as_computed():
    """A kept compressed turn's pages copied at a continuation's admission (kvlab.cache.block_manager's
    `_privatize_open`) hold every token their source holds: the copy keeps the source's summary, built from the
    keys as the model computed them, as the request continuing would read it; a copy that may hold fewer tokens
    is recomputed from the pool (int8's dequantised keys: another summary). A stale source stays stale."""
    g = torch.Generator().manual_seed(2)
    cache = make_cache(budget=2 * BS, quant="int8")
    s = cache.sparse_read.summaries
    keys = torch.randn(10, HKV, D, generator=g)
    write(cache, 0, [7, 3, 9], keys, keys, chunk=3)
    computed = s.bounds[0][9].clone()
    cache.copy_blocks([(9, 11), (9, 12)], whole={11})
    assert s.stale == {12}
    plan = plan_paged_attention([0, 1, 2], [11, 11], [[7, 3, 11], [7, 3, 12]], BS, None, "cpu")
    cache.sparse_read.begin_step([], [], [plan])
    assert torch.equal(s.bounds[0][11], computed)
    assert not torch.equal(s.bounds[0][12], computed)  # recomputed from int8's codes
    cache.move_slots([(3 * BS + 1, 7 * BS + 1)])  # page 7 rewritten: stale until a step holds it
    cache.copy_blocks([(7, 13)], whole={13})
    assert s.stale == {7, 13}


def decoding(seq_id: int, computed: int, drafts: int = 0):
    """A sequence past its 8-token prompt, as `SparseRead.begin_step` reads it."""
    return SimpleNamespace(seq_id=seq_id, is_scoring=False, num_computed_tokens=computed, num_prompt_tokens=8,
                           draft_token_ids=[0] * drafts, draft_parents=[])


def one_step(cache, table, keys, queries, start, drafts=0, backend="torch"):
    """One sequence computes cache indices start.. (its last token, then `drafts` drafts) in one step ->
    (the reduced plan, the table positions each query row selected, the page summaries each row scored
    [rows, pages, Hkv, 2D], the attention output)."""
    n = 1 + drafts
    plan = plan_paged_attention([0, n], [start + n], [table], BS, None, "cpu", null_block=cache.null_page)
    step = cache.sparse_read.begin_step([decoding(7, start, drafts)], [n], [plan])
    slots = torch.tensor([table[i // BS] * BS + i % BS for i in range(start, start + n)])
    cache.store(1, keys[start : start + n], keys[start : start + n], slots)
    reduced = step.plan(1, queries, plan, SCALE)
    bounds = step.bounds(1, step.rows(plan))
    with ops.backend(backend):
        out = ops.run_paged_attention(queries, cache.k(1), cache.v(1), reduced, SCALE)
    return reduced, step.selected[1], bounds, out


@pytest.mark.parametrize("quant, backend", [("fp32", "torch"), ("int4", "torch"), ("fp32", "triton")])
@pytest.mark.parametrize("rejected", [0, 1, 3])  # 1, 3: a rejected draft shares a page with accepted ones
def test_verify_rows_select_and_read_what_sequential_decode_rows_do(quant, backend, rejected):
    """A verify step's 5 rows (cache indices 25..29, crossing into a fresh page) each select, and read, what
    plain decoding selects at its position, over summaries of the tokens up to it; after verification the
    summaries equal plain decoding's of the accepted tokens (a rejected draft leaves nothing behind)."""
    g = torch.Generator().manual_seed(3)
    table = torch.randperm(60, generator=g)[:9].tolist()
    n0, k = 25, 4
    keys = torch.randn(n0 + k + 1, HKV, D, generator=g) * torch.rand(n0 + k + 1, 1, 1, generator=g) * 3
    queries = torch.randn(k + 1, HKV * G, D, generator=g) * 3
    plain, verify = make_cache(4 * BS, quant), make_cache(4 * BS, quant)
    for cache in (plain, verify):
        cache.store(1, torch.randn(64 * BS, HKV, D, generator=g) * 9, torch.zeros(64 * BS, HKV, D),
                    torch.arange(64 * BS))  # stale content in every page: a fresh page must not show it
        write(cache, 1, table, keys[:n0], keys[:n0])
    want_sel, want_bounds, want_out, want_lens, after = [], [], [], [], {}
    for i in range(k + 1):
        reduced, selected, bounds, out = one_step(plain, table, keys, queries[i : i + 1], n0 + i, backend=backend)
        want_sel.append(selected[0].tolist())
        want_bounds.append(bounds[0])  # [pages visible at n0 + i, Hkv, 2D]
        want_out.append(out[0])
        want_lens.append(reduced.seq_lens[0])
        after[i] = plain.sparse_read.summaries.bounds[1][table].clone()  # [9, Hkv, 2D]
    reduced, selected, bounds, out = one_step(verify, table, keys, queries, n0, drafts=k, backend=backend)
    assert reduced.cu_seqlens_q == tuple(range(k + 2)) and list(reduced.seq_lens) == want_lens
    for i, want in enumerate(want_bounds):  # each row's summaries cover the tokens up to itself, no later draft
        assert torch.equal(bounds[i, : want.shape[0]], want)
    assert selected.tolist() == want_sel
    assert len({tuple(s) for s in want_sel}) > 1  # the rows select differently: a per-row selection matters
    torch.testing.assert_close(out, torch.stack(want_out), atol=1e-5, rtol=1e-5)
    verify.sparse_read.accept({7: rejected})
    held = (n0 + k - rejected) // BS + 1  # the pages holding committed tokens (the rest keep stale content)
    assert torch.equal(verify.sparse_read.summaries.bounds[1][table[:held]], after[k - rejected][:held])


# a token tree (drafts' parents, -1 = the root) crossing pages: a first-child chain of depth 4, side branches
TREE_PARENTS = [-1, 0, 1, 2, 1, 0, -1, 6]  # nodes 1..8 in preorder: depths 1 2 3 4 3 2 1 2


@pytest.mark.parametrize("quant, backend", [("fp32", "torch"), ("int4", "torch"), ("fp32", "triton")])
@pytest.mark.parametrize("path", [[], [1, 2, 3, 4], [1, 2, 5], [1, 6], [7, 8]])  # the accepted path (by depth)
def test_tree_rows_select_and_read_what_plain_decoding_does_at_their_position(quant, backend, path):
    """A token tree's 9 rows (root at cache index 25, nodes in tentative slots 26..33 in preorder) each select,
    and read, what plain decoding selects at the node's position (root + depth) with the node's ancestors as
    the tokens before it: its own plain cache is built for every node. After verification the summaries
    equal plain decoding's of the accepted path (rejected nodes, side branches included, leave nothing)."""
    g = torch.Generator().manual_seed(5)
    table = torch.randperm(60, generator=g)[:9].tolist()
    n0, k = 25, len(TREE_PARENTS)
    parents = [-1] + [p + 1 for p in TREE_PARENTS]  # over the root (node 0) and the nodes
    paths = [[]]
    for i in range(1, k + 1):
        paths.append(paths[parents[i]] + [i])
    keys = torch.randn(n0 + 1 + k, HKV, D, generator=g) * torch.rand(n0 + 1 + k, 1, 1, generator=g) * 3
    queries = torch.randn(k + 1, HKV * G, D, generator=g) * 3  # node i's query
    stale = torch.randn(64 * BS, HKV, D, generator=g) * 9
    want_sel, want_out, after = [], [], {}
    for i in range(k + 1):  # plain decoding at node i: committed prompt and root, then its ancestors, then itself
        plain = make_cache(4 * BS, quant)
        plain.store(1, stale, torch.zeros_like(stale), torch.arange(64 * BS))
        seq = torch.cat([keys[: n0 + 1], keys[[n0 + a for a in paths[i]]]])  # [n0 + 1 + depth, Hkv, D]
        write(plain, 1, table, seq[:-1], seq[:-1])
        _, selected, _, out = one_step(plain, table, seq, queries[i : i + 1], len(seq) - 1, backend=backend)
        want_sel.append(selected[0].tolist())
        want_out.append(out[0])
        after[i] = plain.sparse_read.summaries.bounds[1][table].clone()  # [9, Hkv, 2D]
    verify = make_cache(4 * BS, quant)
    verify.store(1, stale, torch.zeros_like(stale), torch.arange(64 * BS))
    write(verify, 1, table, keys[:n0], keys[:n0])
    seq = SimpleNamespace(seq_id=7, is_scoring=False, num_computed_tokens=n0, num_prompt_tokens=8,
                          draft_token_ids=[0] * k, draft_parents=TREE_PARENTS)
    plan = plan_paged_attention([0, k + 1], [n0 + k + 1], [table], BS, None, "cpu", null_block=verify.null_page,
                                tree_mask=ancestor_mask(parents))
    step = verify.sparse_read.begin_step([seq], [k + 1], [plan])
    slots = torch.tensor([table[i // BS] * BS + i % BS for i in range(n0, n0 + k + 1)])
    verify.store(1, keys[n0:], keys[n0:], slots)
    reduced = step.plan(1, queries, plan, SCALE)
    with ops.backend(backend):
        out = ops.run_paged_attention(queries, verify.k(1), verify.v(1), reduced, SCALE)
    assert reduced.cu_seqlens_q == tuple(range(k + 2)) and reduced.tree_starts is not None
    assert step.selected[1].tolist() == [s for i, s in enumerate(want_sel) if -(-(n0 + 1 + len(paths[i])) // BS) > 4]
    assert len({tuple(s) for s in want_sel}) > 1  # the rows select differently: a per-row selection matters
    torch.testing.assert_close(out, torch.stack(want_out), atol=1e-5, rtol=1e-5)
    verify.sparse_read.accept({7: k - len(path)}, {7: [0] + path})
    node = path[-1] if path else 0
    held = (n0 + len(path)) // BS + 1  # the pages holding committed tokens (the rest keep stale content)
    assert torch.equal(verify.sparse_read.summaries.bounds[1][table[:held]], after[node][:held])


# -- sparse reading meets formats, drafts and prefix hits (kvlab.testing.check_combination) ------------
SPARSE = {"quest": SPARSE_ARGS["quest"], "rocketkv": POLICY_ARGS["rocketkv"]}  # every layer sparse
ROUNDING = "runs outside the contract: a rounding format under a changing schedule; "  # the only deviation allowed
FORMATS = {"int4": {"quant": "int4"}, "int8": {"quant": "int8"}, "fp8_e4m3": {"quant": "fp8_e4m3"},
           "fp8_e5m2": {"quant": "fp8_e5m2"},
           "fp8_e4m3 calibrated": {"quant": "fp8_e4m3", "quant_args": {"scaling": "fixed", "scale": 0.5}},
           "fp8_e5m2 calibrated": {"quant": "fp8_e5m2", "quant_args": {"scaling": "fixed", "scale": 0.5}}}
MEETS = {"none": {},  # radix: a compacting policy (rocketkv) copies a hit's pages (keeping them whole is a deviation)
         "radix": {"enable_prefix_caching": True, "prefix_cache": "radix", "prefix_keep_shared": False},
         **{d: {"draft": d, "draft_args": DRAFT_ARGS[d]} for d in ("ngram", "model", "layerskip", "tree")}}


def sparse_combo(policy: str, *parts: str, **kw) -> dict:
    args = {"policy": policy, "policy_args": SPARSE[policy], **kw}
    for part in parts:
        args.update(FORMATS.get(part) or MEETS[part])
    return args


@pytest.mark.usefixtures("one_thread")
def test_verify_steps_run_under_sparse_reading_and_reject_some_drafts():
    """What the checks below rely on: drafts are verified (the scheduler lets a decoding sequence's drafts
    through under sparse reading), some are rejected, and verify rows are reduced reads."""
    llm = LLM(TINY, kv_cache_memory="4MiB", **sparse_combo("quest", "model"))
    batch, _ = shared_prompts(llm.model_config.vocab_size)
    llm.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True))
    stats = llm.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"] and stats["sparse_reads"] > 0


@pytest.mark.usefixtures("one_thread")
def test_sparse_reading_with_a_draft_and_radix_hits_is_exact():
    """Verify rows read what decode rows read, and a radix hit ending inside a page copies a page whose summary
    is recomputed over the tokens it holds (no longer a declared deviation)."""
    assert check_combination(**sparse_combo("quest", "layerskip", "radix")) == "exact"


@pytest.mark.usefixtures("one_thread")
def test_sparse_reading_with_radix_hits_on_copied_pages_is_exact():  # the composition matrix's one that differed
    assert check_combination(**sparse_combo("rocketkv", "radix")) == "exact"


@pytest.mark.usefixtures("one_thread")
def test_sparse_reading_with_a_packed_format_and_a_draft_runs_under_the_rounding_deviation_only():
    assert check_combination(**sparse_combo("quest", "int8", "ngram")).startswith(ROUNDING)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.heavy
@pytest.mark.parametrize("meets", sorted(MEETS))
@pytest.mark.parametrize("policy", sorted(SPARSE))
def test_sparse_reading_meets_drafts_and_prefix_hits_exactly(policy, meets):
    assert check_combination(**sparse_combo(policy, meets)) == "exact"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.heavy
@pytest.mark.parametrize("meets", sorted(MEETS))
@pytest.mark.parametrize("quant", sorted(FORMATS))
@pytest.mark.parametrize("policy", sorted(SPARSE))
def test_sparse_reading_with_every_rounding_format_runs_under_the_rounding_deviation_only(policy, quant, meets):
    """Packed formats keep page summaries (of the keys as computed) now; rounding formats stay under their
    declared deviation (a batch-invariant mode would make them exact): any other check that fails raises."""
    assert check_combination(**sparse_combo(policy, quant, meets)).startswith(ROUNDING)


@pytest.mark.parametrize("quant", ["int4", "int2", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_packed_pages_keep_summaries_of_the_keys_as_computed_whether_open_or_sealed(quant):
    """A packed page's summary is over its keys as the model computed them, before and after the page seals
    (int4 / int2: it leaves the residual window), so it never depends on when that happens."""
    g = torch.Generator().manual_seed(2)
    cache = make_cache(2 * BS, quant)
    s = cache.sparse_read.summaries
    table = [5, 9, 2, 14, 30, 7, 11, 40, 3, 22]
    keys = torch.randn(10 * BS, HKV, D, generator=g)
    done = 0
    for n in (2 * BS + 1, 10 * BS, None):  # early pages open (in a residual window), then sealed
        if n is None:  # a step whose pages 0..7 leave the window: they seal, their summaries stay
            assert cache.area is None or any(cache.area.row(p) >= 0 for p in table[:8])  # open ones, to seal
            cache.begin_step([torch.full((1,), -1)], [set(table[:8])])
            cache.plan_writes()
            assert cache.area is None or all(cache.area.row(p) < 0 for p in table[:8])
            n = done
        write(cache, 0, table, keys[:n], keys[:n], start=done, chunk=3)
        done = n
        for j in range(n // BS):
            page = keys[j * BS : (j + 1) * BS]
            assert torch.equal(s.kmax(0)[table[j]], page.max(dim=0).values)
            assert torch.equal(s.kmin(0)[table[j]], page.min(dim=0).values)


# -- quest in the engine --------------------------------------------------------------------
def test_quest_conforms():  # rocketkv evicts, so it runs with the compressing built-ins (tests/policies/test_policies.py)
    check_policy("quest", {"budget": 32, "dense_layers": 1}, "random:llama-tiny")  # 2 layers: 1 sparse


@pytest.mark.heavy  # ~75 s on the shared machine
def test_sparse_policies_conform_on_tiny_gemma3_with_sliding_layers():
    check_policy("quest", {"budget": 32, "dense_layers": 0}, "random:gemma3-tiny", checks=("budget", "memory", "no_op"))
    check_policy("rocketkv", {"budget": 64, "window_size": 8, "kernel_size": 5}, "random:gemma3-tiny",
                 checks=("budget", "memory", "no_op"))


@pytest.mark.heavy
@pytest.mark.model
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_quest_conforms_on_real_models(fresh_model, model):
    check_policy("quest", {"budget": 32}, model, loaded=fresh_model(model), kv_cache_memory="64MiB", max_tokens=4)


def test_quest_leaves_its_dense_layers_dense():
    step = SparseStep(make_cache(3 * BS).sparse_read, decode=[True])
    step.reader.policy.dense_layers = 1
    plan = plan_paged_attention([0, 1], [40], [list(range(10))], BS, None, "cpu", null_block=step.reader.summaries.null_page)
    q = torch.randn(1, HKV * G, D)
    assert step.plan(0, q, plan, SCALE) is plan and step.plan(1, q, plan, SCALE).seq_lens == (2 * BS + BS,)


def test_quest_frees_nothing_and_selects_what_its_bound_says(monkeypatch):
    """The pool holds exactly the full cache's pages at every step; every reduced read keeps the sink,
    the newest page and the pages Quest's bound ranks highest, recomputed here from the cached keys."""
    prompt = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    checked = []
    original = SparseStep.plan

    def checking(self, layer, q, plan, scale):
        reduced = original(self, layer, q, plan, scale)
        cache = self.reader.cache
        for i, b in enumerate(self.rows(plan).rows):
            n, table = plan.seq_lens[b], plan.block_tables[b]
            slots = torch.tensor([table[j // 16] * 16 + j % 16 for j in range(n)])
            keys = cache.k(layer).view(-1, *cache.k(layer).shape[2:])[slots]  # [n, Hkv, D] as cached
            want = quest_reference_pages(q[plan.cu_seqlens_q[b]], keys, self.reader.pages, 16, scale)
            assert set(self.selected[layer][i].tolist()) == want
            assert reduced.seq_lens[b] < n
            checked.append(layer)
        return reduced

    monkeypatch.setattr(SparseStep, "plan", checking)
    quest = LLM("random:llama-tiny", policy="quest", policy_args={"budget": 32, "dense_layers": 0}, block_size=16)
    full = LLM("random:llama-tiny", block_size=16)
    used = []
    for llm in (quest, full):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        steps = []
        while llm.engine.has_unfinished():
            llm.engine.step()
            steps.append(llm.engine.block_manager.num_used_blocks())
        used.append(steps)
    assert used[0] == used[1]
    assert len(checked) == 4 * 2  # 4 decode steps x 2 layers
    stats = quest.engine.stats()
    assert 0 < stats["sparse_tokens_read"] < stats["sparse_tokens_cached"]


# -- rocketkv in the engine -------------------------------------------------------------------
def test_rocketkv_evicts_like_snapkv_then_reads_a_subset():
    prompt = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    args = {"budget": 64, "window_size": 8, "kernel_size": 5}
    rocket = LLM("random:llama-tiny", policy="rocketkv", policy_args=args, block_size=16)
    kept = rocket.engine.policy.layer_budget(0, 2, 200)
    assert 32 < kept < 200
    snap = LLM("random:llama-tiny", policy="snapkv", policy_args={"budget": kept, "window_size": 8, "kernel_size": 5},
               block_size=16)
    held = []
    for llm in (rocket, snap):
        engine = llm.engine
        engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        seq = engine.scheduler.waiting[0]
        while seq.num_computed_tokens < len(prompt):
            engine.step()
        bm = engine.block_manager
        held.append([engine.compressor.gather(seq, g, bm.groups[g].layers[0])[0] for g in range(len(bm.groups))])
        assert bm.num_used_blocks() == 2 * -(-kept // 16) < 2 * -(-200 // 16)  # pages freed at prefill
        engine.step()  # the first decode step
        if llm is rocket:  # pages the compaction rewrote were recomputed from the compacted keys
            s = engine.cache.sparse_read.summaries
            for g in range(len(bm.groups)):
                keys = engine.compressor.gather(seq, g, bm.groups[g].layers[0])[0]  # [kept + 1, Hkv, D]
                for j, page in enumerate(bm.block_tables([seq], g)[0]):
                    torch.testing.assert_close(s.kmin(0)[page], keys[j * 16 : (j + 1) * 16].min(dim=0).values)
                    torch.testing.assert_close(s.kmax(0)[page], keys[j * 16 : (j + 1) * 16].max(dim=0).values)
        while engine.has_unfinished():
            engine.step()
    for a, b in zip(*held):
        assert torch.equal(a, b)  # stage 1 kept what snapkv keeps
    stats = rocket.engine.stats()
    assert 0 < stats["sparse_tokens_read"] < stats["sparse_tokens_cached"]
    assert rocket.engine.cache.sparse_read.max_tokens_read <= 2 * 16  # budget 64: 32 tokens, 2 pages


def test_rocketkv_channel_rule_and_scores():
    """channels=None reads ceil(D * bs * (budget // 2) / n) channels per KV head (at most D); a page
    whose bound is far larger on the chosen channels ranks first."""
    policy = POLICIES.build("rocketkv", budget=16)
    q = torch.tensor([0.1, 0.2, 1.0, 0.3, 0.05, 0.4, 0.15, 0.25]).expand(1, 4, 8)  # channel 2 first, then 5, 3, 7
    counts = torch.tensor([[16] * 20 + [4]])  # 324 tokens
    mask = policy._channel_mask(q.reshape(1, 2, 2, 8), counts)
    assert mask[0, 0].nonzero().view(-1).tolist() == [2, 3, 5, 7] and mask[0, 1].equal(mask[0, 0])  # 4 channels
    assert POLICIES.build("rocketkv", budget=64)._channel_mask(q.reshape(1, 2, 2, 8), counts).all()  # 13 -> D
    bounds = torch.zeros(1, 21, 2, 16)  # [max | -min]
    bounds[0, 7, :, 2] = 5.0  # page 7's keys reach 5 along channel 2
    bounds[0, 3, :, 8 + 2] = 5.0  # page 3's reach -5: the sign of q picks the max, so it does not count
    scores = policy.page_scores(0, q, bounds, counts, 8 ** -0.5)
    assert scores.argmax().item() == 7 and scores[0, 3] == scores[0, 0]


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name, args, message", [
    ("quest", {"budget": 0}, "budget must be an integer >= 1"),
    ("quest", {}, "quest needs a budget"),
    ("quest", {"compression_ratio": 0.5}, "compression_ratio is not supported"),
    ("quest", {"budget": 16}, r"budget must be >= 2 \* block_size = 32"),
    ("quest", {"budget": 64, "dense_layers": -1}, "dense_layers must be an integer >= 0"),
    ("rocketkv", {"budget": 0}, "budget must be an integer >= 1"),
    ("rocketkv", {"budget": 16}, r"budget must be >= 2 \* block_size = 32"),
    ("rocketkv", {"budget": 64, "when": "decode"}, "rocketkv evicts once, at the end of prefill"),
    ("rocketkv", {"budget": 64, "prompt_budget": 0}, "prompt_budget must be an integer >= 1"),
    ("rocketkv", {"compression_ratio": 0.5}, "compression_ratio is not supported"),
])
def test_bad_sparse_policy_input_fails_before_the_model_loads(name, args, message):
    with pytest.raises(ValueError, match=message):
        LLM("does-not-exist", policy=name, policy_args=args, block_size=16)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("policy", sorted(SPARSE))
def test_token_trees_verify_under_sparse_reading_exactly(policy, monkeypatch):
    """A token tree over sparse reading (once refused): its nodes' rows are reduced reads under a tree mask
    (tree_starts), some nodes are rejected, and greedy output equals the same cache without the draft, batched,
    chunked and preempted alike, the pool draining every time (check_combination)."""
    reduced_trees = []
    plan = SparseStep.plan

    def spy(self, layer, q, step_plan, scale):
        got = plan(self, layer, q, step_plan, scale)
        reduced_trees.append(got.tree_starts is not None and got is not step_plan)
        return got

    monkeypatch.setattr(SparseStep, "plan", spy)
    llm = LLM(TINY, kv_cache_memory="4MiB", **sparse_combo(policy, "tree"))
    batch, _ = shared_prompts(llm.model_config.vocab_size)
    llm.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True))
    stats = llm.stats()
    assert stats["spec_tree_nodes"] > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
    assert any(reduced_trees)  # tree rows read selected pages
    monkeypatch.setattr(SparseStep, "plan", plan)
    assert check_combination(**sparse_combo(policy, "tree")) == "exact"

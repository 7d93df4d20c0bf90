"""int4 / int2 residual rows leased from the pool (kvlab.cache.quant.lease) in the engine: the whole byte budget
buys pages, a sequence's open pages borrow free pages' codes for their full-precision rows and give them
back when sealed or freed, so few running sequences hold what the format's bits promise; outputs are
those of rows in an area of their own. Tiny random Llama (2 layers, 2 KV heads of 16)."""

import functools

import pytest
import torch

import kvlab.engine.build
from kvlab import LLM, SamplingParams
from kvlab.cache.block_manager import BlockManager
from kvlab.models import load_model

MODEL = "random:llama-tiny"
KIVI = {"int4": {"group_size": 8, "residual": 16}, "int2": {"group_size": 8, "residual": 16}}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(quant, pages: int | None = None, memory="1MiB", **kw) -> LLM:
    """An engine of `pages` pages of `quant` (16 tokens each), or of `memory` bytes."""
    if pages is not None:
        per_page = LLM(MODEL, block_size=16, kv_cache_memory="1MiB", quant=quant,
                       quant_args=KIVI.get(quant, {})).engine.bytes_per_block
        memory = int(pages * per_page)
    return LLM(MODEL, block_size=16, kv_cache_memory=memory, quant=quant, quant_args=KIVI.get(quant, {}), **kw)


def own_rows(monkeypatch):
    """Engines built from here on keep residual rows in an area of their own (one row per page)."""
    monkeypatch.setattr(kvlab.engine.build, "lessor_for", lambda *a, **k: None)


@pytest.mark.parametrize("quant,k", [("int4", 8), ("int2", 16)])
def test_the_whole_budget_buys_pages(quant, k):
    """No residual area is paid for up front: pages = budget // page bytes, and the cache's physical
    bytes (pool + residual area + scales) stay within the budget (plus the null page)."""
    llm = engine(quant, memory="1MiB")
    e, c = llm.engine, llm.engine.cache
    assert e.block_manager.num_blocks == 2**20 // e.bytes_per_block
    assert c.residual_nbytes() == 0 and c.area.k == k and c.area.lessor is not None
    assert c.nbytes() <= 2**20 + e.bytes_per_block


def test_one_long_sequence_holds_what_the_bits_promise():
    """48 int4 pages: a 400-token prompt (+ 8 new) needs 26 of them, its two open pages lease 2 x 8 more,
    2 stay free for its growth. Rows reserved up front for max_num_seqs sequences (at most half the budget)
    left 24 pages: the request could not run at all."""
    llm = engine("int4", pages=48)
    assert llm.engine.block_manager.num_blocks == 48
    out = llm.generate([prompt(400, 0)], GREEDY)
    assert len(out[0].token_ids) == 8
    area = llm.engine.cache.area
    assert area.early_seals == 0 and area.leased_peak == 2
    assert llm.stats()["preemptions"] == 0 and llm.engine.block_manager.num_used_blocks() == 0


@pytest.mark.parametrize("quant", ["int4", "int2"])
def test_leased_rows_answer_as_rows_of_their_own(quant, monkeypatch):
    """Five requests, chunked prefill, batched decodes: greedy tokens and teacher-forced log-probabilities
    identical to an engine whose rows live in an area of their own; the pool drains, every lease returned."""
    prompts = [prompt(n, i) for i, n in enumerate((70, 33, 90, 17, 50))]
    cont = [prompt(12, 10 + i) for i in range(len(prompts))]
    leased = engine(quant, memory="2MiB", max_prefill_chunk=24)
    got = ([o.token_ids for o in leased.generate(prompts, GREEDY)], [o.logprobs for o in leased.score(prompts, cont)])
    area = leased.engine.cache.area
    assert area.leased_peak >= 2 * len(prompts) and area.early_seals == 0
    assert area.num_leased == 0 and not area.open_pages() and leased.engine.block_manager.num_used_blocks() == 0
    own_rows(monkeypatch)
    own = engine(quant, memory="2MiB", max_prefill_chunk=24)
    assert own.engine.cache.area.lessor is None
    want = ([o.token_ids for o in own.generate(prompts, GREEDY)], [o.logprobs for o in own.score(prompts, cont)])
    assert got == want


@pytest.mark.parametrize("quant,pages", [("int4", 40), ("int2", 80)])
def test_a_pool_short_of_free_pages_answers_as_a_large_one(quant, pages):
    """12 requests in a few pages (a row costs 8 int4 pages here, 16 int2 pages): rows are claimed as steps are scheduled (kvlab.cache.quant.lease.RowClaims), so
    requests wait or are preempted instead of a page being sealed before its tokens leave the window;
    greedy tokens and log-probabilities equal the same requests in a pool ten times larger, no page is
    sealed early, and the pool drains."""
    prompts = [prompt(40 + 3 * i, 20 + i) for i in range(12)]
    cont = [prompt(12, 40 + i) for i in range(12)]
    runs = {}
    small, large = pages, 10 * pages
    for pages in (small, large):
        llm = engine(quant, pages=pages, max_prefill_chunk=24)
        out = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        scores = [o.logprobs for o in llm.score(prompts, cont)]
        stats, area = llm.engine.stats(), llm.engine.cache.area
        assert stats["residual_early_seals"] == 0 and area.early_seals == 0
        assert area.num_leased == 0 and llm.engine.block_manager.num_used_blocks() == 0
        runs[pages] = ([o.token_ids for o in out], scores, stats.get("preemptions", 0), area.leased_peak)
    assert runs[small][0] == runs[large][0]
    # log-probabilities: another batch sums attention in another order (float32 rounding, as without quantisation);
    # a page read quantised instead of from its full-precision row moves them by far more (~1e-2)
    gap = max(abs(a - b) for x, y in zip(runs[small][1], runs[large][1]) for a, b in zip(x, y))
    assert gap < 1e-4, gap
    assert runs[small][2] > 0 or runs[small][3] < runs[large][3], "the small pool was never short: the test is vacuous"


def test_a_page_a_pending_copy_reads_is_held_and_its_copy_takes_its_row_over():
    """A forked sample's copy-on-write copy of an open page is planned when the scheduler appends to it; if the
    page's other holder is freed (preempted) before the copy is applied, the page must not be sealed under the
    copy (it would be copied as codes: the copy then reads quantised what it held in full precision)."""
    from kvlab.cache.allocators.paged import PagedAllocator
    from kvlab.cache.quant.lease import PageLessor

    a = PagedAllocator()
    a.setup(8, 4)
    a.allocate(0, 4, 4)
    lessor = PageLessor(a, 4)
    page = a.block_table(0)[0]
    a.pending_copies.append((page, 5))
    a.free(0)
    assert lessor.held()(page)  # a pending copy still reads it
    a.take_copies()
    assert not lessor.held()(page)


# -- tiny pools: every request that fits runs, one that can never fit is refused before it is queued --------------
TINY = {"block_size": 4, "max_num_batched_tokens": 32, "quant": "int4"}  # int4's defaults: residual 32, rows of 8 pages
# prompt tokens (6 new each) -> pages + 8 x rows at the peak, one token a step (BlockManager._peak)
TINY_NEEDS = {1: 18, 8: 36, 28: 81, 40: 84}


@functools.cache
def tiny_model():
    return load_model(MODEL)


@functools.cache
def tiny_page_bytes() -> int:
    return LLM(MODEL, loaded=tiny_model(), kv_cache_memory="1MiB", **TINY).engine.bytes_per_block


def tiny_pool(pages: int) -> LLM:
    llm = LLM(MODEL, loaded=tiny_model(), kv_cache_memory=int(pages * tiny_page_bytes()), **TINY)
    assert llm.engine.block_manager.num_blocks == pages
    return llm


def runs_alone(pages: int, ids: list[int], params: SamplingParams, monkeypatch) -> bool:
    """Whether the request finishes alone in the pool with the capacity check off (False: the scheduler could not
    schedule it, or it preempted itself: the pool cannot hold it even one token a step)."""
    with monkeypatch.context() as m:
        m.setattr(BlockManager, "capacity_error", lambda self, seq: None)
        engine = tiny_pool(pages).engine
        engine.add_request(ids, params)
    for _ in range(200):
        try:
            engine.step()
        except RuntimeError as exc:
            assert "cannot be scheduled in an empty pool" in str(exc)
            return False
        if engine.stats().get("preemptions", 0):
            return False
        if not engine.has_unfinished():
            assert engine.cache.area.early_seals == 0
            return True
    raise AssertionError("the request neither finished nor got stuck")


def test_tiny_pools_run_every_request_that_fits_and_refuse_the_others_at_once(monkeypatch):
    """int4 in a few pages of 4 tokens under a 32-token step budget (a residual row costs 8 pages, a 32-token window
    keeps up to 9 rows open): a request is refused at add_request exactly when, alone, its pages and open rows do not
    fit one token a step (the shortest one each pool refuses is run with the check off: it gets stuck; 81 pages hold
    the 28-token prompt's 9 pages and 9 rows, 80 do not); the others run together with the tokens of an ample pool and
    no page sealed early; alone, the 40-token prompt's second chunk (its 8 open rows stay leased through the step) is
    halved until it fits its 84 pages. Before, every admission was charged a window of rows (72 pages) and
    capacity_error none: requests that fit could never be scheduled ('cannot be scheduled in an empty pool')."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = {n: prompt(n, 60 + n) for n in TINY_NEEDS}
    want = dict(zip(prompts, (o.token_ids for o in tiny_pool(4096).generate(list(prompts.values()), params))))
    for pages in (8, 20, 80, 81, 84):
        llm = tiny_pool(pages)
        fits = []
        for n, ids in prompts.items():
            try:
                llm.engine.make_sequence(ids, params)
                fits.append(n)
            except ValueError as exc:
                assert "the KV pool has only" in str(exc) and "residual rows" in str(exc), exc
        assert fits == [n for n, need in TINY_NEEDS.items() if need <= pages], pages
        out = llm.generate([prompts[n] for n in fits], params) if fits else []
        assert [o.token_ids for o in out] == [want[n] for n in fits], pages
        area = llm.engine.cache.area
        assert area.early_seals == 0 and area.num_leased == 0 and llm.engine.block_manager.num_used_blocks() == 0
        refused = [n for n in prompts if n not in fits]
        if refused:  # the shortest one refused cannot run either
            assert not runs_alone(pages, prompts[refused[0]], params, monkeypatch), (pages, refused[0])
    assert runs_alone(84, prompts[40], params, monkeypatch)

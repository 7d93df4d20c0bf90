"""int4 / int2 residual rows leased from the pool (kvlab.cache.quant.lease) in the engine: the whole byte budget
buys pages, a sequence's open pages borrow free pages' codes for their full-precision rows and give them
back when sealed or freed, so few running sequences hold what the format's bits promise; outputs are
those of rows in an area of their own. Tiny random Llama (2 layers, 2 KV heads of 16)."""

import pytest
import torch

import kvlab.engine.build
from kvlab import LLM, SamplingParams

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

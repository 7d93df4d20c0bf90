"""Every request `BlockManager.capacity_error` admits runs to completion alone in the pool, however small (kvlab
issue 23): the pool at exactly its peak holds it, with the tokens of an ample pool; the combination suite fails a
request stuck in an empty pool (it once counted that as a pool too small)."""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams
from kvlab.cache.allocators import PagedAllocator
from kvlab.cache.block_manager import BlockManager, LayerGroup
from kvlab.cache.prefix_cache import PrefixCache
from kvlab.engine.scheduler import Scheduler
from kvlab.registry import PREFIX_EVICTIONS
from kvlab.sequence import Sequence
from kvlab.testing.builtin_args import DRAFT_ARGS, TINY
from kvlab.testing.combinations import _check_schedule_independence, shared_prompts

from helpers import run_step

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("quant,draft,which", [("int4", "ngram", 4), ("int2", "model", 0)])
def test_a_packed_cache_under_a_chain_draft_runs_alone_in_a_pool_of_its_peak(quant, draft, which):
    """Batch-invariant packed pages seal in token time: a verify step's accepted drafts push pages out of the window
    that its write, counting committed tokens only, left open. Sealed only at the next write, their rows came back
    a step late, so a lone sequence held a row more than `RowClaims.lone_rows` counts and, at a page boundary,
    preempted itself for good ('cannot be scheduled in an empty pool'; the suite's int4 + ngram, int2 + model and
    int4 + self_compressed). Verification seals them now (PagedKV.seal_accepted), as a tree's path does."""
    args = dict(quant=quant, batch_invariant=True, draft=draft, draft_args=DRAFT_ARGS[draft], max_num_batched_tokens=32)
    ample = LLM(TINY, kv_cache_memory="4MiB", **args)
    prompt = shared_prompts(ample.model_config.vocab_size)[0][which]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    need, rows = ample.engine.block_manager._peak(ample.engine.make_sequence(prompt, params))
    assert rows > 0  # its open pages' rows are part of its peak
    want = ample.generate([prompt], params)[0].outputs[0].token_ids
    lone = LLM(TINY, kv_cache_memory=int(need * ample.engine.bytes_per_block), **args)
    assert lone.engine.block_manager.num_blocks == need and lone.engine.block_manager.capacity_error(
        lone.engine.make_sequence(prompt, params)) is None
    assert lone.generate([prompt], params)[0].outputs[0].token_ids == want
    stats = lone.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["residual_early_seals"] == 0


def test_a_prefix_hit_that_does_not_fit_an_empty_pool_is_computed_instead():
    """In an empty pool every cached page is parked (counted free), so a hit costs at least the fresh pages computing
    its tokens does, and more where its pages are copied (prefix_keep_shared=False: a copy each; a partly used page):
    a request capacity_error admits (its tables fit) whose hit does not fit is admitted without the hit rather than
    waiting for ever (the suite's copied hits with rocketkv and snapkv, hash and radix). Torch-free."""
    cache = PrefixCache(4, PREFIX_EVICTIONS.build("lru"), b"model")
    bm = BlockManager([LayerGroup((0,))], PagedAllocator(), 8, 4, 64, prefix_cache=cache)
    bm.keep_shared = False
    prompt = list(range(10, 30))  # 20 tokens: 5 pages, registered, then parked
    first = Sequence(0, prompt, SamplingParams(max_tokens=4), 24, 0.0)
    bm.allocate(first, 20, bm.lookup(first))
    first.num_computed_tokens = 20
    bm.commit(first)
    bm.free(first)
    again = Sequence(1, prompt + list(range(40, 48)), SamplingParams(max_tokens=4), 32, 0.0)  # 28 + 4: 8 pages
    hit = bm.lookup(again)
    assert hit.tokens == 20 and bm.capacity_error(again) is None
    assert not bm.can_allocate(again, hit, 1)  # 2 pages past the hit, 5 parked taken back, 5 copies: 12 > 8
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    s.add(again)
    batch = run_step(s)
    assert batch.seqs == [again] and batch.num_new_tokens == [28] and bm.num_hit_tokens(again) == 0
    while s.has_unfinished():
        assert run_step(s).seqs == [again]
    assert again.num_output_tokens == 4 and bm.allocator.num_free_blocks == 8


def test_the_combination_suite_fails_a_request_stuck_alone_in_the_pool(monkeypatch):
    """With the capacity check off, the smallest pool admits requests it can never hold: the schedule check names the
    stuck request and what it needed, not a pool too small to try."""
    monkeypatch.setattr(BlockManager, "capacity_error", lambda self, seq: None)

    def make(**kw):
        return LLM(TINY, **{"kv_cache_memory": "4MiB", **kw})

    batch, _ = shared_prompts(make().model_config.vocab_size)
    with pytest.raises(AssertionError, match=r"in pool 24KiB, request \d+ cannot be scheduled in an empty pool: "
                                             r".*capacity_error admitted it needing \d+ blocks"):
        _check_schedule_independence(make, batch[3:4], 1, ("24KiB",), "the defaults")

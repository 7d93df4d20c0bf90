"""Prefix caching with int4 / int2 pages that keep a full-precision residual window (KIVI).

A page inside a request's residual window is *open*: its K/V live in a full-precision row. A hit
stops at least `residual` tokens before the prompt's end (the window is computed by the request),
and never shares a page open in another running sequence's window (that sequence would see it
sealed under it). A finished request's open pages are sealed when it frees them (their leased rows
go back to the pool) and are shared sealed, as the new request's window rule would have sealed them
at its first step. With prefill chunks that start where the hit ends
(the prefix computed in the same chunks as its first request), greedy output equals caching off.
Tiny random Llama.
"""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams

MODEL = "random:llama-tiny"
CHUNK = 16  # prefill chunk: the shared prefix (64 tokens) ends on a chunk boundary


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = tokens(64, 0)


def llm(on: bool, quant: str = "int4", residual: int = 16, **kw) -> LLM:
    return LLM(MODEL, block_size=8, kv_cache_memory="1MiB", max_num_seqs=1, max_prefill_chunk=CHUNK,
               quant=quant, quant_args={"group_size": 8, "residual": residual}, enable_prefix_caching=on, **kw)


def greedy(engine: LLM, prompts, max_tokens: int = 10):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("quant", ["int4", "int2"])
@pytest.mark.parametrize("tail", [40, 5])
def test_a_hit_equals_caching_off_and_leaves_the_window_to_compute(quant, tail):
    first, second = PREFIX + tokens(20, 1), PREFIX + tokens(tail, 2)
    on = llm(True, quant)
    greedy(on, [first])
    on.reset_stats()
    got = greedy(on, [second])
    want = greedy(llm(False, quant), [second])
    assert got == want
    hit = on.stats()["prefix_hit_tokens"]
    # the whole prefix when the rest of the prompt covers the window; else pages ending <= n - residual
    assert hit == (64 if tail >= 16 else (len(second) - 16) // 8 * 8)


def test_a_finished_requests_window_pages_are_sealed_and_shared():
    """The first request's last prompt pages are still open when it finishes (its window moved only by
    its 10 generated tokens): they are sealed then, their residual rows going back to the pool's free
    pages (kvlab.cache.quant.lease), and a longer prompt containing it hits them all, as caching off reads them."""
    on = llm(True)
    engine = on.engine
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine.add_request(PREFIX, params)
    while engine.has_unfinished():
        window_open = bool(engine.cache.area.open_pages())
        engine.step()
    area = engine.cache.area
    assert window_open and not area.open_pages() and area.num_leased == 0  # sealed once nobody held them
    on.reset_stats()
    second = PREFIX + tokens(40, 3)
    got = greedy(on, [second])
    assert on.stats()["prefix_hit_tokens"] == 64  # every prompt page, the open ones too
    assert got == greedy(llm(False), [second])


def test_an_open_page_another_request_holds_is_not_shared():
    """While the first request decodes, the pages of its window are open: the second request's hit stops
    before them (it would read full-precision K/V the first request's own reads will see sealed later)."""
    engine = llm(True).engine
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request(PREFIX, params)
    while not any(s.num_computed_tokens > 64 for s in engine.scheduler.running):
        engine.step()  # the first request's prompt is in and it decodes
    first = engine.scheduler.running[0]
    held_open = {p for p in engine.cache.area.open_pages()
                 if p in engine.block_manager.block_tables([first], 0)[0]}
    assert held_open
    second = PREFIX + tokens(40, 4)
    hit = engine.block_manager.num_cached_tokens(engine.make_sequence(second, params))
    table = engine.block_manager.block_tables([first], 0)[0]
    assert hit == 8 * min(table.index(p) for p in held_open)  # the hit ends at the first page still open
    assert all(engine.cache.area.row(p) >= 0 for p in held_open)  # nothing of the first request was sealed


def test_token_granularity_shares_whole_pages_only_with_a_residual_window():
    """A partly matched page would be reopened into the new request's window: only whole pages are hit."""
    first, second = PREFIX + tokens(20, 5), PREFIX[:60] + tokens(40, 6)
    for cache in ({"prefix_match": "token"}, {"prefix_cache": "radix"}):
        on = llm(True, **cache)
        greedy(on, [first])
        on.reset_stats()
        greedy(on, [second])
        assert on.stats()["prefix_hit_tokens"] == 56, cache

"""Engine-level fork: a child request shares its parent's pages and copies a shared page before writing it.

On the tiny random Llama (block size 4: a 10-token prompt leaves a half-full shared page, so the
first decode of parent and child each writes into it). Checked against independent requests: the
greedy parent and child must equal a fresh greedy request, and a sampled child must equal a fresh
seeded request that starts from the prompt plus the parent's first token.
"""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams

PAGE_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 tokens, 2 KV heads of 16, float32


@pytest.fixture
def llm():
    return LLM("random:llama-tiny", block_size=4, max_model_len=128, kv_cache_memory=64 * PAGE_BYTES)


def run(engine) -> dict:
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    return outs


def test_fork_shares_pages_then_copies_on_write(llm, monkeypatch):
    engine, bm = llm.engine, llm.engine.block_manager
    prompt = torch.randint(3, 256, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    parent = engine.add_request(prompt, params)
    engine.step()  # prefill and the first token
    used = bm.num_used_blocks()
    copies = []
    real_copy = engine.cache.copy_blocks
    monkeypatch.setattr(engine.cache, "copy_blocks", lambda pairs, *whole: (copies.extend(pairs),
                                                                       real_copy(pairs, *whole)))
    child = engine.fork(parent)
    assert bm.num_used_blocks() == used  # nothing copied yet: every page is shared
    outs = run(engine)
    assert len(copies) == 1  # the half-full shared page, copied once before the first write into it
    expected = llm.generate([prompt], params)[0].token_ids
    assert outs[parent].token_ids == outs[child].token_ids == expected
    assert bm.allocator.num_free_blocks == bm.num_blocks


def test_a_sampled_child_never_disturbs_its_parent(llm):
    engine, bm = llm.engine, llm.engine.block_manager
    prompt = torch.randint(3, 256, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    parent = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    child = engine.fork(parent, sampled)
    outs = run(engine)
    greedy = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    first = greedy[0]
    fresh = llm.generate([prompt + [first]], SamplingParams(max_tokens=7, temperature=1.0, seed=5,
                                                            ignore_eos=True))[0].token_ids
    assert outs[parent].token_ids == greedy  # the child's writes never reached the parent's pages
    assert outs[child].token_ids == [first] + fresh
    assert outs[child].token_ids != greedy  # (the sample did diverge, so the test had something to catch)
    assert bm.allocator.num_free_blocks == bm.num_blocks


def test_fork_of_a_request_that_is_not_decoding_is_an_error(llm):
    rid = llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=f"request {rid} is not a running generation request"):
        llm.engine.fork(rid)
    run(llm.engine)

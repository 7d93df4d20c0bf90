"""Prefix caching and parallel sampling in the engine (tiny random Llama and Gemma 3).

Greedy outputs with `enable_prefix_caching` are token-identical to outputs without it: batches of
prompts sharing a system prompt, a pool small enough to preempt and evict, chunked prefill, and a
second batch that hits the first one's pages. Gemma 3's tiny shape has a sliding window of 8 on 5
of its 6 layers, so its window groups share pages too. `SamplingParams(n=k, seed=s)` samples as
k separate requests with seeds s .. s + k - 1.
"""

from __future__ import annotations

import pytest
import torch

import kvlab.engine.build
from kvlab import LLM, SamplingParams
from kvlab.outputs import RequestOutput
from kvlab.registry import UnknownPluginError

SLOW = pytest.mark.heavy  # the same check for the other eviction policies (the property tests cover them fast)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def prompts_with_system(system_len: int, tail_lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 256, (system_len,), generator=g).tolist()
    return [system + torch.randint(3, 256, (n,), generator=g).tolist() for n in tail_lens]


# per model: KV pool bytes (small enough to preempt and evict), new tokens, prompts sharing a system prompt
SETUPS = {
    "random:llama-tiny": (24 * 1024, 10, prompts_with_system(23, [5, 6, 7, 8, 9, 10])),
    "random:gemma3-tiny": (96 * 1024, 16, prompts_with_system(13, [7, 12, 17, 5, 9, 14, 1, 3])),  # window 8
}


def run_batches(model: str, on: bool, **engine):
    memory, max_tokens, prompts = SETUPS[model]
    llm = LLM(model, block_size=4, max_model_len=128, kv_cache_memory=memory, max_num_batched_tokens=32,
              enable_prefix_caching=on, **engine)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    half = len(prompts) // 2
    outs = [[o.token_ids for o in llm.generate(batch, params)] for batch in (prompts[:half], prompts[half:], prompts)]
    return outs, llm.stats()


_off: dict = {}


@pytest.mark.parametrize("model", SETUPS)
@pytest.mark.parametrize("eviction, match", [("lru", "page"), ("lru", "token"), pytest.param("lfu", "page", marks=SLOW),
                                             pytest.param("slru", "page", marks=SLOW),
                                             pytest.param("arc", "token", marks=SLOW), ("lru", "radix"),
                                             pytest.param("arc", "radix", marks=SLOW)])
def test_greedy_outputs_with_prefix_caching_equal_outputs_without(model, eviction, match):
    if model not in _off:
        _off[model] = run_batches(model, False)
    off, _ = _off[model]
    cache = {"prefix_cache": "radix"} if match == "radix" else {"prefix_match": match}
    on, stats = run_batches(model, True, prefix_eviction=eviction, **cache)
    assert on == off
    assert stats["prefix_hit_tokens"] >= 3 * 12  # later requests found at least the system prompt's pages
    assert stats["prefix_evictions"] > 0
    if match == "page":  # (token-granularity hits change admission: these pools need not preempt then)
        assert stats["preemptions"] > 0  # preempted requests hit their own pages
    assert stats["prefix_pages_saved"] > 0 and 0 < stats["prefix_hit_rate_tokens"] < 1


def test_a_repeated_prompt_hits_every_full_page_but_computes_its_last_token():
    llm = LLM("random:llama-tiny", block_size=4, max_model_len=128, kv_cache_memory=64 * 1024,
              enable_prefix_caching=True)
    prompt = prompts_with_system(23, [5])[0]  # 28 tokens: 7 full pages
    first = llm.generate([prompt], SamplingParams(max_tokens=5))
    llm.reset_stats()
    again = llm.generate([prompt], SamplingParams(max_tokens=5))
    stats = llm.stats()
    assert again[0].token_ids == first[0].token_ids
    assert stats["prefix_hit_tokens"] == 24 and stats["prefix_queried_tokens"] == 28  # the last page is recomputed
    assert stats["prefix_pages_saved"] == 6 and stats["prefix_hit_rate_pages"] == 6 / 7
    bm = llm.engine.block_manager
    assert bm.allocator.num_free_blocks == bm.num_blocks  # cached-free pages count as free


def test_prefix_caching_composes_with_a_quantised_cache_format():
    prompts = prompts_with_system(23, [5, 6, 7])
    outs = []
    for on in (False, True):
        llm = LLM("random:llama-tiny", block_size=4, max_model_len=128, kv_cache_memory=64 * 1024, quant="bf16",
                  enable_prefix_caching=on)
        outs.append([[o.token_ids for o in llm.generate(batch, SamplingParams(max_tokens=6, ignore_eos=True))]
                     for batch in (prompts[:1], prompts)])
    assert outs[0] == outs[1] and llm.stats()["prefix_hit_tokens"] >= 3 * 20
    assert b"bf16" in llm.engine.block_manager.prefix_cache.salt  # the format is part of every block's salt


def test_requests_with_different_salts_never_share_pages():
    llm = LLM("random:llama-tiny", block_size=4, max_model_len=128, kv_cache_memory=64 * 1024,
              enable_prefix_caching=True)
    prompt = prompts_with_system(23, [5])[0]
    for salt in ["user-a", "user-b", b"user-a", None]:
        llm.generate([prompt], SamplingParams(max_tokens=2, cache_salt=salt))
    assert llm.stats()["prefix_hit_tokens"] == 0
    llm.generate([prompt], SamplingParams(max_tokens=2, cache_salt="user-a"))
    assert llm.stats()["prefix_hit_tokens"] == 24


# -- parallel sampling ----------------------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_samples_equal_separate_requests_with_derived_seeds(prefix_caching):
    llm = LLM("random:llama-tiny", block_size=4, max_model_len=128, kv_cache_memory=24 * 1024,
              enable_prefix_caching=prefix_caching)
    prompts = prompts_with_system(5, [5, 6, 7])
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    grouped = llm.generate(prompts, params)
    assert llm.stats()["cow_copies"] > 0  # the samples shared the prompt's half-full last page
    separate = llm.generate([p for p in prompts for _ in range(3)],
                            [SamplingParams(max_tokens=8, temperature=1.0, seed=7 + i, ignore_eos=True)
                             for _ in prompts for i in range(3)])
    assert [len(g.outputs) for g in grouped] == [3, 3, 3]
    assert [[c.index for c in g.outputs] for g in grouped] == [[0, 1, 2]] * 3
    assert [[c.token_ids for c in g.outputs] for g in grouped] == [[o.token_ids for o in separate[3 * j:3 * j + 3]]
                                                                     for j in range(3)]
    assert len({tuple(c.token_ids) for c in grouped[0].outputs}) > 1  # the samples differ
    bm = llm.engine.block_manager
    assert bm.allocator.num_free_blocks == bm.num_blocks and not llm.engine._groups and not llm.engine._samples


def test_one_request_output_per_prompt_whatever_n():
    llm = LLM("random:llama-tiny", block_size=4, max_model_len=128, kv_cache_memory=24 * 1024)
    prompts = prompts_with_system(5, [5, 6])
    outs = llm.generate(prompts, [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, n=2)])
    assert all(isinstance(o, RequestOutput) for o in outs) and outs[0].sample_index == 0
    assert [len(o.outputs) for o in outs] == [1, 2]
    greedy = llm.generate(prompts[1], SamplingParams(max_tokens=4))[0].token_ids
    assert outs[1].outputs[0].token_ids == outs[1].outputs[1].token_ids == outs[1].token_ids == greedy


def test_aborting_a_request_aborts_all_its_samples():
    llm = LLM("random:llama-tiny", block_size=4, max_model_len=128, kv_cache_memory=24 * 1024)
    engine = llm.engine
    rid = engine.add_request(prompts_with_system(5, [5])[0], SamplingParams(max_tokens=8, n=3))
    engine.step()
    assert engine.num_unfinished() == 3
    assert engine.abort(rid)
    assert engine.num_unfinished() == 0
    assert engine.block_manager.allocator.num_free_blocks == engine.block_manager.num_blocks


# -- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_n_below_one_or_not_an_integer_is_rejected(n):
    with pytest.raises(ValueError, match=r"n must be an integer >= 1 \(samples per prompt\)"):
        SamplingParams(n=n)


@pytest.mark.parametrize("salt", [3, ["a"], 1.0])
def test_a_cache_salt_of_the_wrong_type_is_rejected(salt):
    with pytest.raises(TypeError, match="cache_salt must be None, a str or bytes, got"):
        SamplingParams(cache_salt=salt)


@pytest.mark.parametrize("kwargs, message", [
    (dict(allocator="contiguous"), "enable_prefix_caching with allocator 'contiguous' is not supported yet"),
    (dict(allocator="contiguous", prefix_cache="radix"),
     "enable_prefix_caching with allocator 'contiguous' is not supported yet"),
    (dict(prefix_cache="trie"), r"prefix_cache: .*'trie'"),
])
def test_prefix_caching_with_an_unsupported_feature_fails_before_the_model_loads(kwargs, message, monkeypatch):
    monkeypatch.setattr(kvlab.engine.build, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError, match=message):
        LLM("random:llama-tiny", enable_prefix_caching=True, **kwargs)


def test_unknown_prefix_eviction_policy_is_named(monkeypatch):
    monkeypatch.setattr(kvlab.engine.build, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(UnknownPluginError, match="unknown prefix-cache eviction policy 'mru'; registered "
                                                 "prefix-cache eviction policies: arc, lfu, lru, slru"):
        LLM("random:llama-tiny", enable_prefix_caching=True, prefix_eviction="mru")
    with pytest.raises(ValueError, match="enable_prefix_caching: expected bool"):
        LLM("random:llama-tiny", enable_prefix_caching="yes")

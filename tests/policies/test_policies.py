"""Eviction policies inside the engine: the conformance suite for every built-in, real memory freed,
and bad parameters refused before any work starts.

Fast cases on the tiny random Llama and Gemma 3 shapes; the real models (SmolLM2, Gemma 3) are heavy.
"""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.registry import POLICIES
from kvlab.testing import check_policy
from kvlab.testing.builtin_args import POLICY_ARGS

BUILTINS = POLICY_ARGS  # policy -> arguments that compress ~100-token prompts (rocketkv's sparse reading:
# tests/policies/test_sparse_read.py)


def test_every_registered_compressing_policy_is_covered():
    compressing = {n for n in POLICIES.names() if POLICIES.get(n).compresses}
    assert compressing == set(BUILTINS)


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_conforms_on_tiny_llama(name):
    check_policy(name, BUILTINS[name], "random:llama-tiny")


@pytest.mark.parametrize("name", ["snapkv", "streaming_llm"])
def test_builtin_conforms_on_tiny_gemma3_with_sliding_layers(name):
    check_policy(name, BUILTINS[name], "random:gemma3-tiny")


@pytest.mark.heavy
@pytest.mark.model
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_conforms_on_real_models(fresh_model, model, name):
    check_policy(name, BUILTINS[name], model, loaded=fresh_model(model), kv_cache_memory="64MiB", max_tokens=4)


def test_pages_held_during_decode_follow_the_budget():
    """A 1,500-token prompt at budget 128: while decoding, each layer holds its budget plus the tokens
    generated since, in whole pages (within one page of the budget per layer)."""
    llm = LLM("random:llama-135m", policy="snapkv", policy_args={"budget": 128, "window_size": 16},
              kv_cache_memory="96MiB", max_num_batched_tokens=512)
    full = LLM("random:llama-135m", kv_cache_memory="96MiB", max_num_batched_tokens=512)
    engine, bm = llm.engine, llm.engine.block_manager
    prompt = torch.randint(3, 49152, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    while engine.has_unfinished():
        engine.step()
        if seq.num_computed_tokens > len(prompt) and not seq.is_finished:
            extra = seq.num_computed_tokens - len(prompt)  # decoded tokens written since the compression
            for g in range(len(bm.groups)):
                pages = [b for b in bm.block_tables([seq], g)[0] if b >= 0]
                assert len(pages) <= -(-(128 + extra) // bm.block_size) <= 128 // bm.block_size + 1
            assert bm.num_used_blocks() <= 30 * (128 // bm.block_size + 1)
    full.generate([prompt], SamplingParams(max_tokens=1))
    assert full.stats()["kv_blocks_peak"] * 30 >= 1500 // 16  # the full cache holds every token (30 layers a page)


def test_policies_keep_the_positions_of_what_they_keep():
    """knorm at budget 40 on a 90-token prompt compacts every layer (each KV head its own tokens) once the
    prompt is in, after every 32-token chunk, or also every 2 decode steps. Kept tokens keep their positions
    and new ones take theirs: every greedy token is the argmax of Hugging Face's own forward over a cache
    that holds exactly the kept tokens (its cache gathered by the kept indices after each compression), fed
    in the engine's chunks with the true position ids."""
    import copy

    from transformers import DynamicCache

    from kvlab.models import load_model

    loaded = load_model("random:llama-tiny")
    for layer in loaded.model.model.layers:  # peaked attention: what is kept, and where, moves the logits
        layer.self_attn.q_proj.weight.data *= 6
        layer.self_attn.k_proj.weight.data *= 6
    p = torch.randint(3, 256, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    for when, compressions in (("prefill", 1), ("chunk", 3), ("decode", 1 + 7 // 2)):
        llm = LLM("random:llama-tiny", loaded=copy.deepcopy(loaded), policy="knorm",
                  policy_args={"budget": 40, "when": when, "every": 2}, max_num_batched_tokens=32,
                  max_prefill_chunk=32)
        steps = _record_steps_and_kept(llm)
        out = llm.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
        tokens, cache, cached, done = p + out, DynamicCache(), 0, 0
        for start, n, kept in steps:
            with torch.no_grad():
                logits = loaded.model(input_ids=torch.tensor([tokens[start:start + n]]), cache=cache,
                                      position_ids=torch.arange(start, start + n)[None],
                                      cache_position=torch.arange(cached, cached + n), use_cache=True).logits[0, -1]
            cached += n
            if start + n >= len(p):  # this step sampled output token start + n - len(p)
                token = out[start + n - len(p)]
                assert logits[token] >= logits.max() - 1e-5, (when, start + n - len(p))
            if kept is not None:
                cached = _gather_hf_cache(cache, kept)
                done += 1
        assert done == compressions and cached < len(tokens) - 1, (when, done, cached)


def _record_steps_and_kept(llm: LLM) -> list[list]:
    """Per engine step of one request: [tokens computed before it, tokens it computed, {layer: kept} of the
    compression that followed it, or None]."""
    engine, steps = llm.engine, []
    schedule, compress, policy = engine.scheduler.schedule, engine.compressor.compress, engine.compressor.policy

    def scheduling(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        steps.extend([s.num_computed_tokens, n, None] for s, n in zip(batch.seqs, batch.num_new_tokens))
        return batch

    def compressing(seq, *args, **kwargs):
        kept, select = {}, policy.select
        policy.select = lambda layer, *a, **k: kept.setdefault(layer, select(layer, *a, **k))
        try:
            return compress(seq, *args, **kwargs)
        finally:
            del policy.select
            steps[-1][2] = kept

    engine.scheduler.schedule, engine.compressor.compress = scheduling, compressing
    return steps


def _gather_hf_cache(cache, kept: dict) -> int:
    """Keep, in every layer of a Hugging Face cache, the cache indices the engine kept (a list per KV head,
    or one for all); returns the cached length."""
    for layer, keep in kept.items():
        if keep is None:
            continue
        entry = cache.layers[layer]
        heads = keep if isinstance(keep[0], list) else [keep] * entry.keys.shape[1]
        index = torch.tensor(heads)[None, :, :, None].expand(1, -1, -1, entry.keys.shape[-1])  # [1, Hkv, m, D]
        entry.keys, entry.values = entry.keys.gather(2, index), entry.values.gather(2, index)
    return cache.layers[0].keys.shape[2]


@pytest.mark.parametrize("name", ["snapkv", "knorm"])
def test_per_chunk_compression_applies_the_ratio_to_the_whole_prompt_so_far(name):
    """when="chunk" at ratio 0.75, 32-token chunks of a 90-token prompt: after each chunk a layer holds what
    kvpress keeps of a prompt of that length, int(n * 0.25) = 8, 16, 22 -- not 8, int(40 * 0.25) = 10, ...
    as compressing what the last chunk left would give."""
    args = {"compression_ratio": 0.75, "when": "chunk", **({"window_size": 8} if name == "snapkv" else {})}
    llm = LLM("random:llama-tiny", policy=name, policy_args=args, max_prefill_chunk=32)
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request(list(range(3, 93)), SamplingParams(max_tokens=2, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    held = []
    while seq.num_computed_tokens < 90:
        engine.step()
        held.append(bm.cached_lens([seq], 0)[0])
    assert held == [8, 16, 22]
    assert [bm.cached_lens([seq], g)[0] for g in range(len(bm.groups))] == [22] * len(bm.groups)


def test_the_budget_counts_the_tokens_seen_not_the_tokens_cached():
    from kvlab.policies.knorm import KNorm

    policy = KNorm(compression_ratio=0.5, per_head=False)  # one kept list per layer
    keys = torch.randn(40, 2, 8)  # 40 cached after an earlier compression of a longer sequence
    assert len(policy.select(0, 2, keys, keys, None, None)) == 20  # never told: the cached count
    policy.begin(64)
    assert len(policy.select(0, 2, keys, keys, None, None)) == 32  # int(64 * 0.5): the sequence so far
    policy.begin(100)
    assert policy.select(0, 2, keys, keys, None, None) is None  # 50 >= 40 cached: nothing to remove


def test_decode_time_compression_keeps_the_cache_bounded():
    llm = LLM("random:llama-tiny", policy="streaming_llm", policy_args={"budget": 24, "when": "decode", "every": 4},
              block_size=4)
    bm = llm.engine.block_manager
    llm.engine.add_request(list(range(3, 43)), SamplingParams(max_tokens=40, ignore_eos=True))
    seq = llm.engine.scheduler.waiting[0]
    most = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        if not seq.is_finished:
            most = max(most, max(bm.cached_lens([seq], g)[0] for g in range(len(bm.groups))))
    assert most <= 24 + 4  # compressed back to the budget every 4 decode steps


def test_scoring_under_a_policy_compresses_the_context_then_scores():
    ctx = torch.randint(3, 256, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    cont = torch.randint(3, 256, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    full = LLM("random:llama-tiny").score([ctx], [cont])[0].logprobs
    kept = LLM("random:llama-tiny", policy="knorm", policy_args={"budget": 16}).score([ctx], [cont])[0].logprobs
    covering = LLM("random:llama-tiny", policy="knorm", policy_args={"budget": 500}).score([ctx], [cont])[0].logprobs
    assert len(kept) == len(full) == 10 and kept != full
    torch.testing.assert_close(torch.tensor(covering), torch.tensor(full), atol=1e-5, rtol=0)


@pytest.mark.parametrize("args, message", [
    ({"budget": 0}, "budget must be an integer >= 1"),
    ({"budget": 2.5}, r"budget: expected int or null \(None\), got float 2.5"),
    ({"compression_ratio": 1.0}, r"compression_ratio must be in \[0, 1\)"),
    ({"compression_ratio": -0.1}, r"compression_ratio must be in \[0, 1\)"),
    ({"budget": 8, "compression_ratio": 0.5}, "not both"),
    ({"budget": 8, "when": "sometimes"}, "when must be one of prefill, chunk, decode"),
    ({"budget": 8, "every": 0}, "every must be an integer >= 1"),
])
def test_bad_policy_parameters_fail_before_the_model_loads(args, message):
    with pytest.raises(ValueError, match=message):
        LLM("does-not-exist", policy="knorm", policy_args=args)


def test_no_budget_and_no_ratio_is_refused_and_an_explicit_ratio_0_keeps_everything_as_kvpress_does():
    with pytest.raises(ValueError, match="policy 'snapkv' needs a budget .* or a compression_ratio"):
        LLM("random:llama-tiny", policy="snapkv")  # it would read as compressed and keep every token
    p = torch.randint(3, 256, (90,), generator=torch.Generator().manual_seed(6)).tolist()
    want = LLM("random:llama-tiny").generate([p], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    got = LLM("random:llama-tiny", policy="snapkv", policy_args={"compression_ratio": 0.0}).generate(
        [p], SamplingParams(max_tokens=6, ignore_eos=True))
    assert got[0].token_ids == want


def test_chunkkv_keeps_whole_chunks():
    from kvlab.policies.chunkkv import ChunkKV

    g = torch.Generator().manual_seed(0)
    keys, queries = torch.randn(97, 2, 16, generator=g), torch.randn(8, 4, 16, generator=g)
    kept = ChunkKV(budget=40, window_size=8, chunk_size=10).select(0, 2, keys, keys, queries, None)
    assert len(kept) == 40 and kept == sorted(set(kept))
    chunks = {}
    for i in kept:
        chunks.setdefault(i // 10, []).append(i)
    assert sum(len(c) < min(10, 97 - 10 * k) for k, c in chunks.items()) <= 1  # at most one partial chunk
    assert set(range(89, 97)) <= set(kept)  # the observation window's chunks come first


def test_accumulated_attention_equals_the_attention_every_query_paid():
    """H2O's statistics, accumulated over prefill chunks by the kernels' attention-stats output, equal the
    column sums of the causal attention of every prompt query (computed here from the queries themselves)."""
    from kvlab.policies.h2o import H2O
    from kvlab.policies.observation import window_attention

    seen = {}

    class Capture(H2O):
        @property
        def query_window(self):
            return 1000

        def score(self, layer_idx, keys, values, queries, attn_stats):
            seen[layer_idx] = (keys, queries, attn_stats)
            return super().score(layer_idx, keys, values, queries, attn_stats)

    llm = LLM("random:llama-tiny", policy="h2o", policy_args={"budget": 40}, max_num_batched_tokens=32)
    llm.engine.policy = llm.engine.compressor.policy = Capture(budget=40)
    p = torch.randint(3, 256, (80,), generator=torch.Generator().manual_seed(7)).tolist()
    llm.generate([p], SamplingParams(max_tokens=1))
    assert set(seen) == {0, 1}
    for keys, queries, stats in seen.values():
        assert keys.shape[0] == queries.shape[0] == stats.shape[0] == 80  # three chunks, all accumulated
        want = window_attention(queries, keys).sum(dim=(1, 2)).T  # [L, Hkv]
        torch.testing.assert_close(stats, want, atol=1e-4, rtol=1e-4)

"""Parallel samples (`SamplingParams(n > 1)`) under a compressing policy: every sample holds what the policy keeps.

The prompt is compressed once, when it ends; the other samples are forked from the compacted tables (sharing
their pages, copy-on-write) and start from the compressor's state (recorded queries, accumulated attention),
so sample i equals a separate n = 1 request with seed s + i (docs/design.md, "Prefix caching and parallel
sampling"). Fast cases on the tiny random Llama and Gemma 3 shapes; the issue's SmolLM2 case is `model`.
"""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.registry import POLICIES
from kvlab.testing.builtin_args import RATIO_ARGS

ARGS = {**RATIO_ARGS, "streaming_llm": {"compression_ratio": 0.75}}  # every compressing built-in -> arguments
# that compress 64-token prompts (and change the output)
DECODE = {  # compressed again while decoding: the samples' own compressions read the state they were forked with
    "snapkv-decode": ("snapkv", {"budget": 16, "window_size": 8, "when": "decode", "every": 3}),
    "h2o-decode": ("h2o", {"budget": 16, "recent": 4, "when": "decode", "every": 3}),
    "streaming_llm-decode": ("streaming_llm", {"budget": 16, "when": "decode", "every": 3}),
}
CONFIGS = {**{name: (name, args) for name, args in ARGS.items()}, **DECODE}
PROMPT = torch.randint(3, 256, (64,), generator=torch.Generator().manual_seed(0)).tolist()
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def samples(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [c.token_ids for c in llm.generate([PROMPT], params)[0].outputs]


def assert_idle(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.allocator.num_free_blocks == bm.num_blocks and llm.engine.compressor.num_tracked() == 0


@pytest.fixture(scope="module")
def full_text():
    return {model: samples(LLM(model, max_model_len=256), GREEDY)[0]
            for model in ("random:llama-tiny", "random:gemma3-tiny")}


def test_every_compressing_built_in_is_covered():
    assert {n for n in POLICIES.names() if POLICIES.get(n).compresses} == set(ARGS)


def run(llm: LLM, params: SamplingParams) -> tuple[list[list[int]], int]:
    """The samples' tokens (by request id) and the pages in use after the first step (the prompt's)."""
    engine = llm.engine
    engine.add_request(PROMPT, params)
    engine.step()
    used = engine.block_manager.num_used_blocks()
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in engine.step()})
    return [outs[i] for i in sorted(outs)], used


def check_greedy_samples(model: str, policy: str, args: dict, full: list[int]) -> None:
    """n = 3 greedy: each sample equals the n = 1 compressed output (which differs from the full cache's),
    the samples share the compacted prompt's pages, and each runs the compressions a separate request would."""
    llm = LLM(model, policy=policy, policy_args=args, max_model_len=256)
    (one,), used_one = run(llm, GREEDY)
    single = llm.stats()
    llm.reset_stats()
    many, used_many = run(llm, SamplingParams(max_tokens=10, ignore_eos=True, n=3))
    stats = llm.stats()
    assert one != full  # the policy changed the output: a sample with the full cache would be caught
    assert many == [one] * 3
    assert used_many == used_one  # forked from the compacted tables: nothing copied
    decode = single["policy_compressions"] - 1  # each sample's own compressions while decoding
    assert stats["policy_compressions"] == 1 + 3 * decode
    assert stats["policy_pages_freed"] >= 0 and stats["policy_bytes_freed"] >= 0
    if not decode:
        assert stats["policy_pages_freed"] == single["policy_pages_freed"]
        assert stats["policy_tokens_evicted"] == single["policy_tokens_evicted"] > 0
    assert_idle(llm)


# the issue's policies (and the decode-time variants) in the default suite; the other built-ins take the same
# path (a prompt compressed once, then forked), so they run with the heavy tests
ISSUE = {"snapkv", "h2o", "streaming_llm", "rocketkv", "adakv", *DECODE}


@pytest.mark.parametrize("config", [c if c in ISSUE else pytest.param(c, marks=pytest.mark.heavy)
                                    for c in sorted(CONFIGS)])
def test_every_greedy_sample_is_compressed_on_tiny_llama(config, full_text):
    check_greedy_samples("random:llama-tiny", *CONFIGS[config], full_text["random:llama-tiny"])


GEMMA = {  # one full-attention layer of six (the others slide over 8 tokens): compressed harder to show
    "snapkv": ("snapkv", {"compression_ratio": 0.9, "window_size": 4}),
    "h2o": ("h2o", {"compression_ratio": 0.9, "recent": 4}),
    "streaming_llm": CONFIGS["streaming_llm"],
    "adakv": ("adakv", {"compression_ratio": 0.9, "scorer_args": {"window_size": 4}}),
    "rocketkv": CONFIGS["rocketkv"],
}


@pytest.mark.parametrize("config", sorted(GEMMA))
def test_every_greedy_sample_is_compressed_on_tiny_gemma3(config, full_text):
    check_greedy_samples("random:gemma3-tiny", *GEMMA[config], full_text["random:gemma3-tiny"])


@pytest.mark.parametrize("config", ["snapkv-decode", "h2o-decode"])
def test_seeded_samples_equal_separate_requests_with_their_seeds(config):
    policy, args = CONFIGS[config]
    llm = LLM("random:llama-tiny", policy=policy, policy_args=args, max_model_len=256)
    sampled = dict(max_tokens=10, ignore_eos=True, temperature=1.0)
    got = samples(llm, SamplingParams(n=3, seed=7, **sampled))
    alone = [samples(llm, SamplingParams(seed=7 + i, **sampled))[0] for i in range(3)]
    assert got == alone and len({tuple(t) for t in alone}) == 3
    assert_idle(llm)


def test_a_fork_under_decode_time_compression_goes_on_as_the_parent_would():
    """engine.fork between decode steps: the child starts from the parent's recorded queries, so its later
    compressions keep what the parent's keep (greedy: the same tokens)."""
    policy, args = CONFIGS["snapkv-decode"]
    llm = LLM("random:llama-tiny", policy=policy, policy_args=args, max_model_len=256)
    engine = llm.engine
    parent = engine.add_request(PROMPT, GREEDY)
    for _ in range(3):
        engine.step()
    child = engine.fork(parent)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in engine.step()})
    assert outs[child] == outs[parent] == samples(llm, GREEDY)[0]
    assert_idle(llm)


@pytest.mark.model
def test_smollm2_parallel_samples_are_all_compressed(fresh_model):
    """The issue's case: SnapKV at ratio 0.9, n = 3 greedy: every sample is the n = 1 compressed text."""
    llm = LLM("smollm2-135m", loaded=fresh_model("smollm2-135m"), kv_cache_memory="64MiB", policy="snapkv",
              policy_args={"compression_ratio": 0.9, "window_size": 8})
    prompt = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
              "combined movable metal type, oil-based inks and a wooden press adapted from wine making. "
              "Within fifty years presses were running in more than two hundred European cities, and")
    params = SamplingParams(max_tokens=24)
    one = llm.generate([prompt], params)[0].text
    llm.reset_stats()
    many = [c.text for c in llm.generate([prompt], SamplingParams(max_tokens=24, n=3))[0].outputs]
    stats = llm.stats()
    assert many == [one] * 3
    assert stats["policy_compressions"] == 1 and stats["policy_pages_freed"] > 0
    full = LLM("smollm2-135m", loaded=fresh_model("smollm2-135m"), kv_cache_memory="64MiB")
    assert full.generate([prompt], params)[0].text != one  # a full-cache sample would have been caught

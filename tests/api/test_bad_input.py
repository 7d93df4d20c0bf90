"""Bad input fails early, names the problem, and leaves the engine as it was.

Uses the tiny random Llama (`random:llama-tiny`: 2 layers, 2 KV heads of 16,
vocab 256, context 512, no tokenizer, so prompts are token-id lists). One
block of 16 tokens costs 2 layers x 16 x 2 heads x 16 x 4 bytes x (K, V) = 8 KiB.
"""

from __future__ import annotations

import pytest

import kvlab.engine.build
from kvlab import LLM, SamplingParams
from kvlab.engine_config import EngineConfig, EngineOptionError
from kvlab.registry import ALLOCATORS, POLICIES, QUANT_FORMATS, UnknownPluginError

MODEL = "random:llama-tiny"
BLOCK_BYTES = 8192  # one 16-token block of llama-tiny, float32


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def llm():
    """64-token context, 16 blocks of 16 tokens."""
    return LLM(MODEL, max_model_len=64, block_size=16, kv_cache_memory=16 * BLOCK_BYTES)


def params(n: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def assert_idle(llm):
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.allocator.num_free_blocks == llm.engine.block_manager.num_blocks


# -- prompts ---------------------------------------------------------------------------
@pytest.mark.parametrize("length", [64, 100])
def test_prompt_longer_than_the_context(llm, length):
    with pytest.raises(ValueError, match=rf"prompt 0: prompt of {length} tokens does not fit the model's "
                                         r"context of 64 tokens \(it must leave room for at least one new token\)"):
        llm.generate([[5] * length], params())
    assert_idle(llm)


def test_max_tokens_past_the_context_is_clipped_not_an_error(llm):
    out = llm.generate([[5] * 60], SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and out[0].finish_reason == "length"


def test_max_model_len_past_the_models_context_is_refused():
    with pytest.raises(ValueError, match=r"max_model_len=10000 is longer than the model's context of 512 tokens "
                                         r"\(max_position_embeddings\): set max_model_len <= 512"):
        LLM(MODEL, max_model_len=10_000, kv_cache_memory=64 * BLOCK_BYTES)
    full = LLM(MODEL, max_model_len=512, kv_cache_memory=64 * BLOCK_BYTES)
    assert full.engine.max_model_len == 512
    with pytest.raises(ValueError, match="prompt 0: prompt of 512 tokens does not fit the model's context of 512"):
        full.generate([[5] * 512], params())


def test_max_tokens_below_one_is_rejected():
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)


def test_no_prompts(llm):
    with pytest.raises(ValueError, match="no prompts given"):
        llm.generate([], params())


@pytest.mark.parametrize("prompts, index", [([[]], 0), ([[1, 2], []], 1)])
def test_empty_prompt(llm, prompts, index):
    with pytest.raises(ValueError, match=rf"prompt {index}: empty prompt: a request needs at least one token"):
        llm.generate(prompts, params())
    assert_idle(llm)


@pytest.mark.parametrize("bad", [[1, 2, 256], [-1, 3]])
def test_token_ids_outside_the_vocabulary(llm, bad):
    with pytest.raises(ValueError, match=r"prompt 0: prompt has token ids outside the vocabulary \[0, 256\)"):
        llm.generate([bad], params())


def test_text_prompt_without_a_tokenizer(llm):
    with pytest.raises(ValueError, match="prompt 1: this model has no tokenizer .*pass token ids"):
        llm.generate([[1, 2], "hello"], params())
    assert_idle(llm)


def test_sampling_params_must_match_the_prompts(llm):
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate([[1, 2], [3, 4]], [params()])
    with pytest.raises(TypeError, match=r"prompt 1: sampling params must be SamplingParams, got a dict "
                                        r"\{'max_tokens': 3\}: build them with SamplingParams\(\*\*params\)"):
        llm.generate([[1, 2], [3, 4]], [params(), {"max_tokens": 3}])
    assert_idle(llm)


def test_a_bad_prompt_among_good_ones_is_named_and_nothing_runs(llm):
    with pytest.raises(ValueError, match=r"^prompt 2: prompt of 70 tokens does not fit"):
        llm.generate([[1, 2, 3], [4, 5], [6] * 70, [7, 8]], params())
    assert_idle(llm)
    assert len(llm.engine.scheduler.waiting) == 0 and len(llm.engine.scheduler.running) == 0
    out = llm.generate([[1, 2, 3], [4, 5]], params())  # the engine is still usable
    assert [len(o.token_ids) for o in out] == [3, 3]
    assert_idle(llm)


def test_engine_rejects_a_bad_request_and_keeps_the_good_ones(llm):
    engine = llm.engine
    good = [engine.add_request([1, 2, 3], params(4)), engine.add_request([9, 8, 7, 6], params(2))]
    with pytest.raises(ValueError, match="prompt of 65 tokens does not fit"):
        engine.add_request([3] * 65, params())
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([], params())
    with pytest.raises(TypeError, match="must be SamplingParams"):
        engine.add_request([1], {"max_tokens": 3})
    finished = {}
    for _ in range(20):
        for out in engine.step():
            finished[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert sorted(finished) == sorted(good)
    assert [len(finished[i].token_ids) for i in good] == [4, 2]
    assert_idle(llm)


# -- engine configuration -------------------------------------------------------------
@pytest.mark.parametrize("block_size", [3, 24, 1024, 0])
def test_block_size_not_allowed(block_size):
    with pytest.raises(ValueError, match=rf"^block_size: {block_size} is not allowed; choose one of "
                                         r"\(1, 2, 4, 8, 16, 32, 64, 128, 256\)"):
        LLM("does-not-exist", block_size=block_size)  # checked before the model is looked up


@pytest.mark.parametrize("memory, message", [
    (BLOCK_BYTES - 1, r"kv_cache_memory=8191 bytes is less than one block of 16 tokens \(8192 bytes across 2 layers\)"),
    ("4KiB", r"kv_cache_memory=4096 bytes is less than one block"),
])
def test_kv_budget_smaller_than_one_block(memory, message):
    with pytest.raises(ValueError, match=message):
        LLM(MODEL, block_size=16, kv_cache_memory=memory)


@pytest.mark.parametrize("memory, message", [
    (0, "^kv_cache_memory: must be positive, got 0"),
    ("lots", r"^kv_cache_memory: 'lots' is not a size"),
    ("12 parsecs", r"^kv_cache_memory: '12 parsecs' is not a size"),
    ("", r"^kv_cache_memory: '' is not a size"),
    (None, r"^kv_cache_memory: expected int or float or str, got NoneType None"),
    (True, r"^kv_cache_memory: expected int or float or str, got bool True"),
    ([256], r"^kv_cache_memory: expected int or float or str, got list \[256\]"),
])
def test_kv_budget_that_is_not_a_size(memory, message):
    with pytest.raises(ValueError, match=message):
        LLM("does-not-exist", kv_cache_memory=memory)


def test_budget_too_small_for_one_sequence_names_the_need_and_the_pool():
    small = LLM(MODEL, max_model_len=64, block_size=16, kv_cache_memory=2 * BLOCK_BYTES)
    with pytest.raises(ValueError, match=r"prompt 0: request needs 3 blocks of 16 tokens \(20 prompt \+ 20 new\), "
                                         r"but the KV pool has only 2; raise kv_cache_memory"):
        small.generate([[4] * 20], SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match=r"^request needs 3 blocks of 16 tokens \(20 prompt \+ 20 new\)"):
        small.engine.add_request([4] * 20, SamplingParams(max_tokens=20))
    assert not small.engine.has_unfinished()
    assert [len(o.token_ids) for o in small.generate([[4] * 20], params(12))] == [12]  # 32 tokens fit


def test_contiguous_reservation_counts_against_the_pool():
    small = LLM(MODEL, max_model_len=64, block_size=16, kv_cache_memory=2 * BLOCK_BYTES, allocator="contiguous",
                allocator_args={"reserve": "max_model_len"})
    with pytest.raises(ValueError, match=r"request needs 4 blocks of 16 tokens .* the KV pool has only 2"):
        small.generate([[4] * 5], SamplingParams(max_tokens=1))  # reserves max_model_len = 64 tokens
    assert not small.engine.has_unfinished()


def test_a_request_the_watermark_keeps_out_forever_is_rejected_up_front():
    """4 blocks with half kept back from admission: a 40-token prompt (3 blocks) can never be admitted,
    so it must be refused at validation like any request too big for the pool, not fail mid-generate."""
    llm = LLM(MODEL, max_model_len=64, block_size=16, kv_cache_memory=4 * BLOCK_BYTES,
              allocator_args={"watermark": 0.5})
    assert not llm.engine.block_manager.allocator.can_allocate(40, 44)  # even in an empty pool
    with pytest.raises(ValueError, match=r"prompt 1: .*KV pool"):
        llm.generate([[1, 2, 3], [5] * 40], params(4))
    assert not llm.engine.has_unfinished()


# -- plugin and model names --------------------------------------------------------------
def names(registry) -> str:
    return ", ".join(registry.names())


@pytest.mark.parametrize("kwargs, registry, kind", [
    (dict(allocator="nope"), ALLOCATORS, "allocator"),
    (dict(policy="nope"), POLICIES, "policy"),
    (dict(quant="nope"), QUANT_FORMATS, "quantisation format"),
])
def test_unknown_plugin_name_fails_before_the_model_loads(kwargs, registry, kind, monkeypatch):
    monkeypatch.setattr(kvlab.engine.build, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    expected = rf"unknown {kind} 'nope'; registered {kind[:-1]}\w*: " + names(registry).replace(".", r"\.")
    with pytest.raises(UnknownPluginError, match=expected):
        LLM(MODEL, **kwargs)
    with pytest.raises(UnknownPluginError, match=expected):
        LLM("does-not-exist", **kwargs)  # the plugin error, not the model error


def test_unknown_plugin_parameter_fails_before_the_model_loads():
    with pytest.raises(TypeError, match=r"allocator 'paged' has no parameter\(s\) watermrk; "
                                        r"its parameters are: watermark"):
        LLM("does-not-exist", allocator_args={"watermrk": 0.1})
    with pytest.raises(ValueError, match=r"paged\.watermark must be in \[0, 1\), got 2"):
        LLM("does-not-exist", allocator_args={"watermark": 2})


def test_unknown_model_lists_the_packaged_names():
    with pytest.raises(ValueError, match=r"unknown model 'does-not-exist': not a packaged model "
                                         r"\(smollm2-135m, gemma3-270m\).*random:<shape> "
                                         r"\(gemma3-tiny, kv-smollm2, llama-135m, llama-1b, llama-tiny\)"):
        LLM("does-not-exist")


def test_unknown_random_shape_lists_the_shapes():
    with pytest.raises(ValueError, match=r"unknown random model shape 'llama-huge'; known: "
                                         r"gemma3-tiny, kv-smollm2, llama-135m, llama-1b, llama-tiny"):
        LLM("random:llama-huge")


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_seqs=0), "^max_num_seqs: must be >= 1, got 0"),
    (dict(max_num_batched_tokens=0), "^max_num_batched_tokens: must be >= 1, got 0"),
    (dict(max_model_len=1), r"^max_model_len: must be >= 2 or None, got 1"),
    (dict(max_prefill_chunk=0), r"^max_prefill_chunk: must be >= 1 or None, got 0"),
    (dict(dtype="float8"), "^dtype: expected one of 'float32', 'bfloat16', 'float16', got str 'float8'"),
])
def test_other_engine_settings_are_checked_before_the_model(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM("does-not-exist", **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=True), "block_size: expected int, got bool True"),
    (dict(block_size=16.0), "block_size: expected int, got float 16.0"),
    (dict(block_size="16"), "block_size: expected int, got str '16'"),
    (dict(max_model_len=64.5), r"max_model_len: expected int or null \(None\), got float 64.5"),
    (dict(max_num_seqs=2.5), "max_num_seqs: expected int, got float 2.5"),
    (dict(max_num_batched_tokens="512"), "max_num_batched_tokens: expected int, got str '512'"),
    (dict(max_num_batched_tokens=512.0), "max_num_batched_tokens: expected int, got float 512.0"),
    (dict(max_prefill_chunk=64.0), r"max_prefill_chunk: expected int or null \(None\), got float 64.0"),
    (dict(seed="0"), "seed: expected int, got str '0'"),
    (dict(seed=1.5), "seed: expected int, got float 1.5"),
    (dict(kernel_backend="cuda"), "kernel_backend: expected one of 'auto', 'torch', 'triton', got str 'cuda'"),
    (dict(kernel_backend="reference"), "kernel_backend: expected one of 'auto', 'torch', 'triton'"),
    (dict(dtype="float64"), "dtype: expected one of 'float32', 'bfloat16', 'float16', got str 'float64'"),
    (dict(dtype=None), "dtype: expected one of"),
    (dict(policy_args=[("budget", 8)]), r"policy_args: expected a mapping, got list"),
    (dict(allocator_args="watermark=0.1"), "allocator_args: expected a mapping, got str 'watermark=0.1'"),
    (dict(quant_args=3), "quant_args: expected a mapping, got int 3"),
    (dict(draft_args=("a",)), "draft_args: expected a mapping, got tuple"),
    (dict(allocator=None), "allocator: expected str, got NoneType None"),
    (dict(device=0), "device: expected str, got int 0"),
])
def test_engine_option_of_the_wrong_type_is_named(kwargs, message):
    """EngineConfig checks every option's type itself; LLM checks them before it looks the model up."""
    with pytest.raises(EngineOptionError, match="^" + message) as err:
        EngineConfig(**kwargs)
    assert err.value.key == next(iter(kwargs)) and isinstance(err.value, ValueError)
    with pytest.raises(ValueError, match="^" + message):
        LLM("does-not-exist", **kwargs)


def test_engine_config_normalises_what_it_accepts():
    config = EngineConfig(kv_cache_memory="1.5 KiB", policy_args=None, max_model_len=None, kernel_backend="torch")
    assert config.kv_cache_memory == 1536 and config.policy_args == {} and config.draft is None
    assert EngineConfig(kv_cache_memory=2.5e6).kv_cache_memory == 2_500_000
    assert EngineConfig(kv_cache_memory="64mib").kv_cache_memory == 64 << 20


# -- speculative decoding ----------------------------------------------------------------
@pytest.mark.parametrize("draft, args, message", [
    ("ngram", {"num_tokens": 0}, r"draft ngram: num_tokens must be an integer >= 1, got 0"),
    ("model", {"num_tokens": -2}, r"draft model: num_tokens must be an integer >= 1, got -2"),
    ("ngram", {"num_tokens": 6, "adaptive": True, "max_num_tokens": 4},
     r"draft ngram: max_num_tokens \(4\) must be >= num_tokens \(6\) when adaptive"),
    ("ngram", {"min_ngram": 3, "max_ngram": 2}, r"draft ngram: max_ngram must be an integer >= min_ngram \(3\)"),
])
def test_bad_draft_parameters_fail_before_the_model(draft, args, message):
    with pytest.raises(ValueError, match=message):
        LLM("does-not-exist", draft=draft, draft_args=args)


def test_unknown_draft_and_parameter_are_named():
    with pytest.raises(UnknownPluginError, match=r"unknown draft model 'eagle'; registered draft models: .*ngram"):
        LLM("does-not-exist", draft="eagle")
    with pytest.raises(TypeError, match=r"draft model 'ngram' has no parameter\(s\) k; its parameters are: "):
        LLM("does-not-exist", draft="ngram", draft_args={"k": 4})


def test_a_self_speculating_draft_with_a_view_it_cannot_read_fails_before_the_model():
    with pytest.raises(ValueError, match=r"query-aware page selection"):
        LLM("does-not-exist", draft="self_compressed", draft_args={"policy": "quest", "policy_args": {"budget": 64}})
    with pytest.raises(ValueError, match=r"give policy_args.budget"):
        LLM("does-not-exist", draft="self_compressed", draft_args={"policy": "snapkv",
                                                                    "policy_args": {"compression_ratio": 0.5}})


def test_model_draft_needs_the_targets_vocabulary():
    from types import SimpleNamespace as NS

    from kvlab.speculation.drafts.model import check_same_vocabulary

    def loaded(vocab, tokenizer=None):
        return NS(model=NS(config=NS(vocab_size=vocab)), tokenizer=tokenizer)

    target = NS(vocab_size=256)
    with pytest.raises(ValueError, match=r"draft 'model': 'd' cannot draft for 't': its vocabulary has 512 tokens, "
                                         r"the target's 256\..*'slem' or 'tli'"):
        check_same_vocabulary("d", loaded(512), "t", target, None)
    tok = NS(get_vocab=lambda: {"a": 0, "b": 1})
    other = NS(get_vocab=lambda: {"a": 1, "b": 0})
    with pytest.raises(ValueError, match="its tokenizer maps tokens to ids differently.*'slem' or 'tli'"):
        check_same_vocabulary("d", loaded(256, other), "t", target, tok)
    check_same_vocabulary("d", loaded(256, tok), "t", target, tok)  # the same vocabulary: no error


@pytest.mark.model
@pytest.mark.heavy  # loads Gemma 3 as the draft (~60 s); the check itself is tested above on tiny models
def test_model_draft_with_another_tokenizer_fails_before_any_request(fresh_model):
    with pytest.raises(ValueError, match=r"draft 'model': 'gemma3-270m' cannot draft for 'smollm2-135m': its "
                                         r"vocabulary has \d+ tokens, the target's 49152.*'slem' or 'tli'"):
        LLM("smollm2-135m", loaded=fresh_model("smollm2-135m"), draft="model", draft_args={"model": "gemma3-270m"})

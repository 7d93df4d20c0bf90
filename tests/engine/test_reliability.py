"""Reliability: scoring that is always right, an engine that survives a failed step, atomic calls, seeds.

Fast cases run on the tiny random Llama (`random:llama-tiny`: 2 layers, 2 KV heads of 16, vocab 256,
no tokenizer; one 16-token block costs 8 KiB in float32). Scores are checked against Hugging Face's
own log-softmax over the same tokens (an independent source), and scoring under preemption
against scoring in a pool large enough never to preempt.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import kvlab.engine.llm_engine
from kvlab import LLM, SamplingParams
from kvlab.sampler import request_generator

MODEL = "random:llama-tiny"
BLOCK_BYTES = 8192


def assert_idle(llm):
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and not llm.engine.scheduler.running
    assert bm.allocator.num_free_blocks == bm.num_blocks


def random_ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def big():
    return LLM(MODEL, max_model_len=256, kv_cache_memory=64 * BLOCK_BYTES)


@pytest.fixture(scope="module")
def tight():
    """12 blocks of 16 tokens: requests are admitted while their context fits, then preempt each other
    as their continuations grow (the oldest running request is never the victim)."""
    return LLM(MODEL, max_model_len=256, kv_cache_memory=12 * BLOCK_BYTES, max_num_batched_tokens=256)


# -- score() -------------------------------------------------------------------------
@pytest.mark.parametrize("cont_len", [1, 2, 64])
@pytest.mark.parametrize("return_dists", [False, True])
def test_score_is_one_logprob_per_token_and_the_same_under_preemption(big, tight, cont_len, return_dists):
    contexts = [random_ids(30 + 3 * i, seed=i) for i in range(12)]
    conts = [random_ids(cont_len, seed=100 + i) for i in range(12)]
    ref = big.score(contexts, conts, return_dists=return_dists)
    got = tight.score(contexts, conts, return_dists=return_dists)
    if cont_len == 64:  # 94-127 tokens each in a 192-token pool: all but the first two are preempted
        assert sum(o.num_preemptions >= 1 for o in got) >= 10
    for r, g, cont in zip(ref, got, conts):
        assert len(r.logprobs) == len(g.logprobs) == len(cont)
        np.testing.assert_allclose(g.logprobs, r.logprobs, atol=1e-5, rtol=0)
        if return_dists:
            assert g.dists.shape == r.dists.shape == (len(cont), 256)
            torch.testing.assert_close(g.dists, r.dists, atol=1e-5, rtol=0)
            # the dists and the log-probs are the same numbers
            np.testing.assert_allclose(g.dists[torch.arange(len(cont)), cont].tolist(), g.logprobs, atol=1e-6)
        else:
            assert g.dists is None
    assert_idle(big)
    assert_idle(tight)


def test_score_matches_hugging_face_log_softmax(big):
    model = big.engine.model
    contexts = [random_ids(20, seed=1), random_ids(5, seed=2), random_ids(1, seed=3)]
    conts = [random_ids(1, seed=4), random_ids(7, seed=5), random_ids(3, seed=6)]
    got = big.score(contexts, conts)
    hf = _hf_logprobs(model, contexts, conts)
    for g, h in zip(got, hf):
        np.testing.assert_allclose(g.logprobs, h, atol=1e-4, rtol=0)


def test_scoring_reads_the_steps_logits_without_copying_them(big, monkeypatch):
    """A scoring sequence's rows are consecutive: their log-softmax reads a view of the step's logits (a copy of a
    rolling window's rows over Gemma 3's vocabulary is 537 MB), and the log-probs are unchanged."""
    contexts, conts = [random_ids(9, seed=7), random_ids(4, seed=8)], [random_ids(6, seed=9), random_ids(3, seed=10)]
    ref = _hf_logprobs(big.engine.model, contexts, conts)
    inputs, steps, log_softmax, run = [], [], torch.log_softmax, big.engine.runner.run
    monkeypatch.setattr(torch, "log_softmax", lambda x, *a, **k: inputs.append(x) or log_softmax(x, *a, **k))
    monkeypatch.setattr(big.engine.runner, "run", lambda *a, **k: steps.append(run(*a, **k)) or steps[-1])
    got = big.score(contexts, conts)
    storage = {out.logits.untyped_storage().data_ptr() for out in steps}
    assert inputs and all(x.untyped_storage().data_ptr() in storage for x in inputs)  # views, not copies
    for g, h in zip(got, ref):
        np.testing.assert_allclose(g.logprobs, h, atol=1e-4, rtol=0)


def _hf_logprobs(model, contexts, conts, attn="sdpa"):
    """Log p(cont[i] | ctx, cont[:i]) from Hugging Face's own forward (no kvlab attention)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(attn)
    try:
        out = []
        with torch.inference_mode():
            for ctx, cont in zip(contexts, conts):
                ids = torch.tensor([ctx + cont])
                logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [n, V]
                rows = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
                out.append(logp[rows, torch.tensor(cont)].tolist())
        return out
    finally:
        model.set_attn_implementation(previous)


@pytest.mark.model
# Gemma 3 (~50 s: its own load and a long prompt) in `make test-heavy`; its generation against HF beyond the
# sliding window stays in the default suite (tests/test_engine_equivalence.py)
@pytest.mark.parametrize("name", ["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.heavy)])
def test_score_matches_hugging_face_on_real_models(fresh_model, load_reference, name):
    llm = LLM(name, loaded=fresh_model(name), kv_cache_memory="64MiB")
    texts = [("The capital of France is", " Paris"),
             ("def add(a, b):\n    return", " a + b"),
             ("Once upon a time, there was a little", " girl who lived in a small house by the sea.")]
    tok = llm.tokenizer
    ctx = [tok(c)["input_ids"] for c, _ in texts]
    cont = [tok(x, add_special_tokens=False)["input_ids"] for _, x in texts]
    got = llm.score([c for c, _ in texts], [x for _, x in texts])
    hf = _hf_logprobs(load_reference(name).model, ctx, cont)
    assert [len(g.logprobs) for g in got] == [len(c) for c in cont]
    for g, h in zip(got, hf):
        np.testing.assert_allclose(g.logprobs, h, atol=1e-4, rtol=0)


def test_score_of_a_one_token_continuation_then_the_engine_still_works(big):
    out = big.score([[1, 2, 3]], [[5]])
    assert len(out[0].logprobs) == 1
    assert_idle(big)
    assert len(big.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_score_with_an_empty_context_starts_from_bos(big):
    bos = big.engine.bos_token_id
    assert bos is not None
    empty = big.score([[]], [[5, 6, 7]])[0].logprobs
    assert len(empty) == 3
    np.testing.assert_allclose(empty, big.score([[bos]], [[5, 6, 7]])[0].logprobs, atol=1e-6)


def test_score_with_an_empty_context_and_no_bos_is_an_error(big, monkeypatch):
    monkeypatch.setattr(big.engine, "bos_token_id", None)
    with pytest.raises(ValueError, match="request 0: the context is empty and the model has no BOS token"):
        big.score([[]], [[5, 6, 7]])
    assert_idle(big)


def test_score_rejects_an_empty_continuation_and_too_long_requests(big):
    with pytest.raises(ValueError, match="request 1: the continuation is empty"):
        big.score([[1], [2]], [[3], []])
    with pytest.raises(ValueError, match="request 0: context \\+ continuation of 300 tokens does not fit the "
                                         "model's context of 256 tokens"):
        big.score([[1] * 200], [[2] * 100])
    assert_idle(big)


# -- a failed step ---------------------------------------------------------------------
def test_a_failure_inside_a_step_aborts_the_call_and_leaves_the_engine_usable(big, monkeypatch):
    real = kvlab.engine.llm_engine.sample
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected sampler failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(kvlab.engine.llm_engine, "sample", flaky)
    prompts = [random_ids(10, seed=i) for i in range(4)]
    params = [SamplingParams(max_tokens=8, ignore_eos=True)] * 2 + [
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=s) for s in (5, 6)]
    with pytest.raises(RuntimeError, match="injected sampler failure"):
        big.generate(prompts, params)
    assert_idle(big)
    monkeypatch.setattr(kvlab.engine.llm_engine, "sample", real)
    again = big.generate(prompts, params)
    clean = LLM(MODEL, max_model_len=256, kv_cache_memory=64 * BLOCK_BYTES).generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in clean]  # nothing of the failed call stayed behind


def test_an_engine_level_failure_requeues_the_step_and_abort_frees_the_pages(big, monkeypatch):
    engine = big.engine
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    b = engine.add_request([4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    monkeypatch.setattr(engine.runner, "run", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    monkeypatch.undo()
    # nothing holds pages; both wait to be recomputed
    assert not engine.scheduler.running and len(engine.scheduler.waiting) == 2
    assert engine.abort(b) and not engine.abort(b) and not engine.abort(10_000)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == [a] and len(outs[0].token_ids) == 3
    assert_idle(big)


def test_tiny_temperatures_sample_the_argmax_instead_of_failing(big):
    greedy = big.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    tiny = big.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=1e-50, ignore_eos=True, seed=3))
    assert tiny[0].token_ids == greedy


# -- atomic generate -------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(seed="abc"), dict(seed=1.5), dict(seed=2**70), dict(temperature=float("nan")),
                                 dict(temperature=float("inf")), dict(temperature="1")])
def test_generate_is_all_or_nothing(big, bad):
    with pytest.raises(ValueError):
        params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, **bad)]
        big.generate([[1, 2], [3, 4]], params)
    assert_idle(big)
    with pytest.raises(ValueError, match="prompt 1: prompt has token ids outside the vocabulary"):
        big.generate([[1, 2], [3, 999]], SamplingParams(max_tokens=2))
    assert_idle(big)


def test_generate_refuses_to_swallow_requests_queued_through_the_engine(big):
    rid = big.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="1 unfinished request\\(s\\) queued through llm.engine.add_request"):
        big.generate([[4, 5]], SamplingParams(max_tokens=2))
    outs = []
    while big.engine.has_unfinished():
        outs += big.engine.step()
    assert [o.request_id for o in outs] == [rid]  # its output was not lost
    assert_idle(big)


# -- seeds -----------------------------------------------------------------------------
def test_no_user_seed_reproduces_an_engine_assigned_stream():
    def first(g):
        return torch.rand(4, generator=g).tolist()

    engine = {tuple(first(request_generator(0, rid, None))) for rid in range(500)}
    user = {tuple(first(request_generator(0, 0, seed))) for seed in range(500)}
    assert len(engine) == 500 and len(user) == 500 and not engine & user
    # a user seed is the same stream whatever the engine seed and request id
    assert first(request_generator(0, 1, 7)) == first(request_generator(5, 99, 7))


def test_an_unseeded_request_and_a_seeded_one_sample_differently(big):
    params = [SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True, seed=1)]
    a, b = big.generate([[1, 2, 3], [1, 2, 3]], params)
    assert a.token_ids != b.token_ids
    c = big.generate([[1, 2, 3]], params[1])[0]
    assert c.token_ids == b.token_ids  # the same seed, the same sample


# -- input checks ----------------------------------------------------------------------
@pytest.mark.parametrize("bad, message", [
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature="0.5"), "temperature must be a finite number"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(top_k="5"), "top_k must be an integer"),
    (dict(ignore_eos="no"), "ignore_eos must be True or False"),
    (dict(max_tokens=True), "max_tokens must be an integer"),
    (dict(stop_token_ids="12"), "stop_token_ids must be a sequence of token ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids must be integers"),
    (dict(top_p="0.5"), "top_p must be in"),
])
def test_sampling_params_reject_bad_values(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_prompts_as_tuples_tensors_and_arrays_are_token_ids(big):
    ref = big.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].token_ids
    outs = big.generate([(1, 2, 3), torch.tensor([1, 2, 3]), np.array([1, 2, 3])], SamplingParams(max_tokens=3))
    assert [o.token_ids for o in outs] == [ref] * 3
    assert big.generate(torch.tensor([1, 2, 3]), SamplingParams(max_tokens=3))[0].token_ids == ref
    assert [o.token_ids for o in big.generate(torch.tensor([[1, 2, 3], [1, 2, 3]]), SamplingParams(max_tokens=3))] \
        == [ref] * 2


@pytest.mark.parametrize("bad", [[1.0, 2.0], [[1.5, 2]], torch.tensor([1.0, 2.0]), np.array([0.5])])
def test_float_token_ids_are_rejected_not_truncated(big, bad):
    with pytest.raises(ValueError, match="prompt 0: token ids must be integers"):
        big.generate(bad, SamplingParams(max_tokens=2))
    assert_idle(big)


@pytest.mark.parametrize("bad, message", [("now", "arrival_time must be a number"),
                                          (float("nan"), "arrival_time must be a number"),
                                          (time.time(), "the engine's clock is time.perf_counter\\(\\)")],
                         ids=["a string", "nan", "a time.time reading"])  # a stable id: xdist workers collect alike
def test_arrival_time_must_be_a_perf_counter_reading(big, bad, message):
    with pytest.raises(ValueError, match=message):
        big.engine.add_request([1, 2], SamplingParams(max_tokens=2), arrival_time=bad)
    assert_idle(big)


def test_max_model_len_above_the_model_is_refused():
    """A run labelled with a 10,000-token context must not silently use the model's 512."""
    with pytest.raises(ValueError, match="max_model_len=10000 is longer than the model's context of 512"):
        LLM(MODEL, max_model_len=10_000, kv_cache_memory=64 * BLOCK_BYTES)


# -- metrics ---------------------------------------------------------------------------
def test_tokens_per_s_counts_engine_time_not_pauses_between_calls():
    llm = LLM(MODEL, max_model_len=128, kv_cache_memory=32 * BLOCK_BYTES)
    llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=16, ignore_eos=True))
    first = llm.stats()["tokens_per_s"]
    time.sleep(1.0)
    llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=16, ignore_eos=True))
    s = llm.stats()
    assert s["generated_tokens"] == 128
    assert s["tokens_per_s"] == pytest.approx(128 / s["busy_s"])
    assert s["elapsed_s"] > s["busy_s"] + 0.9  # the pause is wall time, not engine time
    assert s["tokens_per_s"] > 0.3 * first  # a 1 s pause would have cut a wall-clock rate far more


# -- the engine under random mixes, pool sizes and failures --------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_engines: dict[int, LLM] = {}


def _engine(blocks: int) -> LLM:
    if blocks not in _engines:
        _engines[blocks] = LLM(MODEL, max_model_len=128, kv_cache_memory=blocks * BLOCK_BYTES,
                               max_num_batched_tokens=64)
    return _engines[blocks]


_request = st.one_of(
    st.tuples(st.just("generate"), st.integers(1, 40), st.integers(1, 24), st.sampled_from([0.0, 0.7, 1.5])),
    st.tuples(st.just("score"), st.integers(0, 40), st.integers(1, 40), st.just(0.0)),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.sampled_from([8, 12, 32]), calls=st.lists(st.tuples(st.lists(_request, min_size=1, max_size=6),
                                                                     st.integers(0, 6)), min_size=1, max_size=3),
       seed=st.integers(0, 1000))
def test_random_mixes_with_failures_leave_the_engine_consistent(blocks, calls, seed):
    """Failures are injected into the sampling stage of a step (run for scoring steps too);
    fail_at 0 means no failure in that call."""
    llm = _engine(blocks)
    real = kvlab.engine.llm_engine.LLMEngine._sample
    for requests, fail_at in calls:
        count = {"n": 0}

        def flaky(self, out):
            count["n"] += 1
            if count["n"] == fail_at:
                raise RuntimeError("injected")
            return real(self, out)

        kvlab.engine.llm_engine.LLMEngine._sample = flaky
        try:
            gens = [r for r in requests if r[0] == "generate"]
            scores = [r for r in requests if r[0] == "score"]
            try:
                if gens:
                    prompts = [random_ids(n, seed + i) for i, (_, n, _, _) in enumerate(gens)]
                    params = [SamplingParams(max_tokens=m, temperature=t, ignore_eos=True, seed=seed + i if t else None)
                              for i, (_, _, m, t) in enumerate(gens)]
                    outs = llm.generate(prompts, params)
                    assert [o.prompt_token_ids for o in outs] == prompts
                    assert [len(o.token_ids) for o in outs] == [min(m, 128 - n) for _, n, m, _ in gens]
                if scores:
                    ctx = [random_ids(n, seed + 50 + i) for i, (_, n, _, _) in enumerate(scores)]
                    cont = [random_ids(m, seed + 90 + i) for i, (_, _, m, _) in enumerate(scores)]
                    outs = llm.score(ctx, cont)
                    assert [len(o.logprobs) for o in outs] == [len(c) for c in cont]
                    assert all(np.isfinite(o.logprobs).all() and max(o.logprobs) <= 0 for o in outs)
            except RuntimeError as exc:
                assert str(exc) == "injected"
        finally:
            kvlab.engine.llm_engine.LLMEngine._sample = real
        assert_idle(llm)

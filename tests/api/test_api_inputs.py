"""The user-facing API refuses what it cannot run, in words that say what is wrong, and returns one
shape: one RequestOutput per prompt whose `outputs` are its completions (vLLM's shape).

Tiny random Llama (`random:llama-tiny`: vocab 256, context 512, no tokenizer).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

import kvlab.engine.build
from kvlab import LLM, SamplingParams
from kvlab.engine_config import EngineConfig, EngineOptionError
from kvlab.outputs import CompletionOutput, RequestOutput

MODEL = "random:llama-tiny"


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, kv_cache_memory="1MiB", block_size=4)


@pytest.fixture
def no_model_load(monkeypatch):
    """The option must fail before the (slow) model load."""
    monkeypatch.setattr(kvlab.engine.build, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def idle(llm) -> bool:
    bm = llm.engine.block_manager
    return not llm.engine.has_unfinished() and bm.allocator.num_free_blocks == bm.num_blocks


# -- item 6: the engine seed ----------------------------------------------------------------------
@pytest.mark.parametrize("seed", [-1, 2**63, 2**70])
def test_an_engine_seed_outside_0_to_2_63_is_refused_before_the_model_loads(seed, no_model_load):
    with pytest.raises(EngineOptionError, match=rf"^seed: must be an integer in \[0, 2\*\*63\), got {seed}$"):
        LLM(MODEL, seed=seed)


def test_the_largest_engine_seed_samples():
    llm = LLM(MODEL, seed=2**63 - 1, kv_cache_memory="1MiB")
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


# -- item 7: device and kernel backend ----------------------------------------------------------
def test_triton_on_a_cpu_device_needs_the_interpreter(monkeypatch, no_model_load):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(EngineOptionError, match=r"^kernel_backend: 'triton' on device 'cpu' runs only under "
                                                r"Triton's interpreter \(set TRITON_INTERPRET=1"):
        LLM(MODEL, kernel_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel tests' CPU mode stays allowed
    assert EngineConfig(kernel_backend="triton").kernel_backend == "triton"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error_before_the_model_loads(no_model_load):
    with pytest.raises(EngineOptionError, match=r"^device: 'cuda': CUDA is not available here \(.*\); "
                                                r"use device='cpu'"):
        LLM(MODEL, device="cuda")


def test_a_device_torch_does_not_know_is_named(no_model_load):
    with pytest.raises(EngineOptionError, match=r"^device: 'gpu0' is not a torch device"):
        LLM(MODEL, device="gpu0")


# -- item 8: frozen params, and a sampler failure that names its request --------------------------
def test_sampling_params_cannot_be_changed_after_they_were_checked():
    sp = SamplingParams(max_tokens=4)
    for name, value in (("max_tokens", -3), ("temperature", float("nan")), ("stop", ["x"])):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(sp, name, value)
    assert sp.max_tokens == 4 and sp.temperature == 0.0
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got -3"):
        dataclasses.replace(sp, max_tokens=-3)  # a changed copy is checked again
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        dataclasses.replace(sp, temperature=float("nan"))
    assert dataclasses.replace(sp, max_tokens=8).max_tokens == 8


def test_a_sampling_failure_names_the_request_and_the_others_still_finish(monkeypatch):
    llm = LLM(MODEL, kv_cache_memory="1MiB", block_size=4)
    engine = llm.engine
    sick = engine.add_request([3, 4, 5], SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True))
    well = engine.add_request([6, 7, 8], SamplingParams(max_tokens=4, temperature=1.0, seed=2, ignore_eos=True))
    run = engine.runner.run

    def nan_logits(batch, *args, **kwargs):  # the model returns NaN for one request (e.g. an fp16 overflow)
        out = run(batch, *args, **kwargs)
        out.logits = out.logits.clone()  # [R, V]
        for seq, row in out.sample_rows:
            if seq.seq_id == sick:
                out.logits[row] = math.nan
        return out

    monkeypatch.setattr(engine.runner, "run", nan_logits)
    with pytest.raises(RuntimeError, match=rf"^request {sick}: sampling failed \(.*\); the step was undone .*"
                                           rf"abort it \(engine.abort\({sick}\)\)"):
        engine.step()
    assert engine.abort(sick)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert [o.request_id for o in done] == [well] and len(done[0].token_ids) == 4
    assert idle(llm)


# -- item 9: messages that say what was passed ------------------------------------------------------
def test_a_policy_parameter_of_the_wrong_type_is_named(no_model_load):
    with pytest.raises(ValueError, match=r"^compression_ratio: expected float or null \(None\), got str '0.5'$"):
        LLM(MODEL, policy="snapkv", policy_args={"compression_ratio": "0.5"})
    with pytest.raises(ValueError, match=r"^window_size: expected int, got float 8.0$"):  # a subclass's own field
        LLM(MODEL, policy="snapkv", policy_args={"budget": 8, "window_size": 8.0})


@pytest.mark.parametrize("params", [{"max_tokens": 3}, [{"max_tokens": 3}]])
def test_a_dict_of_sampling_params_says_so(llm, params):
    with pytest.raises(TypeError, match=r"sampling params must be SamplingParams, got a dict \{'max_tokens': 3\}: "
                                        r"build them with SamplingParams\(\*\*params\)"):
        llm.generate([[3]], params)
    with pytest.raises(TypeError, match=r"got a dict \{\}: build them"):
        llm.engine.add_request([3], {})  # an empty dict is not "no params"
    assert idle(llm)


@pytest.mark.parametrize("prompts", [None, 3, b"abc"])
def test_prompts_that_are_not_prompts_are_named(llm, prompts):
    with pytest.raises(TypeError, match=rf"^prompts must be a string, token ids, or a list of them, got "
                                        rf"{type(prompts).__name__}$"):
        llm.generate(prompts)
    with pytest.raises(TypeError, match="^prompts must be"):
        llm.score(prompts, [[1]])


# -- item 12: settings that would publish a number that means nothing ---------------------------
def test_a_compressing_policy_without_budget_or_ratio_is_refused(no_model_load):
    with pytest.raises(EngineOptionError, match=r"^policy_args: policy 'snapkv' needs a budget \(tokens kept per "
                                                r"layer, e.g. budget: 256\) or a compression_ratio"):
        LLM(MODEL, policy="snapkv", policy_args={"window_size": 8})
    assert EngineConfig(policy="snapkv", policy_args={"compression_ratio": 0.0}).policy == "snapkv"  # explicit 0


def test_full_with_a_budget_or_ratio_warns_that_it_keeps_every_token():
    with pytest.warns(UserWarning, match=r"policy 'full' keeps every token: compression_ratio=0.5 is ignored"):
        EngineConfig(policy="full", policy_args={"compression_ratio": 0.5})
    with pytest.warns(UserWarning, match=r"budget=64 is ignored"):
        EngineConfig(policy="full", policy_args={"budget": 64})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ratio 0 (the leaderboard's reference run) is what full does
        EngineConfig(policy="full", policy_args={"compression_ratio": 0})


def test_a_stop_token_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match=r"^prompt 0: stop_token_ids has 1000000000, outside the vocabulary "
                                         r"\[0, 256\): it can never be generated"):
        llm.generate([[3, 4]], SamplingParams(stop_token_ids=[7, 10**9]))
    assert idle(llm)


# -- item 17: one RequestOutput per prompt ------------------------------------------------------------
def test_generate_returns_one_request_output_per_prompt_whatever_n(llm):
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    params = [SamplingParams(max_tokens=4, ignore_eos=True),
              SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=3, n=2, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    assert [type(o) for o in outs] == [RequestOutput] * 3
    assert [len(o.outputs) for o in outs] == [1, 3, 2]
    assert all(type(c) is CompletionOutput for o in outs for c in o.outputs)
    assert [[c.index for c in o.outputs] for o in outs] == [[0], [0, 1, 2], [0, 1]]
    assert [o.prompt_token_ids for o in outs] == prompts
    for out in outs:  # today's attributes read the first completion
        first = out.outputs[0]
        assert (out.text, out.token_ids, out.finish_reason, out.stop_reason, out.sample_index) == \
            (first.text, first.token_ids, first.finish_reason, first.stop_reason, 0)
    assert outs[2].outputs[0].token_ids == outs[2].outputs[1].token_ids  # greedy samples agree
    alone = [llm.generate(prompts[1], SamplingParams(max_tokens=4, temperature=1.0, seed=5 + i,
                                                     ignore_eos=True))[0] for i in range(3)]
    assert [c.token_ids for c in outs[1].outputs] == [o.token_ids for o in alone]  # sample i: seed 5 + i
    assert idle(llm)


def test_engine_step_still_returns_one_output_per_finished_sample(llm):
    engine = llm.engine
    rid = engine.add_request([3, 4, 5], SamplingParams(max_tokens=2, n=2, ignore_eos=True))
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert sorted(o.sample_index for o in done) == [0, 1] and {o.group_id for o in done} == {rid}
    assert all(len(o.outputs) == 1 for o in done)

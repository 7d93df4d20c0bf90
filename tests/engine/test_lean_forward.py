"""The lean Llama forward (kvlab/engine/lean_forward.py): transformers' ops without its module stack.

Every step's logits (prefill chunks and decode steps, a mixed batch) are the same to the bit as transformers'
forward, in fp32 and bf16, with either weight layout and either linear backend; models it does not take
(Gemma 3) and models someone hooks run transformers' forward."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.kernels.cpu import linear as cpu_linear

pytestmark = pytest.mark.usefixtures("one_thread")


def step_logits(fresh_model, name, dtype, lean: bool, **engine) -> tuple[list[list[int]], list[torch.Tensor]]:
    llm = LLM(name, loaded=fresh_model(name), dtype=dtype, block_size=16, kv_cache_memory="4MiB",
              max_num_batched_tokens=48, **engine)
    runner = llm.engine.runner
    assert runner.lean is not None
    if not lean:
        runner.lean = None
    logits, run = [], runner.run
    runner.run = lambda *a, **k: (lambda out: logits.append(out.logits.clone()) or out)(run(*a, **k))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 17, 1, 33)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    return [o.token_ids for o in outs], logits


BACKENDS = ["torch"] + (["cpu"] if cpu_linear.available() else [])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["none", "auto"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_step_s_logits_are_transformers_to_the_bit(fresh_model, dtype, layout, backend):
    engine = dict(linear_layout=layout, linear_backend=backend)
    want_tokens, want = step_logits(fresh_model, "random:llama-tiny", dtype, False, **engine)
    got_tokens, got = step_logits(fresh_model, "random:llama-tiny", dtype, True, **engine)
    assert got_tokens == want_tokens and len(got) == len(want) > 6
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_models_it_does_not_take_and_hooked_models_run_transformers(fresh_model, monkeypatch):
    gemma = LLM("random:gemma3-tiny", loaded=fresh_model("random:gemma3-tiny"), kv_cache_memory="4MiB")
    assert gemma.engine.runner.lean is None
    llm = LLM("random:llama-tiny", loaded=fresh_model("random:llama-tiny"), kv_cache_memory="4MiB")
    calls = []
    handle = llm.engine.model.model.norm.register_forward_hook(lambda *_: calls.append(1))
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        handle.remove()
    assert len(calls) == 3  # the hook saw every step: transformers' forward ran


@pytest.mark.skipif(not cpu_linear.available(), reason="no C++ compiler or no AVX-512: no kernel")
def test_a_later_layout_or_backend_is_followed(fresh_model, monkeypatch):
    """The engine built on `none` / torch, then the model rewired (as experiments/bench_decode_roof.py does):
    the lean forward runs the fused products on the kernel."""
    from kvlab.engine import linear_backend as lb

    llm = LLM("random:llama-tiny", loaded=fresh_model("random:llama-tiny"), kv_cache_memory="4MiB",
              linear_backend="torch")
    seen, kernel = [], cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda x, *a, **k: seen.append(x.shape[-1]) or kernel(x, *a, **k))
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert not seen
    lb.apply_linear(llm.engine.model, "auto", "cpu")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert llm.engine.model.config.intermediate_size in seen  # the layers' down_proj ran the kernel (not only lm_head)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_norms_and_rope_run_the_layer_kernels(fresh_model, monkeypatch, dtype):
    """Every norm (the residual add fused into all but the first) and every RoPE of a step is one call of
    kernels/cpu/layer_ops.cpp, so the bitwise test above covers the kernels' bits in the engine."""
    from kvlab.kernels.cpu import layer_ops

    if not layer_ops.available():
        pytest.skip("no layer kernels here (no compiler / AVX-512): the lean forward runs torch's ops")
    llm = LLM("random:llama-tiny", loaded=fresh_model("random:llama-tiny"), dtype=dtype, kv_cache_memory="4MiB")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))  # the kernels' probes (agrees) run
    calls = []
    for name in ("_norm", "_rope"):
        real = getattr(layer_ops, name)
        monkeypatch.setattr(layer_ops, name, lambda *a, _real=real, _name=name: calls.append((_name, a[1] is None))
                            or _real(*a))
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    layers, forwards = llm.engine.model.config.num_hidden_layers, 2  # the prefill and one decode step
    ropes = layers if llm.engine.config.linear_layout == "auto" else 2 * layers  # q and k as one tensor, or apart
    want = {("_norm", True): 1, ("_norm", False): 2 * layers, ("_rope", False): ropes}  # per forward
    assert Counter(calls) == {k: forwards * n for k, n in want.items()}

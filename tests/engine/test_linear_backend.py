"""The linear backend (EngineConfig.linear_backend, kvlab/engine/linear_backend.py).

`cpu` changes who multiplies decode-sized passes, never what the engine generates: the greedy tokens on
both tiny model shapes, fp32 and bf16, with either weight layout, equal the torch backend's, and the kernel
is seen to run. Under the batch-invariant mode it takes every pass, and every logit keeps its bits under
any schedule. Without the library the engine runs torch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from kvlab import LLM, SamplingParams
from kvlab.engine import linear_backend as lb
from kvlab.engine.linear_layout import layout_of
from kvlab.engine_config import EngineOptionError, linear_backend_problem
from kvlab.kernels.cpu import build
from kvlab.kernels.cpu import linear as cpu_linear
from logit_records import SCHEDULES, run, same_bits
from hf_equivalence import random_prompts

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cpu_linear.available(), reason="no C++ compiler or no AVX-512: no kernel")]


def count_kernel_rows(monkeypatch) -> list[int]:
    """Rows of every pass the kernel computes (appended as they run)."""
    seen, kernel = [], cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda x, *a, **k: seen.append(x.numel() // x.shape[-1]) or kernel(x, *a, **k))
    return seen


def generate(fresh_model, name, dtype, **engine) -> list[list[int]]:
    prompts = random_prompts(256, [5, 17, 1, 33, 8, 40])
    llm = LLM(name, loaded=fresh_model(name), dtype=dtype, block_size=16, kv_cache_memory="4MiB",
              max_num_batched_tokens=48, **engine)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))]


@pytest.mark.parametrize("name", ["random:llama-tiny", "random:gemma3-tiny"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["none", "auto"])
def test_the_engine_generates_what_the_torch_backend_does(fresh_model, monkeypatch, name, dtype, layout):
    want = generate(fresh_model, name, dtype, linear_layout=layout, linear_backend="torch")
    rows = count_kernel_rows(monkeypatch)
    got = generate(fresh_model, name, dtype, linear_layout=layout, linear_backend="cpu")
    assert got == want
    assert rows and max(rows) == 48 <= lb.MAX_ROWS  # decode passes and the 48-row prefill chunks ran the kernel


def test_the_model_is_restored_and_reused_models_follow_each_engine(fresh_model):
    loaded = fresh_model("random:llama-tiny")
    linears = {n: m for n, m in loaded.model.named_modules() if type(m) is torch.nn.Linear}
    LLM("random:llama-tiny", loaded=loaded, kv_cache_memory="4MiB", linear_backend="cpu", linear_layout="auto")
    assert lb.backend_of(loaded.model) == "cpu" and layout_of(loaded.model) == "auto"
    names = set(loaded.model.state_dict())
    LLM("random:llama-tiny", loaded=loaded, kv_cache_memory="4MiB", linear_backend="torch")
    assert lb.backend_of(loaded.model) == "torch" and layout_of(loaded.model) == "none"
    assert set(loaded.model.state_dict()) == names  # the wrapper kept the parameters' names
    assert not any(isinstance(m, lb.SmallBatchLinear) for m in loaded.model.modules())
    assert {n: m for n, m in loaded.model.named_modules() if type(m) is torch.nn.Linear} == linears  # the originals


def test_a_wrapped_layer_matches_f_linear_below_and_above_max_rows():
    layer = torch.nn.Linear(576, 192).requires_grad_(False)
    product = lb.SmallBatchProduct(layer.weight, max_rows=4)
    wrapped = lb.SmallBatchLinear(layer, product)
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 576)
        torch.testing.assert_close(wrapped(x), F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
    x = torch.randn(40, 576)
    assert torch.equal(wrapped(x), F.linear(x, layer.weight, layer.bias))  # above max_rows: torch itself


@pytest.mark.parametrize("quant", ["int4"])
def test_batch_invariance_holds_on_the_kernel(quant, monkeypatch):
    import kvlab.engine.build as engine_build

    monkeypatch.setattr(engine_build, "MAX_ROWS", 32)  # a bound below this test's prefill chunks (192 rows)
    rows = count_kernel_rows(monkeypatch)
    tokens, base = run({}, quant=quant, batch_invariant=True, linear_backend="cpu")
    assert rows and max(rows) > engine_build.MAX_ROWS  # prefill ran on the kernel too (no row bound in this mode)
    for name in SCHEDULES:  # solo, chunked, the ngram and layerskip drafts
        other_tokens, other = run(copy.deepcopy(SCHEDULES[name]), quant=quant, batch_invariant=True,
                                  linear_backend="cpu")
        common, differ = same_bits(base, other)
        assert common >= 30 and differ == 0 and other_tokens == tokens, (quant, name)


def test_without_the_library_the_engine_runs_torch(fresh_model, monkeypatch):
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setattr(cpu_linear, "_kernel", cpu_linear._kernel.__wrapped__)
    build.load_linear_library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
            llm = LLM("random:llama-tiny", loaded=fresh_model("random:llama-tiny"), kv_cache_memory="4MiB",
                      linear_backend="cpu")
        assert lb.backend_of(llm.engine.model) == "torch"
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
    finally:
        build.load_linear_library.cache_clear()


def test_the_option_is_validated():
    assert linear_backend_problem("cpu", "cpu") is None and linear_backend_problem("torch", "cuda") is None
    assert "use linear_backend='torch'" in linear_backend_problem("cpu", "cuda:0")
    with pytest.raises(EngineOptionError, match="linear_backend"):
        LLM("random:llama-tiny", kv_cache_memory="4MiB", linear_backend="mkl")
    with pytest.raises(ValueError, match="choose 'auto', 'torch' or 'cpu'"):
        lb.apply_linear_backend(torch.nn.Sequential(), "mkl")
    assert linear_backend_problem("auto", "cuda:0") is None


def test_auto_is_the_kernel_on_the_cpu_and_torch_elsewhere(fresh_model):
    """`auto` runs the kernel for a CPU model (where it builds) and leaves a model elsewhere (here a meta-device
    stand-in for an accelerator's) on torch."""
    llm = LLM("random:llama-tiny", loaded=fresh_model("random:llama-tiny"), kv_cache_memory="4MiB",
              linear_backend="auto")
    assert lb.backend_of(llm.engine.model) == ("cpu" if cpu_linear.available() else "torch")
    elsewhere = torch.nn.Sequential(torch.nn.Linear(64, 64, device="meta"))
    assert lb.resolve(elsewhere, "auto") == "torch" and lb.apply_linear_backend(elsewhere, "auto") == 0
    assert type(elsewhere[0]) is torch.nn.Linear


@pytest.mark.model
def test_smollm2_generates_what_the_torch_backend_does(fresh_model, load_reference):
    from hf_equivalence import PROMPTS

    tok = load_reference("smollm2-135m").tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:4]]
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM("smollm2-135m", loaded=fresh_model("smollm2-135m"), kv_cache_memory="64MiB",
                  linear_backend=backend, linear_layout="auto")
        outs[backend] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    assert outs["cpu"] == outs["torch"]

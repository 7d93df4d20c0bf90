"""The small-batch CPU linear kernel (kernels/cpu/linear.cpp) against its reference F.linear.

Every SmolLM2 shape at batch 1-32, fp32 and bf16 (weights alone or with the activations), with and without
a bias: within rounding of F.linear in float64. Batch invariance is bitwise: a row's result does not depend
on how many rows share the call or where it sits. Without a compiler the launcher runs F.linear."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from kvlab.kernels.cpu import build
from kvlab.kernels.cpu import linear as cpu

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cpu.available(), reason="no C++ compiler or no AVX-512: the kernel cannot build")]
SHAPES = [(576, 576), (192, 576), (1536, 576), (3072, 576), (576, 1536), (4096, 576), (7, 13), (5, 40),
          pytest.param(49152, 576, marks=pytest.mark.heavy)]  # lm_head: 4096 x 576 runs its code path in the default suite
BATCHES = [1, 2, 3, 4, 5, 16, 31, 32]
DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
          "fp32 x, bf16 W": (torch.float32, torch.bfloat16)}


def data(n, k, b, x_dtype, w_dtype, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(w_dtype)
    x = torch.randn(b, k, generator=g).to(x_dtype)
    return x, w, (torch.randn(n, generator=g).to(w_dtype) if bias else None)


def tolerance(dtype):  # bf16 output: half an ulp of the rounding, plus fp32 accumulation over K
    return dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=8e-3)


@pytest.mark.parametrize("kind", list(DTYPES))
@pytest.mark.parametrize("n,k", SHAPES)
def test_the_kernel_matches_f_linear(kind, n, k):
    x_dtype, w_dtype = DTYPES[kind]
    x_all, w, bias_all = data(n, k, max(BATCHES), x_dtype, w_dtype, bias=True)
    packed = cpu.pack(w)  # once per weight, as the engine does
    for b in (BATCHES if n * k < 10**7 else [1, 5, 32]):  # the lm_head: three batches
        x, bias = x_all[:b], (bias_all if b % 2 else None)
        got = cpu.linear(x, w, bias, packed)
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.dtype == x_dtype and got.shape == (b, n)
        torch.testing.assert_close(got.double(), want, **tolerance(x_dtype), msg=lambda m: f"{kind} {n}x{k} b={b}: {m}")


def test_a_packed_weight_of_another_matrix_is_refused():
    x, w, _ = data(64, 32, 3, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="packed weight is"):
        cpu.linear(x, w, None, cpu.pack(w[:32]))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu.pack(w.half())


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
@pytest.mark.parametrize("n,k", [(576, 576), (3072, 576), (576, 1536), (7, 13)])
def test_a_row_is_the_same_bits_in_a_batch_of_1_or_16(kind, n, k):
    x_dtype, w_dtype = DTYPES[kind]
    x, w, bias = data(n, k, 16, x_dtype, w_dtype, bias=True)
    alone = torch.cat([cpu.linear(x[i:i + 1], w, bias) for i in range(16)])
    assert torch.equal(cpu.linear(x, w, bias), alone)
    for rows in (2, 3, 5, 9):  # every batch tile and remainder shape, the row at every position
        assert torch.equal(cpu.linear(x[16 - rows:], w, bias), alone[16 - rows:]), rows
    padded = torch.cat([x, torch.randn(7, k).to(x_dtype)])
    assert torch.equal(cpu.linear(padded, w, bias)[:16], alone)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp32 x, bf16 W"])
def test_a_row_is_the_same_bits_in_a_pass_of_1_33_80_or_130_rows(kind):
    """Past 32 rows (a verification pass: batch x (k + 1) rows; a short prefill chunk): every row tile of the
    kernel sums in the same order, so a row's bits do not depend on the pass's row count or its place in it."""
    x_dtype, w_dtype = DTYPES[kind]
    x, w, bias = data(1536, 576, 130, x_dtype, w_dtype, bias=True, seed=1)
    packed = cpu.pack(w)
    full = cpu.linear(x, w, bias, packed)  # [130, N]
    for i in (0, 31, 32, 79, 129):
        assert torch.equal(cpu.linear(x[i : i + 1], w, bias, packed), full[i : i + 1]), i
    for lo, hi in ((0, 33), (40, 73), (0, 80), (50, 130)):
        assert torch.equal(cpu.linear(x[lo:hi], w, bias, packed), full[lo:hi]), (lo, hi)
    torch.testing.assert_close(full.double(), F.linear(x.double(), w.double(), bias.double()), **tolerance(x_dtype))


def test_the_result_does_not_depend_on_the_thread_count():
    x, w, _ = data(3072, 576, 16, torch.float32, torch.float32)
    threads = torch.get_num_threads()
    try:
        one = cpu.linear(x, w)
        torch.set_num_threads(2)
        assert torch.equal(cpu.linear(x, w), one)
    finally:
        torch.set_num_threads(threads)


def test_leading_dimensions_strides_and_out():
    x, w, bias = data(192, 576, 6, torch.float32, torch.float32, bias=True)
    x3 = x.view(2, 3, 576)
    torch.testing.assert_close(cpu.linear(x3, w, bias), F.linear(x3, w, bias), **tolerance(torch.float32))
    wide = torch.randn(6, 1000)
    wide[:, 100:676] = x
    torch.testing.assert_close(cpu.linear(wide[:, 100:676], w, bias), F.linear(x, w, bias), **tolerance(torch.float32))
    out = torch.empty(6, 192)
    assert cpu.linear(x, w, bias, out=out) is out
    with pytest.raises(ValueError, match="out must be"):
        cpu.linear(x, w, bias, out=torch.empty(6, 191))


def test_inputs_it_does_not_take_run_f_linear():
    x, w, _ = data(64, 32, 3, torch.float32, torch.float32)
    for args in ((x.half(), w.half()), (x, w.t().contiguous().t()), (x.double(), w.double())):
        torch.testing.assert_close(cpu.linear(*args), F.linear(*args))
    assert not cpu.supports(x.requires_grad_(), w, None)


def test_no_compiler_falls_back_to_f_linear_with_one_warning(monkeypatch):
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setattr(cpu, "_kernel", cpu._kernel.__wrapped__)
    build.load_linear_library.cache_clear()
    try:
        x, w, _ = data(64, 32, 3, torch.float32, torch.float32)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert build.load_linear_library() is None
            assert not cpu.available()
            got = cpu.linear(x, w)
        assert len([m for m in seen if "no C++ compiler" in str(m.message)]) == 1
        assert torch.equal(got, F.linear(x, w))
    finally:
        build.load_linear_library.cache_clear()


def test_kvlab_cpu_kernels_0_runs_f_linear(monkeypatch):
    monkeypatch.setenv("KVLAB_CPU_KERNELS", "0")
    x, w, _ = data(64, 32, 3, torch.float32, torch.float32)
    assert not cpu.available() and torch.equal(cpu.linear(x, w), F.linear(x, w))

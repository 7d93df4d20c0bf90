"""The lean forward's element-wise CPU kernels (kernels/cpu/layer_ops.cpp) against their torch references.

RMSNorm (alone and after the residual add) and RoPE must give transformers' bits exactly, for fp32 and bf16,
one row and many, widths on and off torch's 8-lane vectors and its summation cascade, values of every
magnitude, strided inputs; the launcher falls back to the reference for what the kernel does not take."""

from __future__ import annotations

import pytest
import torch

from kvlab.kernels.cpu import layer_ops as ops

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not ops.available(), reason="no C++ compiler, no AVX-512 or torch dispatching "
                                 "other than AVX-512: the lean forward runs torch's ops")]
DTYPES = [torch.float32, torch.bfloat16]
WIDTHS = [8, 9, 31, 64, 100, 576, 1000, 2048, 2050, 8192]  # 2048+: rows of 4 vectors past the cascade's 16


def rows(t, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.empty(t, 1).uniform_(-6, 6, generator=g)  # every magnitude (sums of squares too)
    return (torch.randn(t, n, generator=g) * scale).to(dtype), torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", WIDTHS)
def test_rms_norm_is_transformers_to_the_bit(dtype, n):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(n, eps=1e-5).to(dtype)
    for t, seed in ((1, 0), (3, 1), (17, 2), (40, 3)):
        x, w = rows(t, n, dtype, seed)
        module.weight.data.copy_(w)
        with torch.no_grad():
            want = module(x)
        assert torch.equal(ops._norm(x, None, module.weight, 1e-5)[1], want), (t, seed)  # the kernel itself
        wide = torch.zeros(t, n + 5, dtype=dtype)
        wide[:, 3:3 + n] = x  # a strided row view
        assert torch.equal(ops._norm(wide[:, 3:3 + n], None, module.weight, 1e-5)[1], want)
        assert torch.equal(ops.rms_norm(x, module.weight, 1e-5), want)
    assert ops.agrees(dtype, n, 1, 8)  # the launcher's probe trusts it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [8, 576, 2048])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, n):
    for t in (1, 5):
        x, w = rows(t, n, dtype, t)
        residual = rows(t, n, dtype, t + 10)[0]
        h, y = ops._norm(x, residual, w, 1e-6)  # the kernel itself
        want_h, want_y = ops.add_rms_norm_ref(x, residual, w, 1e-6)
        assert torch.equal(h, x + residual) and torch.equal(h, want_h) and torch.equal(y, want_y)
        assert all(torch.equal(a, b) for a, b in zip(ops.add_rms_norm(x, residual, w, 1e-6), (want_h, want_y)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,heads,d", [(1, 12, 64), (5, 3, 64), (2, 4, 128), (3, 1, 8)])
def test_rope_is_transformers_to_the_bit(dtype, t, heads, d):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(t * heads)
    fused = torch.randn(t, heads + 3, d, generator=g).to(dtype)  # q and k heads inside a wider product
    x = fused[:, :heads]  # [T, H, D], strided in T
    cos, sin = torch.randn(t, 1, d, generator=g).to(dtype), torch.randn(t, 1, d, generator=g).to(dtype)
    signed = torch.cat((-sin[..., : d // 2], sin[..., d // 2:]), dim=-1)  # rotate_half's signs on sin
    got = ops._rope(x, cos, signed)  # the kernel itself
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1), x.transpose(0, 1), cos[:, 0], sin[:, 0], unsqueeze_dim=0)
    assert got.is_contiguous() and torch.equal(got, want.transpose(0, 1))
    assert torch.equal(got, ops.rope_ref(x, cos, signed)) and torch.equal(ops.rope(x, cos, signed), got)
    assert ops.agrees(dtype, 8, heads, d)


def test_what_the_kernel_does_not_take_runs_the_reference(monkeypatch):
    x, w = rows(2, 6, torch.float32, 0)  # narrower than torch's vectors: torch sums otherwise
    assert torch.equal(ops.rms_norm(x, w, 1e-5), ops.rms_norm_ref(x, w, 1e-5))
    h, w16 = rows(2, 64, torch.float16, 0)
    assert torch.equal(ops.rms_norm(h, w16, 1e-5), ops.rms_norm_ref(h, w16, 1e-5))
    calls = []
    monkeypatch.setattr(ops, "_norm", lambda *a: calls.append(1))
    x, w = rows(2, 64, torch.float32, 0)
    ops.rms_norm(x.requires_grad_(), w, 1e-5)  # autograd: torch's ops
    monkeypatch.setenv("KVLAB_CPU_KERNELS", "0")
    assert torch.equal(ops.rms_norm(x.detach(), w, 1e-5), ops.rms_norm_ref(x.detach(), w, 1e-5))
    assert not calls and not ops.available()


def test_a_kernel_that_disagrees_with_torch_is_not_trusted(monkeypatch):
    """The probe at first use: a kernel whose bits differ (here, one ulp on the norm) is refused for the shape."""
    norm = ops._norm

    def off_by_an_ulp(x, residual, weight, eps):
        h, y = norm(x, residual, weight, eps)
        return h, torch.nextafter(y, torch.full_like(y, float("inf")))

    monkeypatch.setattr(ops, "_norm", off_by_an_ulp)
    ops.agrees.cache_clear()
    try:
        assert not ops.agrees(torch.float32, 576, 1, 8)
        x, w = rows(1, 576, torch.float32, 0)
        assert torch.equal(ops.rms_norm(x, w, 1e-5), ops.rms_norm_ref(x, w, 1e-5))
    finally:
        ops.agrees.cache_clear()

"""Launcher: a Llama layer's element-wise ops on the CPU (layer_ops.cpp), beside their torch references.

    y = rms_norm(x, weight, eps)               # x [T, n] -> [T, n]: transformers' LlamaRMSNorm, one call
    h, y = add_rms_norm(x, residual, weight, eps)  # h = x + residual, y = rms_norm(h)
    y = rope(x, cos, sin)                      # x [T, H, D] (any strides in T, H) -> [T, H, D] contiguous

RMSNorm (arXiv:1910.07467) and rotary position embedding (RoFormer, arXiv:2104.09864) as transformers computes
them in torch, 4-8 ops each; the kernel computes the same values with the same roundings (its header says
how, including torch's CPU summation order for the norm's mean), so its results are torch's to the bit
(tests/kernels/test_cpu_layer_ops.py). `rms_norm_ref`, `add_rms_norm_ref`, `rope_ref` are those torch ops.

The kernel runs only where it was checked against them: 2-D / 3-D CPU float32 or bfloat16 tensors with torch
dispatching its AVX-512 kernels (the sum's order is torch's 16-lane order: `torch.backends.cpu.
get_cpu_capability()`), and only after a probe at first use found it equal to the reference to the bit
(`agrees()`); anything else, KVLAB_CPU_KERNELS=0 or autograd runs the reference.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kvlab.kernels.cpu.build import enabled, load_layer_ops_library

KINDS = {torch.float32: 0, torch.bfloat16: 1}


# -- references: transformers' ops ---------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward: x [..., n] -> [..., n]."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return h, rms_norm_ref(h, weight, eps)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos / sin [T, 1, D] (sin = cat(-s1, s2)): (x * cos) + (roll(x, D / 2) * sin), which is
    transformers' (x * cos) + (rotate_half(x) * sin') to the bit for sin' = cat(s1, s2): rotate_half(x) =
    cat(-x2, x1) gives cat(-x2 * s1, x1 * s2), the rolled x cat(x2 * -s1, x1 * s2): the same products (a
    product's sign is its factors' xor)."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * sin)


# -- the kernel --------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _kernels():
    lib = load_layer_ops_library()
    if lib is None:
        return None
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    norm, rot = lib.kvlab_rms_norm, lib.kvlab_rope
    norm.argtypes = [p, i64, p, i64, p, i64, p, p, i64, i32, i32, i32, ctypes.c_float]
    rot.argtypes = [p, i64, i64, p, p, p, i32, i32, i32, i32]
    norm.restype = rot.restype = ctypes.c_int
    return norm, rot


def available() -> bool:
    return enabled() and torch.backends.cpu.get_cpu_capability() == "AVX512" and _kernels() is not None


@lru_cache(maxsize=None)
def agrees(dtype: torch.dtype, n: int, heads: int, head_dim: int) -> bool:
    """Whether the kernel gives the references' bits on a probe (random rows of every magnitude, one row and
    several) for this dtype, norm width n and rope shape: run once per shape before the kernel is trusted."""
    if not available() or dtype not in KINDS:
        return False
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-4, 4, 7)[:, None]
    x = (torch.randn(7, n, generator=g) * scale).to(dtype)  # [7, n]
    r, w = torch.randn(7, n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    q = torch.randn(3, heads, head_dim, generator=g).to(dtype)
    cos, sin = (torch.randn(3, 1, head_dim, generator=g).to(dtype) for _ in range(2))
    with torch.no_grad():
        for rows in (x[:1], x):
            if not torch.equal(_norm(rows, None, w, 1e-5)[1], rms_norm_ref(rows, w, 1e-5)):
                return False
            if not all(torch.equal(a, b) for a, b in zip(_norm(rows, r[: len(rows)], w, 1e-6),
                                                          add_rms_norm_ref(rows, r[: len(rows)], w, 1e-6))):
                return False
        return torch.equal(_rope(q, cos, sin), rope_ref(q, cos, sin))


def _norm_takes(x, weight, residual) -> bool:
    tensors = [x, weight] + ([] if residual is None else [residual])
    return (enabled() and x.dim() == 2 and all(t.device.type == "cpu" and t.dtype == x.dtype for t in tensors)
            and x.dtype in KINDS and x.shape[1] >= 8 and x.stride(-1) == 1 and weight.shape == (x.shape[1],) and weight.is_contiguous()
            and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1))
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and agrees(x.dtype, x.shape[1], 1, 2))  # n >= 8: torch's vectorised sum (layer_ops.cpp)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, n] -> rms_norm_ref(x, weight, eps), in one call where the kernel takes it."""
    if not _norm_takes(x, weight, None):
        return rms_norm_ref(x, weight, eps)
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm of it), x / residual [T, n], in one call where the kernel takes them."""
    if not _norm_takes(x, weight, residual):
        return add_rms_norm_ref(x, residual, weight, eps)
    return _norm(x, residual, weight, eps)


def _norm(x, residual, weight, eps) -> tuple[torch.Tensor | None, torch.Tensor]:
    t, n = x.shape
    y = torch.empty((t, n), dtype=x.dtype)
    h = None if residual is None else torch.empty((t, n), dtype=x.dtype)
    status = _kernels()[0](x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                           0 if residual is None else residual.stride(0), None if h is None else h.data_ptr(),
                           n, weight.data_ptr(), y.data_ptr(), n, KINDS[x.dtype], t, n, eps)
    if status:
        raise RuntimeError(f"kvlab_rms_norm failed with status {status}")
    return h, y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (strided in T and H), cos / sin [T, 1, D] -> rope_ref(x, cos, sin) as a contiguous tensor."""
    takes = (enabled() and x.dim() == 3 and x.dtype in KINDS and x.stride(-1) == 1
             and all(c.device.type == "cpu" and c.dtype == x.dtype and c.shape == (x.shape[0], 1, x.shape[2])
                     and c.is_contiguous() for c in (x, cos, sin)[1:]) and x.device.type == "cpu"
             and not (torch.is_grad_enabled() and any(c.requires_grad for c in (x, cos, sin)))
             and agrees(x.dtype, 8, x.shape[1], x.shape[2]))
    return _rope(x, cos, sin) if takes else rope_ref(x, cos, sin)


def _rope(x, cos, sin) -> torch.Tensor:
    t, h, d = x.shape
    y = torch.empty((t, h, d), dtype=x.dtype)
    status = _kernels()[1](x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), y.data_ptr(),
                           KINDS[x.dtype], t, h, d)
    if status:
        raise RuntimeError(f"kvlab_rope failed with status {status}")
    return y

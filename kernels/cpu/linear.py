"""Launcher: the small-batch linear layer on the CPU (linear.cpp), beside its torch reference F.linear.

    packed = pack(weight)              # weight [N, K] fp32 / bf16 -> PackedWeight (64-row blocks, k-major)
    y = linear(x, weight, bias, packed)  # x [..., K] -> [..., N] in x's dtype; packed=None packs on the fly

The kernel reads the packed weight as one stream per block of 64 output rows and meets each weight vector
once for every row of x (decode at small batch is a weight-streaming problem), and sums every output element
in one order fixed by K alone: a row's result is the same to the bit in a batch of 1 or 32 (batch-invariant
by construction). fp32 x takes an fp32 or a bf16 weight (widened exactly); bf16 x a bf16 weight (VDPBF16PS
over pairs, fp32 accumulation). It is not bit-identical to F.linear, whose BLAS kernel sums in another order.

Falls back to F.linear (the reference) when the library is unavailable (no compiler, no AVX-512: one
warning at build time), with KVLAB_CPU_KERNELS=0, or for inputs the kernel does not take (other dtypes or
devices, bf16 x over an fp32 weight, autograd).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F

from kvlab.kernels.cpu.build import enabled, load_linear_library

KINDS = {torch.float32: 0, torch.bfloat16: 1}
BLOCK = 64  # output rows per packed block (OB in linear.cpp)


@dataclass(frozen=True)
class PackedWeight:
    """A weight [N, K] in the kernel's layout: fp32 [N / 64, K, 64]; bf16 [N / 64, ceil(K / 2), 64, 2]."""

    data: torch.Tensor
    out_features: int  # N
    in_features: int  # K
    verdicts: dict = field(default_factory=dict, compare=False, repr=False)  # _takes' cache (the tensors' checks)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def pack(weight: torch.Tensor) -> PackedWeight:
    """weight [N, K] -> PackedWeight (N padded to a multiple of 64, a bf16 K to an even count, with zeros)."""
    n, k = weight.shape
    w = weight.detach()
    pad_n = (-n) % BLOCK
    if weight.dtype == torch.float32:
        w = F.pad(w, (0, 0, 0, pad_n))  # [N', K]
        data = w.view(-1, BLOCK, k).transpose(1, 2).contiguous()  # [N'/64, K, 64]
    elif weight.dtype == torch.bfloat16:
        w = F.pad(w, (0, k % 2, 0, pad_n))  # [N', K']
        data = w.view(-1, BLOCK, w.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()  # [N'/64, K'/2, 64, 2]
    else:
        raise ValueError(f"pack: the kernel reads float32 or bfloat16 weights, got {weight.dtype}")
    return PackedWeight(data, n, k)


@lru_cache(maxsize=None)
def _kernel():
    lib = load_linear_library()
    if lib is None:
        return None
    fn = lib.kvlab_linear
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [p, i64, i32, p, i32, p, i32, p, i64, i32, i32, i32, i32, i32]
    fn.restype = ctypes.c_int
    return fn, bool(lib.kvlab_linear_has_bf16_dot())


def available() -> bool:
    return enabled() and _kernel() is not None


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel takes these tensors (else `linear` runs F.linear)."""
    tensors = [x, weight] + ([] if bias is None else [bias])
    kernel = _kernel()
    return (kernel is not None and all(t.device.type == "cpu" and t.dtype in KINDS for t in tensors)
            and weight.dim() == 2 and x.shape[-1] == weight.shape[1]
            and (x.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and kernel[1]))
            and (bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous()))
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T + bias -> [..., N] in x's dtype. `packed`: pack(weight), made once
    (None packs now: for tests); out: a contiguous [..., N] tensor of x's dtype to write into."""
    if not enabled() or not _takes(x, weight, bias, packed):
        return F.linear(x, weight, bias)
    packed = pack(weight) if packed is None else packed
    n, k = weight.shape
    if (packed.out_features, packed.in_features, packed.dtype) != (n, k, weight.dtype):
        raise ValueError(f"packed weight is {packed.dtype} [{packed.out_features}, {packed.in_features}], "
                         f"the weight {weight.dtype} [{n}, {k}]")
    rows = x if x.dim() == 2 else x.reshape(-1, k)  # [M, K] (a decode step's x is 2-D: no reshape, ~3 us)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = torch.empty((rows.shape[0], n) if x.dim() == 2 else (*x.shape[:-1], n), dtype=x.dtype)
    elif out.shape != (*x.shape[:-1], n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {(*x.shape[:-1], n)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    status = _kernel()[0](
        rows.data_ptr(), rows.stride(0), KINDS[x.dtype], packed.data.data_ptr(), KINDS[packed.dtype],
        None if bias is None else bias.data_ptr(), 0 if bias is None else KINDS[bias.dtype],
        out.data_ptr(), n, KINDS[out.dtype], rows.shape[0], n, k, torch.get_num_threads())
    if status:
        raise RuntimeError(f"kvlab_linear failed with status {status}")
    return out


def _takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None) -> bool:
    """supports(x, weight, bias), with the verdict on a packed weight's own tensors kept on `packed` (a decode
    step calls this ~120 times: only what can change between calls, x and autograd, is checked each time)."""
    if packed is None or packed.data.device.type != "cpu":
        return supports(x, weight, bias)
    key = (x.dtype, x.device.type, x.shape[-1], id(weight), id(bias))
    verdict = packed.verdicts.get(key)
    if verdict is None:
        with torch.no_grad():  # the tensors' own checks; autograd is checked on every call below
            verdict = packed.verdicts[key] = supports(x, weight, bias)
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    return verdict and not grad

"""Input validation shared by the Triton launchers: shapes, strides, dtypes, constants.

Every check raises ValueError with a message naming the argument and what was
expected, before anything is launched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CAST_STORAGE = (torch.float16, torch.bfloat16, torch.float32)
FP8_STORAGE = (torch.float8_e4m3fn, torch.float8_e5m2)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256

CODEC_CAST = 0
CODEC_SCALED = 1
CODEC_PACKED = 2  # a packed page store (kvlab.cache.quant.page_store), read by load_packed


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# storage dtype -> (mantissa bits, smallest exponent of the rounding grid) for encode's rounding step
_GRID = {
    torch.float32: (23, -126),
    torch.float16: (10, -14),
    torch.bfloat16: (7, -119),  # below 2^-119 a coarser grid (ulp must stay a normal float32)
    torch.float8_e4m3fn: (3, -6),
    torch.float8_e5m2: (2, -14),
}


@dataclass(frozen=True)
class Codec:
    """Constants a kernel needs to write / read one pool tensor (see triton_kernels/codec.py)."""

    id: int  # CODEC_CAST or CODEC_SCALED
    store_max: float  # clamp bound for scaled stores
    mant_bits: int
    min_exp: int


def codec_for(cache: torch.Tensor, scale: torch.Tensor | None, name: str) -> Codec:
    """The codec of a pool tensor and its optional per-head scale.

    A new format adds its storage dtype here and a branch in triton_kernels/codec.py.
    """
    if cache.dtype not in _GRID:
        supported = ", ".join(str(d) for d in CAST_STORAGE + FP8_STORAGE)
        raise ValueError(f"{name} has storage dtype {cache.dtype}; supported: {supported}")
    if cache.dtype in FP8_STORAGE and scale is None:
        raise ValueError(f"{name} is {cache.dtype}: a per-KV-head float32 scale must be passed with it")
    mant, min_exp = _GRID[cache.dtype]
    codec = CODEC_CAST if scale is None else CODEC_SCALED
    return Codec(codec, float(torch.finfo(cache.dtype).max), mant, min_exp)


def check_device(t: torch.Tensor, device: torch.device, name: str) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (same device as the cache)")


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, packed_ok: bool = False) -> tuple[int, int, int, int]:
    """-> (num_blocks, block_size, Hkv, D) after checking the pool layout. With `packed_ok`, either side
    may be a packed format's kvlab.cache.quant.page_store.PageStore (the attention kernels read those)."""
    if isinstance(k_cache, torch.Tensor) != isinstance(v_cache, torch.Tensor):
        raise ValueError("k_cache and v_cache must both be pool tensors or both packed page stores")
    if not isinstance(k_cache, torch.Tensor):
        if not packed_ok:
            raise ValueError(
                f"k_cache is a packed cache format's pages ({type(k_cache).__name__}: int8 / int4 / int2); this "
                f"Triton kernel reads element-wise pools only (packed pages are written and copied by the cache "
                f"itself, kvlab.cache.kv_cache.KVCache)"
            )
        return check_packed_pair(k_cache, v_cache)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(c.shape)}")
        if c.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), got strides {c.stride()}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same shape")
    check_device(v_cache, k_cache.device, "v_cache")
    num_blocks, block_size, hkv, d = k_cache.shape
    if not is_pow2(block_size):
        raise ValueError(f"block_size (k_cache.shape[1]) must be a power of two, got {block_size}")
    if not 16 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [16, {MAX_HEAD_DIM}], got {d}")
    return num_blocks, block_size, hkv, d


def check_scale(scale: torch.Tensor | None, hkv: int, device: torch.device, name: str) -> None:
    if scale is None:
        return
    if scale.shape != (hkv,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous float32 tensor of shape [{hkv}] (one scale per KV head), "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )
    check_device(scale, device, name)


def check_index(t: torch.Tensor, name: str, dims: int, device: torch.device) -> None:
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s), got shape {tuple(t.shape)}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    check_device(t, device, name)


def check_tokens(x: torch.Tensor, name: str, heads: int | None, head_dim: int, device: torch.device) -> None:
    """x [T, heads, head_dim] in a compute dtype, contiguous in head_dim."""
    if x.dim() != 3 or x.shape[2] != head_dim or (heads is not None and x.shape[1] != heads):
        want = f"[T, {heads if heads is not None else 'H'}, {head_dim}]"
        raise ValueError(f"{name} must be {want}, got shape {tuple(x.shape)}")
    if x.dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), got strides {x.stride()}")
    check_device(x, device, name)


def check_runnable(kernel, device: torch.device) -> None:
    """Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1 set before the kernels were imported."""
    interpreted = not isinstance(kernel, triton.runtime.jit.JITFunction)
    if device.type == "cpu" and not interpreted:
        raise ValueError(
            "Triton kernels got CPU tensors but are compiled for a GPU: set TRITON_INTERPRET=1 before "
            "kvlab.kernels.triton_kernels is imported, or use the torch backend (kvlab.kernels.ops.set_backend('torch'))"
        )


@dataclass(frozen=True)
class PackedSide:
    """Kernel arguments of one side (K or V) of a packed page store (triton_kernels/codec.py load_packed)."""

    data: torch.Tensor  # codes [num_blocks, bs, Hkv, D * bits / 8] (int8: [.., D])
    scale: torch.Tensor
    zero: torch.Tensor | None
    residual: torch.Tensor | None  # flat residual row storage (kvlab.cache.quant.page_store: chunks via area.lease)
    kind: int
    bits: int
    group: int


def check_packed_pair(k_store, v_store) -> tuple[int, int, int, int]:
    """Packed page stores: same logical shape and device, contiguous parts, a head_dim the kernels take."""
    if tuple(k_store.shape) != tuple(v_store.shape):
        raise ValueError(f"k_cache {tuple(k_store.shape)} and v_cache {tuple(v_store.shape)} must have the same shape")
    for name, store in (("k_cache", k_store), ("v_cache", v_store)):
        for part, t in (*store.parts.items(), ("residual", store.residual)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name} part {part} must be contiguous, got strides {t.stride()}")
        check_device(store.parts["data"], k_store.device, name)
    num_blocks, block_size, hkv, d = k_store.shape
    if not is_pow2(block_size):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if not 16 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [16, {MAX_HEAD_DIM}], got {d}")
    return num_blocks, block_size, hkv, d


def packed_side(store) -> PackedSide:
    kind, bits, group = store.codec.layout()
    return PackedSide(store.parts["data"], store.parts["scale"], store.parts.get("zero"), store.residual,
                      kind, bits, group)

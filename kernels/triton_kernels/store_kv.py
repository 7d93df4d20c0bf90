"""Triton kernel: write new keys/values into their slots of the paged pool (PagedAttention, arXiv:2309.06180).

One program per new token writes all its KV heads for K and V, quantising through
the cache codec on the way. A negative slot (padding) writes nothing.
"""

import triton
import triton.language as tl

from kvlab.kernels.triton_kernels.codec import encode


@triton.jit
def store_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_ptr,  # [T] int slot = block * block_size + offset, < 0 = skip
    k_scale_ptr,  # [Hkv] float32 (SCALED codec only)
    v_scale_ptr,  # [Hkv] float32
    stride_kt, stride_kh,  # key strides (token, head); last dim contiguous
    stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,  # k_cache strides (block, offset, head)
    stride_vcb, stride_vcs, stride_vch,
    block_size,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= NUM_HEADS
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    K_CODEC: tl.constexpr,
    V_CODEC: tl.constexpr,
    K_MAX: tl.constexpr,  # largest finite storage value (SCALED codec clamp)
    V_MAX: tl.constexpr,
    MANT_BITS: tl.constexpr,  # storage grid (k_cache and v_cache share the dtype)
    MIN_EXP: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
        d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
        t64 = t.to(tl.int64)

        k = tl.load(key_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
        k_scale = 1.0
        if K_CODEC == 1:
            k_scale = tl.load(k_scale_ptr + h, mask=h < NUM_HEADS, other=1.0)[:, None]  # [BLOCK_H, 1]
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch + d[None, :]
        tl.store(k_dst, encode(k, k_scale, K_CODEC, K_MAX, MANT_BITS, MIN_EXP, k_cache_ptr.dtype.element_ty), mask=mask)

        v = tl.load(value_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
        v_scale = 1.0
        if V_CODEC == 1:
            v_scale = tl.load(v_scale_ptr + h, mask=h < NUM_HEADS, other=1.0)[:, None]
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch + d[None, :]
        tl.store(v_dst, encode(v, v_scale, V_CODEC, V_MAX, MANT_BITS, MIN_EXP, v_cache_ptr.dtype.element_ty), mask=mask)

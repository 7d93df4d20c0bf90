"""Launcher: write new keys/values into the paged pool (Triton), quantising for the cache format.

Same signature as kvlab.kernels.reference.store_kv.store_kv_ref. The cache
format is read off the pool's dtype and the scales (kvlab.kernels._checks.codec_for):
float storage without scales is a cast, fp8 storage (or any float storage with
scales) stores clamp(x / scale) per KV head.
"""

from __future__ import annotations

import torch

from kvlab.kernels import _checks as C
from kvlab.kernels.triton_kernels.store_kv import store_kv_kernel


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D] new keys (compute dtype)
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] storage dtype
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int slot = block * block_size + offset; < 0 skips the token
    k_scale: torch.Tensor | None = None,  # [Hkv] float32 (stored = x / scale)
    v_scale: torch.Tensor | None = None,
) -> None:
    _, block_size, hkv, d = C.check_cache_pair(k_cache, v_cache)
    device = k_cache.device
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share a storage dtype")
    C.check_tokens(key, "key", hkv, d, device)
    C.check_tokens(value, "value", hkv, d, device)
    C.check_index(slot_mapping, "slot_mapping", 1, device)
    T = key.shape[0]
    if value.shape[0] != T or slot_mapping.shape[0] != T:
        raise ValueError(
            f"key ({T}), value ({value.shape[0]}) and slot_mapping ({slot_mapping.shape[0]}) need one row per token"
        )
    C.check_scale(k_scale, hkv, device, "k_scale")
    C.check_scale(v_scale, hkv, device, "v_scale")
    k_codec = C.codec_for(k_cache, k_scale, "k_cache")
    v_codec = C.codec_for(v_cache, v_scale, "v_cache")
    C.check_runnable(store_kv_kernel, device)
    if T == 0:
        return
    store_kv_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if k_scale is not None else slot_mapping,  # placeholder pointer when unused
        v_scale if v_scale is not None else slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_size,
        NUM_HEADS=hkv,
        HEAD_DIM=d,
        BLOCK_H=C.next_pow2(hkv),
        BLOCK_D=C.next_pow2(d),
        K_CODEC=k_codec.id,
        V_CODEC=v_codec.id,
        K_MAX=k_codec.store_max,
        V_MAX=v_codec.store_max,
        MANT_BITS=k_codec.mant_bits,
        MIN_EXP=k_codec.min_exp,
        num_warps=4,
    )

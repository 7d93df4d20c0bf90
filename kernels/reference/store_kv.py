"""Reference: write new keys/values into the paged pool (PagedAttention, arXiv:2309.06180) through a slot mapping."""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D] new keys (compute dtype)
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] storage dtype
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64 slot = block * block_size + offset; < 0 skips the token
    k_scale: torch.Tensor | None = None,  # [Hkv] float32 dequantisation scale (stored = x / scale)
    v_scale: torch.Tensor | None = None,
) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, Hkv, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat[slot_mapping] = quantize_ref(key, k_scale, k_cache.dtype)
    v_flat[slot_mapping] = quantize_ref(value, v_scale, v_cache.dtype)


def quantize_ref(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x [T, Hkv, D] -> storage dtype; with a per-head scale, stored = clamp(x / scale) to the storage range."""
    if scale is None:
        return x.to(dtype)
    y = x.float() / scale.float().view(1, -1, 1)
    if dtype.is_floating_point:
        finfo = torch.finfo(dtype)
        y = y.clamp(finfo.min, finfo.max)
    return y.to(dtype)


def dequantize_ref(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x [..., Hkv, D] storage -> compute dtype; scale [Hkv] multiplies back."""
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale.float().view(-1, 1)).to(dtype)


def read_blocks(cache, blocks: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Pages `blocks` [...] int64 of a pool, dequantised -> [..., block_size, Hkv, D] in `dtype`.

    `cache` is a pool tensor [num_blocks, block_size, Hkv, D] (element-wise formats, per-head
    `scale`) or a packed format's kvlab.cache.quant.page_store.PageStore (its own scales and zero points)."""
    if isinstance(cache, torch.Tensor):
        return dequantize_ref(cache[blocks], scale, dtype)
    return cache.read_pages(blocks.reshape(-1), dtype).view(*blocks.shape, *cache.shape[1:])

"""Launchers: block copy (copy-on-write) and slot compaction (eviction) on the paged pool, with Triton.

Same signatures as kvlab.kernels.reference.block_ops. Storage is copied as is
(any dtype, quantised or not; the per-KV-head scales belong to the layer).
Compaction goes through a temporary buffer, so destination slots may overlap
the source slots (in-place compaction of a sequence into its first blocks).
"""

from __future__ import annotations

import torch

from kvlab.kernels import _checks as C
from kvlab.kernels.triton_kernels.block_ops import copy_rows_kernel

CHUNK = 1024  # elements per program


def _check_pair_and_index(k_cache, v_cache, src, dst, what):
    C.check_cache_pair(k_cache, v_cache)
    device = k_cache.device
    C.check_index(src, f"src_{what}", 1, device)
    C.check_index(dst, f"dst_{what}", 1, device)
    if src.shape != dst.shape:
        raise ValueError(f"src_{what} {tuple(src.shape)} and dst_{what} {tuple(dst.shape)} must pair up one to one")
    C.check_runnable(copy_rows_kernel, device)


def _copy_rows(src, dst, src_rows, dst_rows, src_rpb, dst_rpb, row_elems):
    """dst row dst_rows[i] = src row src_rows[i]; a row is contiguous, `rpb` rows per leading index."""
    n = src_rows.shape[0]
    if n == 0:
        return
    src_strides = (src.stride(0), src.stride(1) if src_rpb > 1 else 0)
    dst_strides = (dst.stride(0), dst.stride(1) if dst_rpb > 1 else 0)
    block = min(CHUNK, C.next_pow2(row_elems))
    copy_rows_kernel[(n, -(-row_elems // block))](
        src, dst, src_rows, dst_rows,
        *src_strides, *dst_strides,
        SRC_RPB=src_rpb, DST_RPB=dst_rpb, ROW_ELEMS=row_elems, BLOCK=block,
        num_warps=4,
    )


def copy_blocks(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    src_blocks: torch.Tensor,  # [N] int block ids to read
    dst_blocks: torch.Tensor,  # [N] int block ids to write (distinct, disjoint from src_blocks)
) -> None:
    _check_pair_and_index(k_cache, v_cache, src_blocks, dst_blocks, "blocks")
    for cache in (k_cache, v_cache):
        if not cache[0].is_contiguous():
            raise ValueError(f"each block must be contiguous ([block_size, Hkv, D]), got strides {cache.stride()}")
        _copy_rows(cache, cache, src_blocks, dst_blocks, 1, 1, cache[0].numel())


def compact_slots(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    src_slots: torch.Tensor,  # [N] int slots to read (slot = block * block_size + offset)
    dst_slots: torch.Tensor,  # [N] int distinct slots to write; may overlap src_slots
) -> None:
    _check_pair_and_index(k_cache, v_cache, src_slots, dst_slots, "slots")
    n = src_slots.shape[0]
    bs = k_cache.shape[1]
    rows = torch.arange(n, dtype=torch.int32, device=k_cache.device)
    for cache in (k_cache, v_cache):
        if not cache[0, 0].is_contiguous():
            raise ValueError(f"each slot must be contiguous ([Hkv, D]), got strides {cache.stride()}")
        row_elems = cache[0, 0].numel()
        tmp = torch.empty(n, *cache.shape[2:], dtype=cache.dtype, device=cache.device)  # [N, Hkv, D]
        _copy_rows(cache, tmp, src_slots, rows, bs, 1, row_elems)  # gather
        _copy_rows(tmp, cache, rows, dst_slots, 1, bs, row_elems)  # scatter

"""Reference block operations on the paged pool.

`copy_blocks_ref` duplicates whole blocks (copy-on-write of a shared block, as in
PagedAttention, arXiv:2309.06180); `compact_slots_ref` moves single tokens
(gathers the tokens an eviction policy keeps into fewer blocks, so whole blocks
go back to the pool). Both copy storage as is: quantised values keep their
per-KV-head scales, which belong to the layer, not to a block.
"""

from __future__ import annotations

import torch


def copy_blocks_ref(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    src_blocks: torch.Tensor,  # [N] int block ids to read
    dst_blocks: torch.Tensor,  # [N] int block ids to write (distinct, disjoint from src_blocks)
) -> None:
    src, dst = src_blocks.long(), dst_blocks.long()
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


def compact_slots_ref(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    src_slots: torch.Tensor,  # [N] int slots to read (slot = block * block_size + offset)
    dst_slots: torch.Tensor,  # [N] int distinct slots to write; may overlap src_slots
) -> None:
    """All reads happen before any write, so compaction in place (dst overlapping src) is safe."""
    src, dst = src_slots.long(), dst_slots.long()
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, *cache.shape[2:])  # [num_slots, Hkv, D]
        flat[dst] = flat[src].clone()

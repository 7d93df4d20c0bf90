"""The element-wise page layout (fp32 / bf16 / fp16, fp8 with a fixed scale): plain pool tensors.

    k[s], v[s]:  [num_pages + 1, block_size, heads, head_dim]  (the format's storage dtype; heads =
                 num_kv_heads, or 1 where every (layer, KV head) has its own table: per-head budgets)
    block:       [2, slots, num_pages + 1, block_size, heads, head_dim]: the one allocation k[s] = block[0, s] and
                 v[s] = block[1, s] are contiguous views of, so a page across every layer is one strided slice

Token slot `p * block_size + o` of layer slot `s` is `k[s][p, o]`. Writes go through
`kvlab.kernels.ops.store_kv` (with the layer's fixed scales, if any: `KVCache.scales`), page copies
through `ops.copy_blocks`, compaction through `ops.compact_slots`; nothing is kept beside the pool.
"""

from __future__ import annotations

import torch

from kvlab.cache.kv_layout import PageLayout, Scales
from kvlab.cache.quant.base import QuantFormat
from kvlab.kernels import ops


class DenseLayout(PageLayout):
    def __init__(self, quant: QuantFormat, per_group: int, num_blocks: int, block_size: int, heads: int,
                 head_dim: int, compute_dtype: torch.dtype, device: torch.device | str):
        """`per_group` layer slots of `num_blocks` pages and the null page."""
        dtype = quant.storage_dtype(compute_dtype)
        shape = (num_blocks + 1, block_size, heads, head_dim)
        self.block = torch.zeros((2, per_group, *shape), dtype=dtype, device=device)
        self.k = list(self.block[0].unbind(0))
        self.v = list(self.block[1].unbind(0))

    def store(self, slot: int, group: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              scales: Scales) -> None:
        ops.store_kv(key, value, self.k[slot], self.v[slot], slot_mapping, *scales)

    def read_slots(self, slot: int, slots: torch.Tensor, dtype: torch.dtype,
                   scales: Scales) -> tuple[torch.Tensor, torch.Tensor]:
        from kvlab.kernels.reference.store_kv import dequantize_ref

        k, v = self.k[slot], self.v[slot]  # [num_pages + 1, bs, heads, D]
        return (dequantize_ref(k.view(-1, *k.shape[2:]).index_select(0, slots), scales[0], dtype),
                dequantize_ref(v.view(-1, *v.shape[2:]).index_select(0, slots), scales[1], dtype))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._apply(ops.copy_blocks, pairs)

    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        self._apply(ops.compact_slots, moves)

    def move_head_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        heads = torch.arange(src.shape[0], device=src.device)[:, None]  # [Hkv, 1]
        for pool in (*self.k, *self.v):
            flat = pool.view(-1, *pool.shape[2:])  # [slots, Hkv, D]
            flat[dst[None, :], heads] = flat[src, heads]  # [Hkv, m, D]

    def clear_slots(self, slots: list[int]) -> None:
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.int64, device=self.k[0].device)
        for pool in (*self.k, *self.v):
            pool.view(-1, *pool.shape[2:])[index] = 0  # [slots, heads, D]

    def _apply(self, op, pairs: list[tuple[int, int]]) -> None:
        """op(k, v, src [N], dst [N]) on every layer slot's pool tensors."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.k[0].device)
        dst = torch.tensor([d for _, d in pairs], device=src.device)
        for k, v in zip(self.k, self.v):
            op(k, v, src, dst)

    def page_tensors(self) -> list[torch.Tensor]:
        return [*self.k, *self.v]

    def page_block(self) -> torch.Tensor:
        b = self.block
        return b.view(2 * b.shape[1], b.shape[2], -1)  # [2 * slots, num_pages + 1, page elements]

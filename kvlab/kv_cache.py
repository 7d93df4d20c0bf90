"""The KV pool tensors: one shared page pool, plus quantisation scales per layer.

Every layer group has the same number of layers (kvlab.block_manager), so the pool is stored as one
pair of tensors per layer *slot within a group*:

    k[s], v[s]:     [num_pages + 1, block_size, heads, head_dim]  (storage dtype; heads = num_kv_heads,
                    or 1 where every (layer, KV head) has its own table: per-head budgets)
    scales[layer]:  (k_scale [num_kv_heads], v_scale [num_kv_heads]) float32, or None

Layer `l` of group `g` at slot `s` reads and writes page `p` at `k[s][p]`; a page belongs to one
group at a time (the block manager hands it out), so layers of different groups never meet in it.
The last page (`null_page`) stays zero: released table entries and padding point at it.
"""

from __future__ import annotations

import torch

from kvlab.block_manager import LayerGroup
from kvlab.kernels import ops
from kvlab.quant.base import QuantFormat


def heads_per_page(groups: list[LayerGroup], num_kv_heads: int) -> int:
    """KV heads a page holds: all of them, or one where each (layer, KV head) has its own table."""
    return 1 if groups[0].head is not None else num_kv_heads


def bytes_per_block(groups: list[LayerGroup], block_size: int, num_kv_heads: int, head_dim: int,
                    quant: QuantFormat, compute_dtype: torch.dtype) -> float:
    """Bytes one page costs: K and V of `block_size` tokens for every layer (and KV head) of one group."""
    return (2 * len(groups[0].layers) * block_size * heads_per_page(groups, num_kv_heads) * head_dim
            * quant.bytes_per_element(compute_dtype))


class KVCache:
    def __init__(self, groups: list[LayerGroup], num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, quant: QuantFormat, compute_dtype: torch.dtype, device: torch.device | str):
        self.groups = groups
        self.quant = quant
        # layer -> [(group, KV head or None for all)]: one entry, or one per KV head with per-head tables
        self.groups_of: dict[int, list[tuple[int, int | None]]] = {}
        for g, group in enumerate(groups):
            for layer in group.layers:
                self.groups_of.setdefault(layer, []).append((g, group.head))
        self.slot_of: dict[int, int] = {layer: s for group in groups for s, layer in enumerate(group.layers)}
        self.null_page = num_blocks
        dtype = quant.storage_dtype(compute_dtype)
        shape = (num_blocks + 1, block_size, heads_per_page(groups, num_kv_heads), head_dim)
        per_group = len(groups[0].layers)
        self._k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(per_group)]
        self._v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(per_group)]
        self.scales = {layer: quant.init_scales(num_kv_heads, device) for layer in self.groups_of}
        self._calibrated: set[int] = set()

    def k(self, layer: int) -> torch.Tensor:
        """[num_pages + 1, block_size, Hkv, D] keys of `layer` (pages of other groups in it are not its own)."""
        return self._k[self.slot_of[layer]]

    def v(self, layer: int) -> torch.Tensor:
        return self._v[self.slot_of[layer]]

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              head: int | None = None) -> None:
        """key/value [T, Hkv, D] -> their slots in `layer`'s pool (`head`: only that KV head's, into pages
        that hold one head)."""
        scales = self.scales[layer]
        if scales is not None and layer not in self._calibrated:
            self.quant.calibrate(key, value, scales)  # every head's scale, from the layer's first chunk
            self._calibrated.add(layer)
        k_scale, v_scale = self.head_scales(layer, head)
        if head is not None:
            key, value = key[:, head : head + 1], value[:, head : head + 1]  # [T, 1, D]
        ops.store_kv(key, value, self.k(layer), self.v(layer), slot_mapping, k_scale, v_scale)

    def head_scales(self, layer: int, head: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) of `layer` ([Hkv], or [1] for one KV head), or (None, None) unscaled."""
        scales = self.scales[layer]
        if scales is None:
            return None, None
        return scales if head is None else (scales[0][head : head + 1], scales[1][head : head + 1])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: page src -> page dst, in every layer slot."""
        self._apply(ops.copy_blocks, pairs)

    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        """Compaction: token slot src -> slot dst (all reads before writes), in every layer slot."""
        self._apply(ops.compact_slots, moves)

    def move_head_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per-head compaction: KV head h's K/V at slots src[h] ([Hkv, m]) -> slots dst ([m]), all reads
        before writes, in every layer slot (released source pages are read before anything reuses them)."""
        heads = torch.arange(src.shape[0], device=src.device)[:, None]  # [Hkv, 1]
        for pool in (*self._k, *self._v):
            flat = pool.view(-1, *pool.shape[2:])  # [slots, Hkv, D]
            flat[dst[None, :], heads] = flat[src, heads]  # [Hkv, m, D]

    def _apply(self, op, pairs: list[tuple[int, int]]) -> None:
        """op(k, v, src [N], dst [N]) on every layer slot's pool tensors."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self._k[0].device)
        dst = torch.tensor([d for _, d in pairs], device=src.device)
        for k, v in zip(self._k, self._v):
            op(k, v, src, dst)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))

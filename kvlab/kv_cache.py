"""The KV pool tensors: per layer, keys and values in blocks, plus quantisation scales.

    k[layer], v[layer]: [num_blocks, block_size, num_kv_heads, head_dim]  (storage dtype)
    scales[layer]:      (k_scale [num_kv_heads], v_scale [num_kv_heads]) float32, or None

A layer's block ids come from its group's block tables (kvlab.block_manager).
"""

from __future__ import annotations

import torch

from kvlab.block_manager import LayerGroup
from kvlab.kernels import ops
from kvlab.quant.base import QuantFormat


def bytes_per_block(groups: list[LayerGroup], block_size: int, num_kv_heads: int, head_dim: int,
                    quant: QuantFormat, compute_dtype: torch.dtype) -> float:
    """Bytes one block id costs across every layer (K and V)."""
    num_layers = sum(len(g.layers) for g in groups)
    return 2 * num_layers * block_size * num_kv_heads * head_dim * quant.bytes_per_element(compute_dtype)


class KVCache:
    def __init__(self, groups: list[LayerGroup], num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, quant: QuantFormat, compute_dtype: torch.dtype, device: torch.device | str):
        self.groups = groups
        self.quant = quant
        self.group_of: dict[int, int] = {layer: g for g, group in enumerate(groups) for layer in group.layers}
        dtype = quant.storage_dtype(compute_dtype)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = {layer: torch.zeros(shape, dtype=dtype, device=device) for layer in self.group_of}
        self.v = {layer: torch.zeros(shape, dtype=dtype, device=device) for layer in self.group_of}
        self.scales = {layer: quant.init_scales(num_kv_heads, device) for layer in self.group_of}
        self._calibrated: set[int] = set()

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key/value [T, Hkv, D] -> their slots in `layer`'s pool."""
        scales = self.scales[layer]
        if scales is not None and layer not in self._calibrated:
            self.quant.calibrate(key, value, scales)
            self._calibrated.add(layer)
        k_scale, v_scale = scales if scales is not None else (None, None)
        ops.store_kv(key, value, self.k[layer], self.v[layer], slot_mapping, k_scale, v_scale)

    def copy_blocks(self, group: int, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst in every layer of `group`."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.k[self.groups[group].layers[0]].device)
        dst = torch.tensor([d for _, d in pairs], device=src.device)
        for layer in self.groups[group].layers:
            ops.copy_blocks(self.k[layer], self.v[layer], src, dst)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

"""The quantisation-format interface: how the KV pool stores keys and values.

A format decides the pool's storage dtype, the scale tensors beside it and how
many bytes a cached element costs (so a byte budget buys proportionally more
blocks). Writing quantises (kvlab.kernels store_kv with scales) and attention
dequantises on load. Scales are per KV head (`[Hkv]` float32, one for keys and
one for values per layer); a format with none returns None.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvlab.registry import QUANT_FORMATS


@dataclass
class QuantFormat(ABC):
    """Base class of cache formats; subclasses are dataclasses of their parameters."""

    @abstractmethod
    def storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """dtype of the pool tensors."""

    def bytes_per_element(self, compute_dtype: torch.dtype) -> float:
        return self.storage_dtype(compute_dtype).itemsize

    def init_scales(self, num_kv_heads: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale [Hkv], v_scale [Hkv]) float32 for one layer, or None for unscaled storage."""
        return None

    def calibrate(self, key: torch.Tensor, value: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Update a layer's scales in place from its first written keys/values [T, Hkv, D] (optional)."""


QUANT_FORMATS.base = QuantFormat

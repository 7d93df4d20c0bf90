"""Unquantised storage: the model's own dtype, or a chosen float dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.quant.base import QuantFormat
from kvlab.registry import QUANT_FORMATS



@QUANT_FORMATS.register("auto")
@dataclass
class Auto(QuantFormat):
    """Store K/V in the model's compute dtype (no quantisation)."""

    def storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return compute_dtype

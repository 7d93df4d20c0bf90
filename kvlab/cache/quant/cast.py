"""Plain float storage: cast on write, upcast on read, no scales.

`fp32`, `bf16` and `fp16` store K/V in that dtype whatever the model computes in;
`auto` (kvlab.cache.quant.auto) keeps the model's own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.quant.base import QuantFormat
from kvlab.registry import QUANT_FORMATS


@dataclass
class Cast(QuantFormat):
    """Store K/V as `dtype`."""

    dtype: ClassVar[torch.dtype]

    def storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return self.dtype


@QUANT_FORMATS.register("fp32")
@dataclass
class FP32(Cast):
    dtype: ClassVar[torch.dtype] = torch.float32


@QUANT_FORMATS.register("bf16")
@dataclass
class BF16(Cast):
    dtype: ClassVar[torch.dtype] = torch.bfloat16


@QUANT_FORMATS.register("fp16")
@dataclass
class FP16(Cast):
    dtype: ClassVar[torch.dtype] = torch.float16

"""fp8 cache storage (e4m3 / e5m2) with per-KV-head float32 scales.

stored = clamp(x / scale, -fp8_max, fp8_max) cast to fp8; read = stored * scale.
With `scale=None` each layer's scales are calibrated from the first chunk it
writes: scale = amax(|x|) / fp8_max per KV head (`granularity="head"`) or over
all heads (`granularity="tensor"`), so that chunk uses the full fp8 range.
A fixed `scale` skips calibration (1.0 = plain cast with saturation).
As in vLLM's fp8 KV cache ("fp8_e4m3" keeps precision, "fp8_e5m2" keeps range).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.quant.base import QuantFormat
from kvlab.registry import QUANT_FORMATS

GRANULARITIES = ("head", "tensor")


@dataclass
class FP8(QuantFormat):
    """Store K/V as fp8 `dtype` with per-KV-head dequantisation scales."""

    dtype: ClassVar[torch.dtype]
    scale: float | None = None  # fixed dequantisation scale for K and V; None = calibrate on the first chunk
    granularity: str = "head"  # "head": one scale per KV head; "tensor": one per layer (broadcast over heads)
    min_scale: float = 1e-8  # floor for calibrated scales (an all-zero first chunk)

    def __post_init__(self) -> None:
        if self.scale is not None and not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"{type(self).__name__}: scale must be a positive finite number or None, got {self.scale}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"{type(self).__name__}: granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}"
            )
        if not self.min_scale > 0:
            raise ValueError(f"{type(self).__name__}: min_scale must be > 0, got {self.min_scale}")

    @property
    def max_value(self) -> float:
        return float(torch.finfo(self.dtype).max)

    def storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return self.dtype

    def init_scales(self, num_kv_heads: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        value = 1.0 if self.scale is None else self.scale
        k = torch.full((num_kv_heads,), value, dtype=torch.float32, device=device)  # [Hkv]
        return k, k.clone()

    def calibrate(self, key: torch.Tensor, value: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor]) -> None:
        """key/value [T, Hkv, D]: set scales to amax / fp8_max (no-op with a fixed scale)."""
        if self.scale is not None:
            return
        for x, s in zip((key, value), scales):
            amax = x.detach().float().abs().amax(dim=(0, 2))  # [Hkv]
            if self.granularity == "tensor":
                amax = amax.amax().expand_as(amax)
            s.copy_((amax / self.max_value).clamp_min(self.min_scale))


@QUANT_FORMATS.register("fp8_e4m3")
@dataclass
class FP8E4M3(FP8):
    dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn


@QUANT_FORMATS.register("fp8_e5m2")
@dataclass
class FP8E5M2(FP8):
    dtype: ClassVar[torch.dtype] = torch.float8_e5m2

"""fp8 cache storage (e4m3 / e5m2), scaled by the configuration or by each token alone.

fp8 is floating point: a scale moves its grid, not its 3 (e4m3) or 2 (e5m2) mantissa bits, so it
matters through saturation (|x| / scale beyond fp8_max is clamped), subnormals, and where the grid's
points fall on a token's largest elements, which carry most of its norm. Either way the result
depends on nothing but the token's own K/V and the configuration, never on the request history:

- `scaling="token"` (default): a float16 dequantisation scale per token per KV head stored beside the
  codes (2 bytes per token per head and side): the token's amax maps to fp8_max (nothing saturates,
  the largest element is exact); with `candidates` > 1, the scale among amax / fp8_max * 2^(i /
  candidates), i < candidates, that rounds the token's elements with the least squared error. A
  packed format (kvlab.cache.quant.page_store, token-local codec; Triton reads it in codec.load_packed).
- `scaling="fixed"`: one dequantisation `scale` for every element (1.0, the default: a plain cast,
  vLLM's uncalibrated fp8 cache; another number: an offline calibration), stored = clamp(x / scale)
  in the pool tensor itself, read by every backend and policy, no bytes beside the codes.

Measured on SmolLM2-135M (experiments/results/fp8_scaling_smollm2.md) with the format-quality benchmark.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.quant.base import PageCodec, PartSpec, QuantFormat
from kvlab.cache.quant.integer import fp16_up
from kvlab.registry import QUANT_FORMATS

SCALINGS = ("token", "fixed")
_FP16_MAX = 65504.0


class FP8TokenCodec(PageCodec):
    """fp8 codes with a float16 scale per token per KV head (keys and values alike)."""

    token_local = True

    def __init__(self, dtype: torch.dtype, candidates: int):
        self.dtype, self.candidates = dtype, candidates
        info = torch.finfo(dtype)
        self.max_value = float(info.max)
        self.mant_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
        self.min_exp = int(math.log2(info.smallest_normal))

    def layout(self) -> tuple[int, int, int]:
        return 3, 8, 1

    def parts(self, block_size: int, num_kv_heads: int, head_dim: int) -> dict[str, PartSpec]:
        return {"data": PartSpec((block_size, num_kv_heads, head_dim), self.dtype),
                "scale": PartSpec((block_size, num_kv_heads), torch.float16)}

    def _cast(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x [..., D] float32, scale [...] float16 -> fp8 codes of x / scale (0 where scale is 0)."""
        s = scale.float().unsqueeze(-1)
        y = torch.where(s > 0, x / s.clamp_min(1e-30), torch.zeros_like(x))
        return y.clamp(-self.max_value, self.max_value).to(self.dtype)

    def encode_tokens(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [T, Hkv, D] -> codes [T, Hkv, D], scale [T, Hkv]: the best of `candidates` scales per token."""
        x = x.float()
        base = x.abs().amax(dim=-1).clamp_max(_FP16_MAX * self.max_value / 2) / self.max_value  # [T, Hkv]
        best_codes, best_scale, best_err = None, None, None
        for i in range(self.candidates):
            scale = fp16_up(base * 2.0 ** (i / self.candidates))  # rounded up: never saturates
            codes = self._cast(x, scale)
            err = (codes.float() * scale.float().unsqueeze(-1) - x).square().sum(dim=-1)  # [T, Hkv]
            if best_err is None:
                best_codes, best_scale, best_err = codes, scale, err
                continue
            better = err < best_err
            best_codes = torch.where(better.unsqueeze(-1), codes, best_codes)
            best_scale = torch.where(better, scale, best_scale)
            best_err = torch.minimum(err, best_err)
        return {"data": best_codes, "scale": best_scale}

    def encode(self, x: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        P, bs, hkv, d = x.shape
        parts = self.encode_tokens(x.reshape(P * bs, hkv, d))
        return {name: t.view(P, bs, *t.shape[1:]) for name, t in parts.items()}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return (parts["data"].float() * parts["scale"].float().unsqueeze(-1)).to(dtype)  # [P, bs, Hkv, D]

    def steps(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The fp8 grid's spacing at each code, times its token's scale."""
        code = parts["data"].float().abs()
        exp = torch.floor(torch.log2(code.clamp_min(2.0 ** self.min_exp))).clamp_min(self.min_exp)
        return torch.exp2(exp - self.mant_bits) * parts["scale"].float().unsqueeze(-1)


@dataclass
class FP8(QuantFormat):
    """fp8 `dtype` K/V, scaled per token (packed, scales beside the codes) or by one fixed scale."""

    dtype: ClassVar[torch.dtype]
    scaling: str = "token"  # "token": per token per KV head, from the token alone; "fixed": `scale` for all
    scale: float = 1.0  # scaling="fixed": the dequantisation scale of K and V (1.0: a plain cast)
    candidates: int = 1  # scaling="token": scales tried per token, the least squared error kept (1: amax only)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.scaling not in SCALINGS:
            raise ValueError(f"{name}: scaling must be one of {', '.join(SCALINGS)}, got {self.scaling!r} (the "
                             f"first-chunk calibration is gone: a calibrated scale is scaling='fixed', scale=<number>)")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not (
                math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"{name}: scale must be a positive finite number, got {self.scale!r}")
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, int) or not 1 <= self.candidates <= 64:
            raise ValueError(f"{name}: candidates must be an integer in [1, 64], got {self.candidates!r}")

    @property
    def packed(self) -> bool:  # per-token scales live in the pages, beside the codes
        return self.scaling == "token"

    @property
    def max_value(self) -> float:
        return float(torch.finfo(self.dtype).max)

    def storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return self.dtype

    def codecs(self, block_size: int, head_dim: int) -> tuple[PageCodec, PageCodec]:
        if not self.packed:
            return super().codecs(block_size, head_dim)
        codec = FP8TokenCodec(self.dtype, self.candidates)
        return codec, codec

    def init_scales(self, num_kv_heads: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.packed:
            return None
        k = torch.full((num_kv_heads,), float(self.scale), dtype=torch.float32, device=device)  # [Hkv]
        return k, k.clone()


@QUANT_FORMATS.register("fp8_e4m3")
@dataclass
class FP8E4M3(FP8):
    dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn


@QUANT_FORMATS.register("fp8_e5m2")
@dataclass
class FP8E5M2(FP8):
    dtype: ClassVar[torch.dtype] = torch.float8_e5m2

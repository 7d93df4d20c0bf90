"""int8 cache storage: symmetric, one float16 scale per token per KV head.

stored = round(x / scale) in [-127, 127] with scale = amax over the head's D channels / 127,
rounded up to float16 (2 bytes per token per KV head, counted in the pool's bytes);
read = stored * scale. Every token encodes alone, so writes scatter straight into their slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.quant.base import PageCodec, PartSpec, QuantFormat
from kvlab.cache.quant.integer import symmetric
from kvlab.registry import QUANT_FORMATS

QMAX = 127


class Int8TokenCodec(PageCodec):
    """Per token, per KV head symmetric int8 (used for keys and values alike)."""

    token_local = True

    def layout(self) -> tuple[int, int, int]:
        return 0, 8, 1

    def parts(self, block_size: int, num_kv_heads: int, head_dim: int) -> dict[str, PartSpec]:
        return {"data": PartSpec((block_size, num_kv_heads, head_dim), torch.int8),
                "scale": PartSpec((block_size, num_kv_heads), torch.float16)}

    def encode_tokens(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale = symmetric(x.float(), dim=-1, qmax=QMAX)  # [T, Hkv, D], [T, Hkv]
        return {"data": codes, "scale": scale}

    def encode(self, x: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        P, bs, hkv, d = x.shape
        parts = self.encode_tokens(x.reshape(P * bs, hkv, d))
        return {name: t.view(P, bs, *t.shape[1:]) for name, t in parts.items()}

    def steps(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return parts["scale"].float().unsqueeze(-1).expand(parts["data"].shape)

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return (parts["data"].float() * parts["scale"].float().unsqueeze(-1)).to(dtype)  # [P, bs, Hkv, D]


@QUANT_FORMATS.register("int8")
@dataclass
class Int8(QuantFormat):
    """Symmetric int8 keys and values, a float16 scale per token per KV head (no parameters)."""

    packed = True
    backends = ("torch", "triton")  # Triton: fused dequantisation in attention (codec.load_packed)

    def storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return torch.int8

    def codecs(self, block_size: int, head_dim: int) -> tuple[PageCodec, PageCodec]:
        codec = Int8TokenCodec()
        return codec, codec

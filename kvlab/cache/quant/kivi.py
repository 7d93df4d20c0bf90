"""int4 / int2 cache storage in the KIVI style (Liu et al. 2024, arXiv:2402.02750).

Keys are quantised per channel over groups of G_k tokens (a page holds block_size / G_k
key groups), values per token over groups of G_v channels; both asymmetric, with float16
scale and zero point (kvlab.cache.quant.integer). `group_size` sets both; left unset (None) they
follow the shapes, G_k = gcd(32, block_size) and G_v = gcd(32, head_dim) (the largest divisor up
to KIVI's 32: 16 for the engine's default 16-token pages), so the format runs with every block
size from 4 up.
Codes are packed along head_dim (two int4 / four int2 per uint8, kvlab.cache.quant.packing).

Page parts (per page; the pool adds the page dimension):
    k.data  [bs, Hkv, D * bits / 8] uint8     k.scale, k.zero  [bs / G_k, Hkv, D] float16
    v.data  [bs, Hkv, D * bits / 8] uint8     v.scale, v.zero  [bs, Hkv, D / G_v] float16

Residual window: the newest `residual` tokens of each sequence stay in full precision (the
compute dtype, or `residual_dtype`) in residual rows, a page at a time: a page is quantised once
all its tokens are older than the window (a partly filled page always stays full precision:
"until a group fills"). In the engine a row lives in the codes of free pool pages leased while
its page is open (kvlab.cache.quant.lease; kvlab.cache.quant.page_store describes the rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.quant.base import PageCodec, PartSpec, QuantFormat
from kvlab.cache.quant.integer import asymmetric
from kvlab.cache.quant.packing import pack, per_byte, unpack
from kvlab.registry import QUANT_FORMATS


@dataclass
class KeyCodec(PageCodec):
    """Keys: per channel, over groups of `group_size` tokens within a page."""

    bits: int
    group_size: int

    def layout(self) -> tuple[int, int, int]:
        return 1, self.bits, self.group_size

    def parts(self, block_size: int, num_kv_heads: int, head_dim: int) -> dict[str, PartSpec]:
        groups = block_size // self.group_size
        return {"data": PartSpec((block_size, num_kv_heads, head_dim * self.bits // 8), torch.uint8),
                "scale": PartSpec((groups, num_kv_heads, head_dim), torch.float16),
                "zero": PartSpec((groups, num_kv_heads, head_dim), torch.float16)}

    def encode(self, x: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        P, bs, hkv, d = x.shape
        G = self.group_size
        xg = x.float().view(P, bs // G, G, hkv, d)  # [P, groups, G, Hkv, D]
        codes, scale, zero = asymmetric(xg, dim=2, bits=self.bits, valid=valid.view(P, bs // G, G, 1, 1))
        return {"data": pack(codes.view(P, bs, hkv, d), self.bits), "scale": scale, "zero": zero}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(parts["data"], self.bits)  # [P, bs, Hkv, D]
        P, bs, hkv, d = codes.shape
        G = self.group_size
        x = codes.view(P, bs // G, G, hkv, d).float() * parts["scale"].float()[:, :, None] \
            + parts["zero"].float()[:, :, None]
        return x.view(P, bs, hkv, d).to(dtype)

    def steps(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        scale = parts["scale"].float()  # [P, bs / G, Hkv, D]
        return scale.repeat_interleave(self.group_size, dim=1)


@dataclass
class ValueCodec(PageCodec):
    """Values: per token, over groups of `group_size` channels."""

    bits: int
    group_size: int
    token_local: ClassVar[bool] = True

    def layout(self) -> tuple[int, int, int]:
        return 2, self.bits, self.group_size

    def parts(self, block_size: int, num_kv_heads: int, head_dim: int) -> dict[str, PartSpec]:
        groups = head_dim // self.group_size
        return {"data": PartSpec((block_size, num_kv_heads, head_dim * self.bits // 8), torch.uint8),
                "scale": PartSpec((block_size, num_kv_heads, groups), torch.float16),
                "zero": PartSpec((block_size, num_kv_heads, groups), torch.float16)}

    def encode_tokens(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        *lead, d = x.shape
        xg = x.float().view(*lead, d // self.group_size, self.group_size)  # [..., D / G, G]
        codes, scale, zero = asymmetric(xg, dim=-1, bits=self.bits)
        return {"data": pack(codes.view(*lead, d), self.bits), "scale": scale, "zero": zero}

    def encode(self, x: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.encode_tokens(x)

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(parts["data"], self.bits)  # [..., D]
        *lead, d = codes.shape
        G = self.group_size
        x = codes.view(*lead, d // G, G).float() * parts["scale"].float()[..., None] + parts["zero"].float()[..., None]
        return x.view(*lead, d).to(dtype)

    def steps(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return parts["scale"].float().repeat_interleave(self.group_size, dim=-1)  # [..., D]


DEFAULT_GROUP = 32  # KIVI's group size
MIN_DERIVED_GROUP = 4  # smaller derived key groups cost more bytes than float16 (0.5 + 4 / G bytes per int4 key)
RESIDUAL_DTYPES = {"compute": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class KIVI(QuantFormat):
    """Asymmetric `bits`-bit keys (per channel) and values (per token) with a full-precision residual."""

    bits: ClassVar[int]
    packed: ClassVar[bool] = True
    backends: ClassVar[tuple[str, ...]] = ("torch", "triton")  # Triton: fused dequantisation (codec.load_packed)
    group_size: int | None = None  # tokens per key group and channels per value group (divides block_size and
    # head_dim); None: gcd(32, block_size) tokens and gcd(32, head_dim) channels (KIVI's 32 where they fit)
    residual: int = 32  # newest tokens per sequence kept in full precision (0: only the partly filled page)
    residual_dtype: str = "compute"  # the residual rows' dtype: "compute" (the model's), "float32", "bfloat16",
    # "float16" (KIVI keeps them in fp16, its model dtype on GPU: on a CPU running fp32, bfloat16 halves their bytes)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.group_size is not None and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                                            or self.group_size < 1):
            raise ValueError(f"{name}: group_size must be a positive integer or None (follow the block size and "
                             f"head_dim), got {self.group_size!r}")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"{name}: residual must be an integer >= 0 (tokens kept in full precision), "
                             f"got {self.residual!r}")
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"{name}: residual_dtype must be one of {', '.join(RESIDUAL_DTYPES)}, "
                             f"got {self.residual_dtype!r}")

    def key_group(self, block_size: int) -> int:
        """Tokens per key group in pages of `block_size`."""
        return self.group_size or math.gcd(DEFAULT_GROUP, block_size)

    def value_group(self, head_dim: int) -> int:
        """Channels per value group in heads of `head_dim`."""
        return self.group_size or math.gcd(DEFAULT_GROUP, head_dim)

    def residual_storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return RESIDUAL_DTYPES[self.residual_dtype] or compute_dtype

    def storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def codecs(self, block_size: int, head_dim: int) -> tuple[PageCodec, PageCodec]:
        return KeyCodec(self.bits, self.key_group(block_size)), ValueCodec(self.bits, self.value_group(head_dim))

    def check_shape(self, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        name = f"{type(self).__name__.lower()} (group_size={self.group_size})"
        gk, gv = self.key_group(block_size), self.value_group(head_dim)
        if head_dim % gv:
            raise ValueError(f"{name}: group_size must divide head_dim {head_dim} "
                             f"(values are quantised per token over groups of group_size channels)")
        if block_size % gk:
            raise ValueError(f"{name}: group_size must divide block_size {block_size} (keys are quantised per "
                             f"channel over groups of group_size tokens within a page); choose block_size="
                             f"{max(block_size, gk)}, a group_size that divides {block_size}, or group_size=None")
        if self.group_size is None and gk < MIN_DERIVED_GROUP:
            raise ValueError(f"{name}: block_size {block_size} would leave key groups of {gk} token(s), whose float16 "
                             f"scale and zero point per channel cost more than float16 keys; use block_size >= "
                             f"{MIN_DERIVED_GROUP} (or set group_size explicitly)")
        if head_dim % per_byte(self.bits):
            raise ValueError(f"{name}: head_dim {head_dim} must be a multiple of {per_byte(self.bits)} to pack")


@QUANT_FORMATS.register("int4")
@dataclass
class Int4(KIVI):
    """KIVI-4: two 4-bit codes per byte."""

    bits: ClassVar[int] = 4


@QUANT_FORMATS.register("int2")
@dataclass
class Int2(KIVI):
    """KIVI-2: four 2-bit codes per byte."""

    bits: ClassVar[int] = 2

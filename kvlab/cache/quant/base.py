"""The quantisation-format interface: how the KV pool stores keys and values.

A format describes its own storage: the tensors one page holds for keys and for values
(`storage`: name -> `PartSpec(shape per page, dtype)`, so packed element counts, scale and
zero-point tensors and their granularity are all visible), how many bytes that costs (a
byte budget buys proportionally more pages, scales included) and which kernel backends can
read it.

Two kinds:
- *element-wise* formats (`packed = False`: fp32 / bf16 / fp16, fp8 with a fixed scale): one
  storage element per head-dim position, `[num_pages + 1, block_size, Hkv, D]`, optionally with
  per-layer per-KV-head float32 scales fixed by the configuration (`init_scales`); every backend
  reads them.
- *packed* formats (`packed = True`: int8, int4, int2, fp8 with per-token scales): several tensors
  per page, written and read through a `PageCodec` per side (kvlab.cache.quant.page_store.PageStore holds
  them); a format with a `residual` window keeps the newest tokens of each sequence in full
  precision until their page leaves the window.
What a token's stored K/V is depends only on that token (and, for KIVI keys, its page's group) and
the configuration, never on which requests came before.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.registry import QUANT_FORMATS

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class PartSpec:
    """One tensor a page holds: `shape` per page (the pool adds a leading page dimension)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class PageCodec(ABC):
    """How one side (keys or values) of a packed format encodes a page and decodes it again."""

    token_local: ClassVar[bool] = False  # True: every token encodes alone (encode_tokens + scatter)

    @abstractmethod
    def layout(self) -> tuple[int, int, int]:
        """(kind, bits, group) for the Triton reader (kvlab.kernels.triton_kernels.codec.load_packed):
        kind 0 = symmetric int8, one scale per token per head; 1 = asymmetric, per channel over
        `group` tokens; 2 = asymmetric, per token over `group` channels."""

    @abstractmethod
    def parts(self, block_size: int, num_kv_heads: int, head_dim: int) -> dict[str, PartSpec]:
        """The tensors of one page."""

    @abstractmethod
    def encode(self, x: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [P, bs, Hkv, D] float32, valid [P, bs] bool (tokens that hold data) -> parts [P, ...]."""

    @abstractmethod
    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """parts [P, ...] -> [P, bs, Hkv, D] in `dtype`."""

    @abstractmethod
    def steps(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """parts [P, ...] -> [P, bs, Hkv, D] float32 quantisation step of every element
        (round to nearest: |x - decoded| <= step / 2)."""

    def encode_tokens(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [T, Hkv, D] float32 -> parts [T, ...] (token-local codecs: a page part is [bs, ...])."""
        raise NotImplementedError(f"{type(self).__name__} encodes whole pages only")


@dataclass
class QuantFormat(ABC):
    """Base class of cache formats; subclasses are dataclasses of their parameters."""

    packed: ClassVar[bool] = False  # storage through PageCodecs (kvlab.cache.quant.page_store); may be a property
    backends: ClassVar[tuple[str, ...]] = BACKENDS  # kernel backends that read this format

    @abstractmethod
    def storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """dtype of the pool's main tensor (the codes, for packed formats)."""

    @property
    def residual(self) -> int | None:
        """Newest tokens per sequence kept in full precision (None: no residual area)."""
        return None

    def residual_storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """dtype of the residual area's rows (the compute dtype unless the format says otherwise)."""
        return compute_dtype

    def storage(self, block_size: int, num_kv_heads: int, head_dim: int,
                compute_dtype: torch.dtype) -> tuple[dict[str, PartSpec], dict[str, PartSpec]]:
        """(key parts, value parts) of one page."""
        if self.packed:
            k, v = self.codecs(block_size, head_dim)
            return k.parts(block_size, num_kv_heads, head_dim), v.parts(block_size, num_kv_heads, head_dim)
        data = {"data": PartSpec((block_size, num_kv_heads, head_dim), self.storage_dtype(compute_dtype))}
        return data, dict(data)

    def codecs(self, block_size: int, head_dim: int) -> tuple[PageCodec, PageCodec]:
        """(key codec, value codec) of a packed format for pages of `block_size` and heads of `head_dim`."""
        raise NotImplementedError(f"{type(self).__name__} is an element-wise format (no page codecs)")

    def check_shape(self, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        """Raise ValueError when this format cannot store heads of `head_dim` in pages of `block_size`."""

    def bytes_per_token(self, num_kv_heads: int, head_dim: int, block_size: int, compute_dtype: torch.dtype) -> float:
        """Pool bytes one token costs in one layer, K and V, scales and zero points included."""
        k, v = self.storage(block_size, num_kv_heads, head_dim, compute_dtype)
        return sum(p.nbytes for p in (*k.values(), *v.values())) / block_size

    def bytes_per_element(self, compute_dtype: torch.dtype) -> float:
        return self.storage_dtype(compute_dtype).itemsize

    def init_scales(self, num_kv_heads: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale [Hkv], v_scale [Hkv]) float32 for one layer, fixed by the configuration, or None for
        unscaled storage."""
        return None


QUANT_FORMATS.base = QuantFormat

"""A tier: a byte-budgeted store of pool pages below the pool (host memory, disk).

A page travels as what the pool holds for it: the slice `t[page]` of every tensor the page layout indexes
by page (`KVCache.page_tensors()`: keys and values of every layer slot; for a packed format its codes,
scales and zero points), so a quantised page moves as its codes and scales and comes back bit for bit.
Tiers hold data only; which page goes where is the placement's (kvlab.cache.tiers.placement) and the
bookkeeping is `Places` (kvlab.cache.tiers.places); only the one door for KV moves
(kvlab.cache.paged_kv.PagedKV) calls `put` / `load` / `drop`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable

import torch


class TierReadError(RuntimeError):
    """A tier could not give a page back (a deleted or truncated file)."""


class Tier(ABC):
    """Pages by key, at most `capacity` of them (the tier's byte budget over one page's bytes)."""

    kind: str = ""

    def __init__(self, capacity: int, page_nbytes: int):
        if capacity < 1:
            raise ValueError(f"the {self.kind} tier's budget holds no page of {page_nbytes} bytes; raise its memory")
        self.capacity = capacity
        self.page_nbytes = page_nbytes

    @abstractmethod
    def put(self, key: Hashable, parts: list[torch.Tensor]) -> None:
        """Keep a copy of one page's `parts` (each `t[page]` of a pool tensor) under `key`."""

    @abstractmethod
    def load(self, key: Hashable, into: list[torch.Tensor]) -> None:
        """Copy page `key` into `into` (each `t[page]` of the pool tensors, the order of `put`); TierReadError
        if it cannot be read."""

    @abstractmethod
    def drop(self, key: Hashable) -> None:
        """Forget page `key` (its memory or file goes)."""

    @abstractmethod
    def __len__(self) -> int:
        """Pages held."""

    def readable(self, key: Hashable) -> bool:
        """Can `key` be loaded (its file is there, whole)?"""
        return True

    def close(self) -> None:
        """Drop every page and give back what the tier holds (a disk tier's files)."""

"""The host tier: pages in host memory (pinned when the pool is on a GPU, so copies can be asynchronous)."""

from __future__ import annotations

from typing import Hashable

import torch

from kvlab.cache.tiers.tier import Tier


class HostTier(Tier):
    """A dict of host tensors per page, at most `capacity` pages."""

    kind = "host"

    def __init__(self, capacity: int, page_nbytes: int, pin: bool = False):
        super().__init__(capacity, page_nbytes)
        self.pin = pin
        self.pages: dict[Hashable, list[torch.Tensor]] = {}

    def put(self, key: Hashable, parts: list[torch.Tensor]) -> None:
        if len(self.pages) >= self.capacity and key not in self.pages:
            raise RuntimeError(f"host tier full ({self.capacity} pages): the placement must make room first")
        self.pages[key] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin).copy_(t) for t in parts]

    def load(self, key: Hashable, into: list[torch.Tensor]) -> None:
        for dst, src in zip(into, self.pages.pop(key), strict=True):
            dst.copy_(src)

    def drop(self, key: Hashable) -> None:
        self.pages.pop(key, None)

    def __len__(self) -> int:
        return len(self.pages)

    def close(self) -> None:
        self.pages.clear()

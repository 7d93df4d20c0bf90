"""The host tier: pages as rows of one host slab (pinned when the pool is on a GPU, so copies can be asynchronous).

The slab is `[capacity, row_bytes]` uint8, allocated once (untouched rows cost no memory until written); a page
is one row, copied to or from the pool in one copy where the pool is one allocation (kvlab.cache.tiers.rows).
"""

from __future__ import annotations

from typing import Hashable

import torch

from kvlab.cache.tiers.tier import Fill, Tier


class HostTier(Tier):
    """At most `capacity` pages, each a row of the slab."""

    kind = "host"

    def __init__(self, capacity: int, row_bytes: int, pin: bool = False):
        super().__init__(capacity, row_bytes)
        self.pin = pin
        self.slab = torch.empty((capacity, row_bytes), dtype=torch.uint8, pin_memory=pin)  # [capacity, row]
        self.slot: dict[Hashable, int] = {}
        self.free = list(range(capacity - 1, -1, -1))

    def put(self, key: Hashable, write: Fill) -> None:
        if key not in self.slot:
            if not self.free:
                raise RuntimeError(f"host tier full ({self.capacity} pages): the placement must make room first")
            self.slot[key] = self.free.pop()
        s = self.slot[key]
        write(self.slab[s:s + 1])

    def load(self, key: Hashable, read: Fill) -> None:
        s = self.slot.pop(key)
        read(self.slab[s:s + 1])
        self.free.append(s)

    def drop(self, key: Hashable) -> None:
        s = self.slot.pop(key, None)
        if s is not None:
            self.free.append(s)

    def __len__(self) -> int:
        return len(self.slot)

    def close(self) -> None:
        self.slot.clear()
        self.free = list(range(self.capacity - 1, -1, -1))

"""Adaptive replacement placement (ARC: Megiddo & Modha, FAST 2003), one ARC per tier.

Each tier keeps T1 (pages held once) and T2 (pages that came back to the pool at least once, or whose
key was a recent victim: ghost lists B1/B2), and a target size `p` of T1 that grows on a B1 ghost hit
and shrinks on a B2 one. A full tier's victim is T1's oldest when T1 is over its target, else T2's oldest.
Keys are stable per block, so a conversation's prefix that keeps returning lands in T2 and outlives
one-off prompts. (Megiddo & Modha's REPLACE with ghost lists bounded by the tier's capacity.)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvlab.cache.tiers.placement.base import Key, Placement
from kvlab.registry import PLACEMENTS


@dataclass
class _Arc:
    capacity: int
    p: float = 0.0
    t1: OrderedDict = field(default_factory=OrderedDict)
    t2: OrderedDict = field(default_factory=OrderedDict)
    b1: OrderedDict = field(default_factory=OrderedDict)
    b2: OrderedDict = field(default_factory=OrderedDict)

    def insert(self, key: Key, returned: bool) -> None:
        if key in self.b1:
            self.p = min(self.capacity, self.p + max(len(self.b2) / max(len(self.b1), 1), 1))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / max(len(self.b2), 1), 1))
            del self.b2[key]
            self.t2[key] = None
        else:
            (self.t2 if returned else self.t1)[key] = None

    def victim(self) -> Key | None:
        if self.t1 and (len(self.t1) > self.p or not self.t2):
            return next(iter(self.t1))
        return next(iter(self.t2)) if self.t2 else None

    def remove(self, key: Key, ghost: bool) -> None:
        for live, shadow in ((self.t1, self.b1), (self.t2, self.b2)):
            if key in live:
                del live[key]
                if ghost:
                    shadow[key] = None
                    while len(shadow) > self.capacity:
                        shadow.popitem(last=False)


@PLACEMENTS.register("arc")
@dataclass
class ARCPlacement(Placement):
    """Fastest tier first; each tier's victim chosen by ARC (recency vs frequency, adaptive), spilled down."""

    arcs: list = field(default_factory=list, init=False, repr=False)
    tier_of: dict = field(default_factory=dict, init=False, repr=False)
    returned: set = field(default_factory=set, init=False, repr=False)  # keys restored at least once
    leaving: set = field(default_factory=set, init=False, repr=False)  # victims chosen, not yet removed

    def setup(self, kinds, capacities, page_bytes, block_size) -> None:
        super().setup(kinds, capacities, page_bytes, block_size)
        self.arcs = [_Arc(max(c, 1)) for c in capacities]

    def inserted(self, key: Key, tier: int) -> None:
        self.arcs[tier].insert(key, key in self.returned)
        self.tier_of[key] = tier

    def victim(self, tier: int) -> Key | None:
        key = self.arcs[tier].victim()
        if key is not None:
            self.leaving.add(key)
        return key

    def removed(self, key: Key) -> None:
        tier = self.tier_of.pop(key, None)
        if tier is not None:
            self.arcs[tier].remove(key, ghost=key in self.leaving)
        self.leaving.discard(key)

    def hit(self, key: Key) -> None:
        self.returned.add(key)

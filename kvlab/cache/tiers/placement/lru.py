"""Least recently used placement: the page held longest without a return leaves a full tier first
(vLLM's CPU offloading connector's default)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvlab.cache.tiers.placement.base import Key, Placement
from kvlab.registry import PLACEMENTS


@PLACEMENTS.register("lru")
@dataclass
class LRUPlacement(Placement):
    """Fastest tier first; a full tier's victim is its least recently inserted page, spilled one tier down."""

    order: dict = field(default_factory=dict, init=False, repr=False)  # tier -> OrderedDict of keys, oldest first
    tier_of: dict = field(default_factory=dict, init=False, repr=False)

    def inserted(self, key: Key, tier: int) -> None:
        self.order.setdefault(tier, OrderedDict())[key] = None
        self.tier_of[key] = tier

    def victim(self, tier: int) -> Key | None:
        keys = self.order.get(tier)
        return next(iter(keys)) if keys else None

    def removed(self, key: Key) -> None:
        tier = self.tier_of.pop(key, None)
        if tier is not None:
            del self.order[tier][key]

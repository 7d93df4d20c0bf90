"""Placements of pages in the tiers below the pool (registry: kvlab.registry.PLACEMENTS)."""

from kvlab.cache.tiers.placement.arc import ARCPlacement
from kvlab.cache.tiers.placement.base import Placement
from kvlab.cache.tiers.placement.cost_aware import CostAwarePlacement
from kvlab.cache.tiers.placement.lru import LRUPlacement

__all__ = ["Placement", "ARCPlacement", "CostAwarePlacement", "LRUPlacement"]

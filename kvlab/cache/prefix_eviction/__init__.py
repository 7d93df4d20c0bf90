"""Prefix-cache eviction policies (registry: kvlab.registry.PREFIX_EVICTIONS)."""

from kvlab.cache.prefix_eviction.arc import ARC
from kvlab.cache.prefix_eviction.base import PrefixEviction
from kvlab.cache.prefix_eviction.lfu import LFU
from kvlab.cache.prefix_eviction.lru import LRU
from kvlab.cache.prefix_eviction.slru import SLRU

__all__ = ["PrefixEviction", "ARC", "LFU", "LRU", "SLRU"]

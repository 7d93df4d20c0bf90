"""Allocator plugins (registry: kvlab.registry.ALLOCATORS)."""

from kvlab.cache.allocators.base import NULL_BLOCK, Allocator, OutOfBlocks
from kvlab.cache.allocators.contiguous import ContiguousAllocator
from kvlab.cache.allocators.paged import PagedAllocator

__all__ = ["NULL_BLOCK", "Allocator", "OutOfBlocks", "ContiguousAllocator", "PagedAllocator"]

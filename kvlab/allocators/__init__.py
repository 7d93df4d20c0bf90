"""Allocator plugins (registry: kvlab.registry.ALLOCATORS)."""

from kvlab.allocators.base import NULL_BLOCK, Allocator, OutOfBlocks
from kvlab.allocators.contiguous import ContiguousAllocator
from kvlab.allocators.paged import PagedAllocator

__all__ = ["NULL_BLOCK", "Allocator", "OutOfBlocks", "ContiguousAllocator", "PagedAllocator"]

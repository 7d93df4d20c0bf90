"""The prefix index by name (torch-free): the engine, the bookkeeping replay and the prefix-eviction
benchmark make theirs here."""

from __future__ import annotations

from kvlab.cache.prefix_cache import PrefixCache
from kvlab.cache.radix_cache import RadixCache


def prefix_index(kind: str | None, eviction, block_size: int, salt: bytes, match: str = "page"):
    """(the prefix index, the block manager's prefix_match) for `kind`: None (no prefix caching), 'hash'
    (pages by chained hash; `match` 'token' also shares a partly matching page) or 'radix' (a radix
    tree: matches tokens)."""
    if kind is None:
        return None, match
    if kind == "radix":
        return RadixCache(block_size, eviction, salt), "token"
    if kind == "hash":
        return PrefixCache(block_size, eviction, salt), match
    raise ValueError(f"prefix_cache must be None, 'hash' or 'radix', got {kind!r}")

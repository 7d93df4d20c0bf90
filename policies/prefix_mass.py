"""The attention a cached prefix's own queries paid its keys, kept beside its pages (H2O with prefix caching).

A policy ranking keys by accumulated attention (`needs_attention_stats`, H2O: Zhang et al. 2023,
arXiv:2306.14048) sums, for every cached key, the attention mass every query since it was cached paid it.
A prefix hit skips the queries of the tokens it reuses, so the sequence that took the hit would lack what
those queries paid. This store keeps, per prefix-cache node (the block ending at token b of a prefix),

    mass[group]: [b, its KV heads] float32 = what the queries at positions < b paid the keys at positions < b

(one entry per table: a layer's, or with per-head budgets one (layer, KV head)'s; a KV head's mass is what its
query heads paid, summed as the compressor sums it: step by step), so a hit of b tokens starts its accumulators
from exactly what a recompute of those b tokens would have accumulated; queries after the prefix add theirs as
usual.

Who writes, reads and drops it (the compressor wires it; the block manager and prefix index stay torch-free):
- `put`: the compressor, after a step that ends on a page boundary of a sequence still registering its pages
  (never compacted), before compressing it: the sequence's running totals then are exactly that block's;
- `has`: the block manager's `hit_ends`: a hit is cut back to the deepest node that has an entry;
- `get`: the compressor's `on_hit`, at admission (before the hit's pages could be copied away and evicted);
- `drop`: the prefix index's `on_unregister`, when one of the node's pages is evicted.
The tensors are never written in place (the compressor's accumulation and compaction make new ones), so an
entry and the sequences seeded from it share them.
"""

from __future__ import annotations

import torch

from kvlab.cache.prefix_cache import Node


class PrefixMass:
    """node -> {group: [b, its KV heads] attention mass of the block ending at token b from the prefix's own
    queries}."""

    def __init__(self) -> None:
        self._mass: dict[Node, dict[int, torch.Tensor]] = {}

    def put(self, node: Node, mass: dict[int, torch.Tensor]) -> None:
        """Keep `mass` for `node`, unless an entry is there already (the same prefix's, computed before)."""
        if node.alive and node.pages and node not in self._mass:
            self._mass[node] = dict(mass)

    def has(self, node: Node) -> bool:
        return node in self._mass

    def get(self, node: Node) -> dict[int, torch.Tensor]:
        """The running totals a hit ending after `node` starts from (shared: never write them in place)."""
        return dict(self._mass[node])

    def drop(self, node: Node) -> None:
        """`node` lost a page: a hit can no longer end after it."""
        self._mass.pop(node, None)

    def __len__(self) -> int:
        return len(self._mass)

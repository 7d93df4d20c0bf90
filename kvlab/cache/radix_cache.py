"""A radix tree of cached pages (SGLang's RadixAttention; Zheng et al. 2024, arXiv:2312.07104). Torch-free.

SGLang keeps every cached token in a radix tree whose edges are runs of token ids; a request walks
the tree from the root, comparing tokens, and reuses the KV of the longest match. In kvlab the KV
lives in pages of `block_size` tokens, so an edge here is one page's tokens: a full page, or, at a
leaf, the partly filled last page of a sequence that gave its pages back. Children are found by
their tokens (a dict of full pages, then a token-by-token comparison on the last edge): no hash is
ever involved, so there is nothing to collide.

Token granularity: the last edge matches up to the first token that differs; the request shares
that page up to the divergence and the paged allocator copies it before the request writes after it
(copy-on-write: a page the cache holds counts as shared). What this adds to the hashed cache
(`kvlab.cache.prefix_cache` with prefix_match="token"): when a sequence gives its pages back (finished or
preempted) its partly filled last page stays in the tree too (`retire`), so the next turn of a
conversation, or a prompt that ends inside a page, reuses every cached token, not only whole pages.

Why edges end at page boundaries instead of splitting anywhere as SGLang does: splitting an edge
inside a page would split the page (its first tokens shared, the rest private); sharing the whole
page up to the divergence and copying it on the first write after it gives the same reuse.
Everything else (reference counts in the paged allocator, cached-free pages, eviction policies, the
never-a-stale-hit rule: a page is unregistered before it is reused) is the hashed cache's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.cache.prefix_cache import Node, PrefixCache
from kvlab.cache.prefix_eviction.base import PrefixEviction


@dataclass(eq=False)
class RadixNode(Node):
    """An edge of the tree: `tokens` (one page's, at most block_size) after `parent`."""

    full: dict = field(default_factory=dict)  # tokens of a full page -> the child holding it


class RadixCache(PrefixCache):
    """Cached pages in a radix tree walked by token comparison; keeps partly filled last pages."""

    def __init__(self, block_size: int, eviction: PrefixEviction, salt: bytes = b""):
        super().__init__(block_size, eviction, salt, hash_fn=None)
        self.root_full: dict[bytes, dict[tuple, RadixNode]] = {}  # salt -> full first pages by tokens
        self.tails: dict[int, tuple[int, list[int]]] = {}  # seq id -> (computed tokens, last pages) at its last commit

    def _find(self, parent: Node | None, tokens: tuple, salt: bytes) -> tuple[int, Node | None]:
        children = parent.full if parent is not None else self.root_full.get(salt, {})
        return 0, children.get(tokens)  # tokens compared, by the dict (and the parent, by the walk)

    def _add_node(self, h: int, tokens: tuple, parent: Node | None, salt: bytes) -> Node:
        key = hash((parent.hash if parent is not None else salt, tokens))  # a hint for ghost-list evictions
        node = RadixNode(key, tokens, parent, salt)
        (parent.children if parent is not None else self.roots.setdefault(salt, [])).append(node)
        if len(tokens) == self.block_size:
            (parent.full if parent is not None else self.root_full.setdefault(salt, {}))[tokens] = node
        return node

    def _drop_from_index(self, node: Node) -> None:
        if len(node.tokens) == self.block_size:
            children = node.parent.full if node.parent is not None else self.root_full[node.salt]
            del children[node.tokens]
            if node.parent is None and not children:
                del self.root_full[node.salt]

    def commit(self, seq_id: int, token_ids: list[int], num_computed: int, salt: bytes,
               tables: list[list[int]]) -> None:
        """Register full pages (as the hashed cache does) and remember the last page of each group: its
        first `num_computed % block_size` slots hold computed KV now (a step completed)."""
        super().commit(seq_id, token_ids, num_computed, salt, tables)
        k = num_computed // self.block_size
        self.tails[seq_id] = (num_computed, [table[k] if k < len(table) else -1 for table in tables])

    def forget_sequence(self, seq_id: int) -> None:
        super().forget_sequence(seq_id)
        self.tails.pop(seq_id, None)

    def retire(self, seq_id: int, token_ids: list[int], num_computed: int, salt: bytes,
               tables: list[list[int]]) -> None:
        """Keep the partly filled last page of a sequence that gives its pages back: a leaf holding
        its `num_computed % block_size` computed tokens after its last full page (`commit` registered
        the full ones). Skipped when a cached child already serves those tokens in every group."""
        bs, salt = self.block_size, self.salt + salt
        chain = self.chains.get(seq_id, [])
        k, rem = divmod(num_computed, bs)
        if not rem or len(chain) != k or (chain and not chain[-1].alive):
            return  # no partial page, or its chain stopped registering
        pages = [table[k] if k < len(table) else -1 for table in tables]
        if self.tails.get(seq_id) != (num_computed, pages):
            return  # not what its last completed step left (a failed step may have moved the page): skip
        parent = chain[-1] if chain else None
        tokens = tuple(token_ids[k * bs:num_computed])
        siblings = parent.children if parent is not None else self.roots.get(salt, [])
        for node in siblings:
            if node.tokens[:rem] == tokens and len(node.pages) + len(node.offloaded) == len(tables):
                return  # already cached (this page, or one holding these tokens and more)
        node = next((n for n in siblings if n.tokens == tokens), None) or self._add_node(0, tokens, parent, salt)
        self._register(node, pages)
        if not node.pages:
            self._prune(node)  # a node that got no page (every candidate registered elsewhere) leaves the tree


"""Hashed prefix caching: full pages of computed tokens, findable by later requests. Torch-free.

A *block* is `block_size` consecutive tokens of a sequence starting at a multiple of `block_size`.
Block `i` of a prompt is identified by a hash chained over its parent block's hash, its tokens and
a salt (the model, the cache format, any per-request salt):

    hash_0 = H(salt, -, tokens[0:bs])        hash_i = H(salt, hash_{i-1}, tokens[i*bs:(i+1)*bs])

Each distinct block is a `Node` (its hash, its tokens, its parent node) that holds at most one page
per layer group: the layer group is the last part of a page's key. A hash is only an index: a lookup
compares the tokens, the salt and the parent *node* (object identity, itself found the same way),
so two prefixes whose hashes collide never share a page, whatever the hash function
(tests force every hash to collide).

Pages of finished requests stay registered while cached-free (no table holds them); the eviction
policy (`kvlab.cache.prefix_eviction`) picks which one the allocator reuses when it runs out of free
pages, and it is unregistered first, so a reused page never yields a stale hit. A node without
pages and children is dropped from the index; a sequence's chain through a dropped node stops
registering (a lost chance to share, never a wrong one).

Sliding-window groups share too: a hit of `h` tokens needs, in a group with window `W`, only the
pages of blocks `(h - W + 1) // bs` .. `h / bs - 1` (earlier ones are NULL in the new table, as if
released by the window); full-attention groups need every block before `h`.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from dataclasses import dataclass, field
from typing import Callable

from kvlab.cache.prefix_eviction.base import PrefixEviction

HashFn = Callable[[bytes, "int | None", tuple], int]
_UIDS = itertools.count()


def chain_hash(salt: bytes, parent: int | None, tokens: tuple) -> int:
    """64-bit BLAKE2b of (salt, parent hash, token ids)."""
    h = hashlib.blake2b(salt, digest_size=8)
    h.update(b"\x00" * 8 if parent is None else parent.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def request_salt(salt) -> bytes:
    """A request's cache salt (None, a str or bytes) as bytes; str and bytes never collide."""
    if salt is None:
        return b"n"
    if isinstance(salt, str):
        return b"s" + salt.encode("utf-8")
    if isinstance(salt, bytes):
        return b"b" + salt
    raise TypeError(f"cache_salt must be None, a str or bytes, got {type(salt).__name__}")


@dataclass(eq=False)
class Node:
    """One distinct block: `tokens` after the prefix `parent`; the page holding it in each group."""

    hash: int
    tokens: tuple
    parent: "Node | None"
    salt: bytes
    pages: dict = field(default_factory=dict)  # group -> page
    children: list = field(default_factory=list)  # nodes whose parent this is
    alive: bool = True
    offloaded: dict = field(default_factory=dict)  # group -> tier key: the block's page lives in a tier below the pool
    uid: int = field(default_factory=lambda: next(_UIDS))  # stable id (tier keys are (uid, group))


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # tokens of admitted requests that were looked up
    hit_tokens: int = 0  # of them, found in the cache (not computed)
    queried_pages: int = 0  # full pages looked up, over every layer group
    hit_pages: int = 0  # pages reused instead of allocated and computed (the pages saved)
    evictions: int = 0  # registered pages reused for other content


class PrefixCache:
    """The index of registered pages, the chain of each live sequence, and the eviction policy."""

    def __init__(self, block_size: int, eviction: PrefixEviction, salt: bytes = b"", hash_fn: HashFn = chain_hash):
        self.block_size = block_size
        self.eviction = eviction
        self.salt = salt  # the engine's: model, cache format
        self.hash_fn = hash_fn
        self.index: dict[int, list[Node]] = {}  # hash -> nodes with that hash (collisions included)
        self.page_node: dict[int, tuple[Node, int]] = {}  # registered page -> (node, group)
        self.chains: dict[int, list[Node]] = {}  # sequence id -> nodes of its committed full blocks
        self.roots: dict[bytes, list[Node]] = {}  # salt -> first blocks (for partial matches)
        self.stats = PrefixStats()
        # called with a node that loses a page (evicted): what is kept beside its pages goes with them
        # (a compressor's accumulated attention of the prefix, kvlab.policies.prefix_mass)
        self.on_unregister: list[Callable[[Node], None]] = []
        # tiers below the pool (kvlab.cache.tiers.places.Places; None: an evicted page is dropped): an evicted
        # page is demoted there and stays findable, its node's entry in `offloaded` until a hit restores it
        self.places = None
        self.offloaded_nodes: dict = {}  # tier key -> node

    def attach_places(self, places) -> None:
        """Demote evicted pages into `places`' tiers instead of dropping them."""
        self.places = places
        places.on_drop = self._lost

    # -- lookup ------------------------------------------------------------------
    def _block(self, token_ids: list[int], i: int) -> tuple:
        return tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _find(self, parent: Node | None, tokens: tuple, salt: bytes) -> tuple[int, Node | None]:
        h = self.hash_fn(salt, None if parent is None else parent.hash, tokens)
        for node in self.index.get(h, ()):
            if node.parent is parent and node.tokens == tokens and node.salt == salt:
                return h, node
        return h, None

    def match(self, token_ids: list[int], salt: bytes, max_blocks: int) -> list[Node]:
        """Nodes of the longest run of leading full blocks of `token_ids` in the index (<= max_blocks)."""
        salt = self.salt + salt
        nodes: list[Node] = []
        for i in range(max_blocks):
            _, node = self._find(nodes[-1] if nodes else None, self._block(token_ids, i), salt)
            if node is None:
                break
            nodes.append(node)
        return nodes

    def partial_match(self, parent: Node | None, tokens: list[int], salt: bytes) -> tuple[Node | None, int]:
        """The block after `parent` sharing the longest run of leading tokens with `tokens` (token
        granularity: its page serves those tokens, copied before the request writes after them)."""
        children = parent.children if parent is not None else self.roots.get(self.salt + salt, [])
        best, best_len = None, 0
        for node in children:
            n = 0
            while n < len(tokens) and n < len(node.tokens) and node.tokens[n] == tokens[n]:
                n += 1
            if n > best_len:
                best, best_len = node, n
        return best, best_len

    # -- sequences ---------------------------------------------------------------
    def start(self, seq_id: int, nodes: list[Node], pages: list[int]) -> None:
        """A sequence was admitted with the blocks `nodes`, reusing registered `pages` (its hits)."""
        self.chains[seq_id] = list(nodes)
        for page in pages:
            self.eviction.hit(page)

    def fork(self, parent_id: int, child_id: int) -> None:
        self.chains[child_id] = list(self.chains.get(parent_id, ()))

    def forget_sequence(self, seq_id: int) -> None:
        self.chains.pop(seq_id, None)

    def commit(self, seq_id: int, token_ids: list[int], num_computed: int, salt: bytes,
               tables: list[list[int]]) -> None:
        """Register the pages of every full block of computed tokens not registered yet.

        `tables[g]` is the sequence's block table in group g (cache index == token index: no
        compaction). A block already cached under another page keeps that page (this sequence's
        copy stays unregistered and is freed as usual)."""
        salt = self.salt + salt
        chain = self.chains.setdefault(seq_id, [])
        for i in range(len(chain), num_computed // self.block_size):
            parent = chain[-1] if chain else None
            if parent is not None and not parent.alive:
                return
            tokens = self._block(token_ids, i)
            h, node = self._find(parent, tokens, salt)
            if node is None:
                node = self._add_node(h, tokens, parent, salt)
            self._register(node, [table[i] if i < len(table) else -1 for table in tables])
            chain.append(node)

    def retire(self, seq_id: int, token_ids: list[int], num_computed: int, salt: bytes,
               tables: list[list[int]]) -> None:
        """`seq_id` is about to give its pages back (finished or preempted). The hashed cache keeps
        full pages only (registered by `commit`); the radix tree (kvlab.cache.radix_cache) also keeps the
        partly filled last page."""

    def _add_node(self, h: int, tokens: tuple, parent: Node | None, salt: bytes) -> Node:
        """A new node in the index and under its parent (or among the salt's roots)."""
        node = Node(h, tokens, parent, salt)
        self.index.setdefault(h, []).append(node)
        (parent.children if parent is not None else self.roots.setdefault(salt, [])).append(node)
        return node

    def _register(self, node: Node, pages: list[int]) -> None:
        """`pages[g]` (-1: none) holds `node`'s tokens in group g; registered unless taken already."""
        for g, page in enumerate(pages):
            if page >= 0 and g in node.offloaded and page not in self.page_node:
                self._discard_offloaded(node, g)  # the pool holds the block again: its tier copy goes
            if page >= 0 and g not in node.pages and page not in self.page_node:
                node.pages[g] = page
                self.page_node[page] = (node, g)
                self.eviction.register(page, node.hash)

    def _discard_offloaded(self, node: Node, group: int) -> None:
        key = node.offloaded.pop(group)
        del self.offloaded_nodes[key]
        self.places.discard(key)

    # -- pages -------------------------------------------------------------------
    def is_registered(self, page: int) -> bool:
        return page in self.page_node

    def park(self, pages: list[int]) -> None:
        """Registered pages no table holds any more: findable until evicted."""
        self.eviction.park(pages)

    def unpark(self, page: int) -> None:
        self.eviction.unpark(page)

    @property
    def num_parked(self) -> int:
        return len(self.eviction)

    def evict(self) -> int:
        """A cached-free page to reuse now, unregistered (its node drops it)."""
        page = self.eviction.evict()
        self.stats.evictions += 1
        if not (self.places is not None and self._offload(page)):
            self._unregister(page)
        return page

    # -- tiers below the pool ------------------------------------------------------
    def _offload(self, page: int) -> bool:
        """Demote evicted `page` to a tier: its node keeps the block findable (`offloaded`); False if the
        placement sends it nowhere."""
        node, group = self.page_node[page]
        key = (node.uid, group)
        node.offloaded[group] = key  # first: a drop the demotion causes must not prune this node
        self.offloaded_nodes[key] = node
        if not self.places.demote(key, page):
            del node.offloaded[group], self.offloaded_nodes[key]
            return False
        del self.page_node[page], node.pages[group]
        self.eviction.forget(page)
        return True

    def holds(self, node: Node, group: int) -> bool:
        """Does the cache hold `node`'s block in `group`, in the pool or in a tier (a page whose file was lost is
        found out when it is read: `fetch`)?"""
        return group in node.pages or group in node.offloaded

    def claim(self, entries: list[tuple[Node, int]]) -> None:
        """Offloaded (node, group) entries a request was admitted on: kept until `restore`."""
        self.places.claim([node.offloaded[g] for node, g in entries])

    def restore(self, node: Node, group: int, page: int) -> None:
        """`node`'s block in `group` comes back from its tier into fresh pool `page`, registered again."""
        self.restore_many([(node, group, page)])

    def restore_many(self, entries: list[tuple[Node, int, int]]) -> None:
        """Each (node, group, page): the block comes back from its tier into fresh pool `page` (moved together),
        registered again."""
        keys = [node.offloaded.pop(group) for node, group, _ in entries]
        for key in keys:
            del self.offloaded_nodes[key]
        self.places.restore_many([(key, page) for key, (_, _, page) in zip(keys, entries)])
        for node, group, page in entries:
            self._register(node, [page if g == group else -1 for g in range(group + 1)])

    def fetch(self, entries: list[tuple[Node, int]]) -> bool:
        """Start the reads the offloaded (node, group) `entries` need; True once all are in memory. A read that
        failed drops its entry (`_lost`): the caller looks the request up again."""
        return self.places.fetch([node.offloaded[g] for node, g in entries])

    def prefetch(self, entries: list[tuple[Node, int]]) -> int:
        """A request was added whose prefix hits these offloaded entries: the reads the placement starts now."""
        return self.places.prefetch([node.offloaded[g] for node, g in entries])

    def _lost(self, key) -> None:
        """Tier key `key` is no longer held anywhere (dropped from the last tier, or unreadable)."""
        node = self.offloaded_nodes.pop(key, None)
        if node is None:
            return
        node.offloaded.pop(key[1], None)
        for listener in self.on_unregister:
            listener(node)
        while node is not None and self._prune(node):
            node = node.parent

    def drain(self) -> None:
        """Drop every offloaded page and stop demoting (the engine closes its tiers: evicted pages are dropped
        from now on, as without tiers)."""
        if self.places is not None:
            for key in self.places.drain():
                self._lost(key)
        self.places = None

    def _unregister(self, page: int) -> None:
        node, group = self.page_node.pop(page)
        del node.pages[group]
        self.eviction.forget(page)
        for listener in self.on_unregister:
            listener(node)
        while node is not None and self._prune(node):
            node = node.parent

    def _prune(self, node: Node) -> bool:
        """Take a live node with no page and no child out of the tree; False if it must stay."""
        if not (node.alive and not node.pages and not node.offloaded and not node.children):
            return False
        self._drop_from_index(node)
        node.alive = False
        siblings = node.parent.children if node.parent is not None else self.roots[node.salt]
        siblings.remove(node)
        if node.parent is None and not siblings:
            del self.roots[node.salt]
        return True

    def _drop_from_index(self, node: Node) -> None:
        bucket = self.index[node.hash]
        bucket.remove(node)
        if not bucket:
            del self.index[node.hash]

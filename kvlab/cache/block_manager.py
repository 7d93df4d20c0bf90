"""Where every sequence's KV lives: one shared page pool, one block table per (sequence, layer group). Torch-free.

Layers are split into groups of equal layer count that attend alike (all full attention, or all the
same sliding window). A page holds `block_size` tokens of K and V for every layer of the group that
owns it, so all pages have one size and any group can draw any free page from the one pool (vLLM's
hybrid KV-cache manager): pages freed by one group (sliding out of a window, evicted by a policy)
serve any other. A Llama is one group of all its layers; Gemma 3 (5 sliding : 1 full, 18 layers)
is six groups of 3 layers, five sliding and one full. Per-layer budgets are groups of one layer.

A sequence has a logical length (its tokens; RoPE positions, owned by the scheduler) and, per
group, a number of cached slots with the table that maps them to pages. The two agree until a
policy compacts a group (fewer slots than tokens) or speculation appends tentative slots (more).

A finished compacted request's tables may be kept for its conversation's next turn (kept turns:
kvlab/cache/kept_turns.py, owned by the allocator; `keep_turn`, and `lookup` finds them: a kept turn whose
tokens start the prompt wins, else the prefix index's hit).

This is the only door into the pages: the runner asks it for tables, lengths and slot mappings; the
scheduler for admission and growth; policies for release and compaction; speculation for rollback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from kvlab.cache.allocators.base import NULL_BLOCK, Allocator
from kvlab.cache.kept_turns import KeptTurn
from kvlab.cache.prefix_cache import Node, PrefixCache, request_salt
from kvlab.sequence import Sequence

if TYPE_CHECKING:
    from kvlab.cache.quant.lease import RowClaims


@dataclass(frozen=True)
class LayerGroup:
    layers: tuple[int, ...]
    sliding_window: int | None = None  # attend to the last `sliding_window` keys only
    head: int | None = None  # the one KV head this group's pages hold (per-head budgets); None: every KV head

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else f"window{self.sliding_window}"


def equal_groups(layer_windows: list[int | None], size: int | None = None,
                 num_heads: int | None = None) -> list[LayerGroup]:
    """Split layers (window of each, None = full attention) into groups of one kind and equal size.

    The size is the gcd of the kinds' layer counts unless given (1: a table per layer, for per-layer
    eviction), so every page has the same size; layers of a kind go to groups in order (Gemma 3's
    15 sliding + 3 full layers: groups of 3). `num_heads`: a group per (layer, KV head), whose pages
    hold that head only (per-head budgets: each head keeps its own number of tokens)."""
    if num_heads is not None:
        return [LayerGroup((layer,), window, head) for layer, window in enumerate(layer_windows)
                for head in range(num_heads)]
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    size = size or math.gcd(*(len(layers) for layers in kinds.values()))
    groups = [LayerGroup(tuple(layers[i:i + size]), window)
              for window, layers in kinds.items() for i in range(0, len(layers), size)]
    return sorted(groups, key=lambda g: g.layers[0])


@dataclass(frozen=True)
class PrefixHit:
    """What a prefix-cache lookup found for a waiting sequence: its first `tokens` tokens' KV, in the
    pages of `nodes` (one per block), or in the tables of kept compressed turn `turn` (its cache holds
    fewer slots than `tokens`). `lookup` returns it, `can_allocate` and `allocate` take it."""

    seq_id: int
    tokens: int = 0
    nodes: tuple = ()
    turn: int | None = None
    recomputed: int = 0  # tier pages after the hit that recomputing beats restoring (cost model: `tier_ready`)


class BlockManager:
    def __init__(self, groups: list[LayerGroup], allocator: Allocator, num_blocks: int, block_size: int,
                 max_model_len: int, max_chunk: int | None = None, prefix_cache: PrefixCache | None = None,
                 prefix_match: str = "page", kept_tokens: Callable[[int, int], int] | None = None):
        sizes = {len(g.layers) for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"layer groups must have equal layer counts to share pages, got {sorted(sizes)}")
        self.groups = groups
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_chunk = max_chunk or max_model_len  # most tokens a sequence computes in one step
        # (group, prompt tokens) -> tokens the group keeps of the prompt when a policy compresses it after
        # every chunk (None: nothing is compressed before the prompt is in; admission counts every token)
        self.kept_tokens = kept_tokens
        self.allocator = allocator
        allocator.setup(num_blocks, block_size, max_model_len)
        self.full_groups = [g for g, group in enumerate(groups) if group.sliding_window is None]
        self.num_cow_copies = 0
        if prefix_match not in ("page", "token"):
            raise ValueError(f"prefix_match must be 'page' or 'token', got {prefix_match!r}")
        self.prefix_match = prefix_match
        if prefix_cache is not None:
            if not hasattr(allocator, "allocate_cached"):
                raise ValueError(f"prefix caching needs an allocator that shares cached pages (paged); "
                                 f"{getattr(type(allocator), 'registry_name', type(allocator).__name__)} "
                                 f"does not support it yet")
        allocator.prefix_cache = prefix_cache  # its one owner: the pool parks, evicts and hands out its pages
        # a compressing policy reads the queries of a prompt's last `recompute_tail` tokens: a hit stops before them
        # (with a residual window, before the window too); a kept-turn hit stops before the policy's (`turn_tail`)
        self.recompute_tail = 0
        self.turn_tail = 0
        # a hit's pages shared and kept whole under compaction (protected_slots); False: copied at admission
        # (the request compresses its own copy as without caching: EngineConfig.prefix_keep_shared)
        self.keep_shared = True
        # a quantised format with a residual window: (page, no sequence holds it) -> whether a hit may
        # share the page (not while it is open in another sequence's window); None: every cached page
        self.shareable: Callable[[int, bool], bool] | None = None
        self._hits: dict[int, tuple[int, set]] = {}  # seq id -> (hit tokens, {(group, page)} taken from the cache)
        # a policy ranking keys by accumulated attention: may a hit end after this node (the attention its prefix's
        # own queries paid its keys is kept there, kvlab.policies.prefix_mass)? None: any node. A hit is cut
        # back to the deepest node it holds true for; `on_hit(seq, node)` hears the hit's last node at admission
        self.hit_ends: Callable[[Node], bool] | None = None
        self.on_hit: Callable[[Sequence, Node], None] | None = None
        # called after a sequence's tables are freed (the cache gives back residual rows leased for its open pages)
        self.on_free: Callable[[], None] | None = None
        # kept compressed turns (allocator.kept_turns): a request admitted onto one hands its state to the compressor
        self.on_turn_hit: Callable[[Sequence, object], None] | None = None
        self._compacted: set[int] = set()  # sequences whose cache indices no longer follow positions
        self._on_turn: set[int] = set()  # sequences admitted onto a kept turn (and their forks): nothing protected
        # a packed format's residual rows leased from free pages (kvlab.cache.quant.lease.RowClaims; None: no rows):
        # the rows this step's writes will lease, claimed as the step is scheduled, stay free
        self.rows: RowClaims | None = None
        self._claimed_rows = 0
        self._whole_copies: set[int] = set()  # kvlab.cache.block_manager.BlockManager.take_whole_copies

    # -- tables ----------------------------------------------------------------
    def key(self, seq: Sequence | int, group: int) -> int:
        """The allocator's id of one (sequence, group) table."""
        seq_id = seq if isinstance(seq, int) else seq.seq_id
        return seq_id * len(self.groups) + group

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix index, owned by the allocator (which parks a registered page its last table lets go,
        and evicts parked pages when out of free ones); the block manager looks hits up and registers
        pages through it."""
        return self.allocator.prefix_cache

    @property
    def kept_turns(self):
        """The kept compressed turns (kvlab.cache.kept_turns.KeptTurns), owned by the allocator; None when off."""
        return getattr(self.allocator, "kept_turns", None)

    def _keys(self, seq: Sequence) -> list[int]:
        return [self.key(seq, g) for g in range(len(self.groups))]

    def _footprint(self, group: LayerGroup, num_tokens: int) -> int:
        """Tokens a group holds for a sequence of `num_tokens`: a window group never more than its
        window plus one step's chunk (its older pages are released)."""
        if group.sliding_window is None:
            return num_tokens
        return min(num_tokens, group.sliding_window + self.max_chunk + self.block_size)

    def _admission(self, g: int, seq: Sequence) -> int:
        """Tokens group `g` must find room for to admit `seq`: its footprint; with a policy compressing
        after every chunk, the most it holds before its prompt is in (what it keeps of the prompt,
        the tokens after the prompt that a recompute brings, one more chunk), if that is less."""
        group, n = self.groups[g], seq.num_tokens
        footprint = self._footprint(group, n)
        if self.kept_tokens is None or group.sliding_window is not None:
            return footprint
        prompt = min(seq.num_prompt_tokens, n)
        return min(footprint, self.kept_tokens(g, prompt) + (n - prompt) + self.max_chunk)

    # -- sizing ----------------------------------------------------------------
    def capacity_error(self, seq: Sequence) -> str | None:
        """Why `seq` could never run alone in this pool, or None."""
        a = self.allocator
        need, rows = self._peak(seq)
        if need <= a.usable_blocks:
            return None
        reserved = a.reservation(seq.num_tokens, seq.max_len)
        if reserved > seq.max_len:
            what = (f"the {getattr(type(a), 'registry_name', type(a).__name__)} allocator reserves "
                    f"max_model_len = {reserved} tokens for every request")
            fix = "raise kv_cache_memory or lower max_model_len"
        elif seq.is_scoring:
            what = f"{seq.score_from} context + {seq.num_tokens - seq.score_from} continuation tokens"
            fix = "raise kv_cache_memory or shorten the context"
        else:
            what = f"{seq.num_prompt_tokens} prompt + {seq.max_len - seq.num_prompt_tokens} new"
            fix = "raise kv_cache_memory or lower max_tokens / max_model_len"
        if len(self.groups) > 1:
            what += f", in {len(self.groups)} layer groups"
        if rows:
            what += (f"; with the residual rows of its open pages, {rows} x {self.rows.pages_per_row} pages at its "
                     f"peak, one token a step")
            fix += " or quant_args.residual"
        reserve = f" ({self.num_blocks - a.usable_blocks} kept in reserve)" if a.usable_blocks < self.num_blocks else ""
        return (f"request needs {need} blocks of {self.block_size} tokens ({what}), but the KV pool has only "
                f"{a.usable_blocks}{reserve}; {fix}")

    def lone_need(self, seq: Sequence) -> str:
        """What `seq` needs alone in the pool, as `capacity_error` counted it, against what the pool has now (the
        message of a request admitted and then stuck in an empty pool: a capacity bug)."""
        need, rows = self._peak(seq)
        a = self.allocator
        held = f" and {rows} residual rows of {self.rows.pages_per_row} pages" if rows else ""
        return (f"{seq.num_tokens} tokens ({seq.num_computed_tokens} computed, {seq.num_preemptions} preemptions), "
                f"{seq.max_len} at most; capacity_error admitted it needing {need} blocks of {self.block_size} "
                f"tokens at its peak{held}, of {a.usable_blocks} usable ({a.num_admissible_blocks} admissible now)")

    def _tables_at(self, seq: Sequence, length: int) -> int:
        """Blocks `seq`'s tables take at `length` tokens (at least what the allocator reserves at admission)."""
        a = self.allocator
        return sum(a.blocks_for(max(a.reservation(self._footprint(g, seq.num_tokens), seq.max_len),
                                    self._footprint(g, length))) for g in self.groups)

    def _peak(self, seq: Sequence) -> tuple[int, int]:
        """(blocks, residual rows) `seq` needs at its peak alone in the pool: its tables at max_len; with leased
        rows, the most its tables and their rows (RowClaims.lone_rows) take while it computes one token a step,
        as the scheduler lets a lone sequence whose chunk's rows do not fit (its chunk is halved). That most is
        reached writing one of the last `block_size` cache indices it writes (`block_size` tokens later, each
        group holds a page more and no fewer rows); the last is max_len - 2 (its last token is sampled, never
        written; a scoring request's is not computed)."""
        if self.rows is None:
            return self._tables_at(seq, seq.max_len), 0
        k, last = self.rows.pages_per_row, max(seq.max_len - 2, seq.num_tokens_to_compute - 1, 0)
        peak = (0, 0)
        for length in range(max(0, last - self.block_size + 1), last + 1):
            rows = sum(self.rows.lone_rows(length, group.sliding_window) for group in self.groups)
            peak = max(peak, (self._tables_at(seq, length + 1) + rows * k, rows))
        return peak

    # -- prefix caching ----------------------------------------------------------
    def _salt(self, seq: Sequence) -> bytes:
        return request_salt(seq.params.cache_salt)

    def lookup(self, seq: Sequence) -> PrefixHit:
        """What `seq` starts from, by one rule: a kept compressed turn whose tokens start its prompt
        (`lookup_turn`) wins when there is one; else the prefix index's hit (`lookup_prefix`). No hit without
        kept turns or a prefix cache."""
        if self.kept_turns is not None:
            hit = self.lookup_turn(seq)
            if hit.turn is not None:
                return hit
        return self.lookup_prefix(seq)

    def lookup_prefix(self, seq: Sequence) -> PrefixHit:
        """The tokens of `seq`'s prompt found in the prefix cache (never its last token to compute, nor
        past a scoring request's context end) and the nodes of their blocks: whole blocks, then
        (prefix_match="token") the leading tokens of one more cached block. No hit without a prefix cache."""
        if self.prefix_cache is None:
            return PrefixHit(seq.seq_id)
        bs, last = self.block_size, seq.num_tokens_to_compute - 1
        if seq.is_scoring:
            last = min(last, seq.score_from - 1)
        if self.recompute_tail:  # the policy's observation window is computed by this request
            last = min(last, (seq.score_from if seq.is_scoring else seq.num_prompt_tokens) - self.recompute_tail)
        last = max(last, 0)
        salt = self._salt(seq)
        nodes = self.prefix_cache.match(seq.token_ids, salt, last // bs)
        k = len(nodes)
        for g in self.full_groups:  # a full-attention group needs every page before the hit
            k = next((i for i in range(k) if not self.prefix_cache.holds(nodes[i], g)), k)
        if self.shareable is not None:  # a page open in another sequence's window is not shared
            k = next((i for i in range(k) if not all(self.shareable(p, self.allocator.num_owners(p) == 0)
                                                     for p in nodes[i].pages.values())), k)
        hit = 0
        partial = self.prefix_match == "token" and self.shareable is None  # a partial page would be reopened
        if partial and k == len(nodes) and last > k * bs:
            child, j = self.prefix_cache.partial_match(nodes[-1] if nodes else None,
                                                       seq.token_ids[k * bs:min(last, (k + 1) * bs)], salt)
            if j and all(self._has_pages(g, nodes + [child], k * bs + j) for g in range(len(self.groups))):
                nodes, hit = nodes + [child], k * bs + j
        while not hit and k and not all(self._has_pages(g, nodes[:k], k * bs) for g in range(len(self.groups))):
            k -= 1  # a window group needs the pages of the window before the hit
        if not hit:
            nodes, hit = nodes[:k], k * bs
        if self.hit_ends is not None and hit:
            nodes, hit = self._cut_to_kept_stats(nodes, hit)
        return PrefixHit(seq.seq_id, hit, tuple(nodes))

    def lookup_turn(self, seq: Sequence) -> PrefixHit:
        """The longest kept compressed turn whose tokens start `seq`'s prompt, leaving the policy's observation
        window (`turn_tail`: with prefix caching off or on alike) and the prompt's last token to compute; no hit
        for a scoring request."""
        if seq.is_scoring or not self.kept_turns:
            return PrefixHit(seq.seq_id)
        limit = min(seq.num_tokens_to_compute - 1, seq.num_prompt_tokens - self.turn_tail)
        turn_id, turn = self.kept_turns.match(seq.token_ids, self._salt(seq), limit)
        return PrefixHit(seq.seq_id) if turn is None else PrefixHit(seq.seq_id, len(turn.tokens), (), turn_id)

    def keep_turn(self, seq: Sequence, state: object = None) -> bool:
        """`seq` finished: keep its compacted tables (forked: the pages are shared, ref-counted) for a request
        whose prompt starts with the tokens they hold, with the compressor's `state` for it. Only a compacted
        generation request's (an uncompacted one's pages are what prefix caching is for); a kept turn with
        the same tokens is replaced; past the store's capacity the least recently used goes."""
        turns = self.kept_turns
        if turns is None or seq.is_scoring or seq.seq_id not in self._compacted or self.key(seq, 0) not in \
                self.allocator.tables:
            return False
        tokens, salt = tuple(seq.token_ids[:self._committed(seq)]), self._salt(seq)
        for turn_id, turn in list(turns.entries.items()):
            if turn.tokens == tokens and turn.salt == salt:
                self.allocator.free_kept_tables(turns.entries.pop(turn_id).keys)
        turn_id, keys = turns.new_keys(self.allocator.tables.__contains__)
        for g, key in enumerate(keys):
            self.allocator.fork(self.key(seq, g), key)
        turns.add(turn_id, KeptTurn(tokens, salt, keys, state))
        while turns.over_capacity():
            self.allocator.drop_kept_turn()
        return True

    def _can_allocate_turn(self, seq: Sequence, hit: PrefixHit) -> bool:
        """Room for `seq` on kept turn `hit.turn`: each group's kept slots and the new tokens in fresh pages
        (compaction rewrites the shared ones), one copy-on-write page, the turn's pages that only kept
        turns hold (they stop counting as free), and with a residual window the rows of the copies of the turn's
        open pages and of the pages the first chunk opens (`_privatize_open`)."""
        a, new = self.allocator, seq.num_tokens - hit.tokens
        keys = self.kept_turns.entries[hit.turn].keys
        need = sum(a.blocks_for(a.num_tokens(k) + new) + 1 for k in keys) + len(a.kept_pages(keys))
        if self.rows is not None:  # rows for the copies of the turn's open pages, then for what the chunk opens
            opened = sum(1 for k in keys for p in a.block_table(k) if p != NULL_BLOCK and self.rows.has_row(p))
            need += (self._claimed_rows + opened + self.rows.window_rows * len(self.groups)) * self.rows.pages_per_row
        return need <= a.num_admissible_blocks

    def _allocate_turn(self, seq: Sequence, num_tokens: int, hit: PrefixHit) -> None:
        """`seq`'s tables forked from kept turn `hit.turn` (copy-on-write), then `num_tokens` new slots: its
        cache indices no longer follow positions (it registers nothing in the prefix cache)."""
        if hit.tokens != seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} starts at token {seq.num_computed_tokens} but its kept turn "
                             f"holds {hit.tokens}")
        turn, a = self.kept_turns.entries[hit.turn], self.allocator
        self.kept_turns.touch(hit.turn, hit.tokens)  # most recently used: pages taken below drop other turns first
        for g, key in enumerate(self._keys(seq)):
            a.fork(turn.keys[g], key)
        before, copies = [a.num_tokens(k) for k in self._keys(seq)], len(a.pending_copies)
        open_copies = sum(self._privatize_open(key) for key in self._keys(seq))
        self._whole_copies |= {d for _, d in a.pending_copies[copies:]}
        for key in self._keys(seq):
            a.append_slots(key, num_tokens)
        if self.rows is not None:  # the copies' rows, then what the chunk opens
            self._claimed_rows += open_copies + sum(self.rows.new_rows(a.block_table(k), n, num_tokens)
                                                    for k, n in zip(self._keys(seq), before))
        self._compacted.add(seq.seq_id)
        self._on_turn.add(seq.seq_id)
        self._hits[seq.seq_id] = (hit.tokens, set())
        if self.on_turn_hit is not None:
            self.on_turn_hit(seq, turn.state)

    def _privatize_open(self, key: int) -> int:
        """A table just forked from a kept turn gets its own copy of the turn's pages a write would change: the
        partly filled last one, and every page open in a residual window (sealing writes its codes), so the turn
        keeps what it holds, open rows included, for any later request. Returns the open pages copied (each
        copy takes a residual row of its own when the copies are applied)."""
        a, n = self.allocator, self.allocator.num_tokens(key)
        table = a.block_table(key)
        has_row = self.rows.has_row if self.rows is not None else (lambda page: False)
        opened = {j for j, p in enumerate(table) if p != NULL_BLOCK and has_row(p)}
        last = {(n - 1) // self.block_size} if n % self.block_size else set()
        a.privatize(key, opened | last)
        return len(opened)

    def take_whole_copies(self) -> set[int]:
        """Destination pages of the pending copies that hold every token their source holds (a kept turn's,
        copied at admission): a page summary may be copied as it is (kvlab.policies.sparse_read)."""
        whole, self._whole_copies = self._whole_copies, set()
        return whole

    def _cut_to_kept_stats(self, nodes: list[Node], hit: int) -> tuple[list[Node], int]:
        """The hit cut back to the deepest whole block whose node `hit_ends` accepts (and whose pages every
        group still finds): a hit ending inside a page, or at a node without kept statistics, would skip
        queries whose attention the policy then lacks."""
        k = hit // self.block_size
        while k and not (self.hit_ends(nodes[k - 1])
                         and all(self._has_pages(g, nodes[:k], k * self.block_size) for g in range(len(self.groups)))):
            k -= 1
        return nodes[:k], k * self.block_size

    def _first_needed(self, group: int, hit: int) -> int:
        """First block a query at cache index `hit` can see in `group`."""
        window = self.groups[group].sliding_window
        return 0 if window is None else max(0, hit - window + 1) // self.block_size

    def _has_pages(self, group: int, nodes: list[Node], hit: int) -> bool:
        """Are the blocks `nodes` needs for a hit of `hit` tokens held in `group` (in the pool or a tier)?"""
        return all(self.prefix_cache.holds(nodes[i], group) for i in range(self._first_needed(group, hit), len(nodes)))

    def _cached_pages(self, group: int, nodes: list[Node], hit: int) -> list[int]:
        first = self._first_needed(group, hit)
        return [NULL_BLOCK] * first + [node.pages.get(group, NULL_BLOCK) for node in nodes[first:]]  # NULL: in a tier

    def _offloaded(self, nodes: list[Node], hit: int) -> list[tuple[int, int, Node]]:
        """(group, block index, node) of a hit's blocks whose pages are in a tier below the pool."""
        return [(g, i, nodes[i]) for g in range(len(self.groups)) for i in range(self._first_needed(g, hit), len(nodes))
                if g not in nodes[i].pages and g in nodes[i].offloaded]

    def _restore(self, seq: Sequence, nodes: list[Node], hit: int) -> None:
        """Bring a hit's offloaded blocks back into fresh pages of `seq`'s tables (after its resident hit pages
        are held: taking a page may evict a parked one), all moved together. They are claimed first, so making
        room for an evicted page never drops one of them."""
        entries = self._offloaded(nodes, hit)
        if not entries:
            return
        self.prefix_cache.claim([(node, g) for g, _, node in entries])
        self.prefix_cache.restore_many([(node, g, self.allocator.take_into(self.key(seq, g), i))
                                        for g, i, node in entries])

    # -- tiers below the pool: reads ahead, restore or recompute ---------------------
    @property
    def places(self):
        """The tiers' bookkeeping (kvlab.cache.tiers.places.Places), or None without tiers."""
        pc = self.prefix_cache
        return None if pc is None else pc.places

    def _tier_plan(self, seq: Sequence, hit: PrefixHit) -> tuple[PrefixHit, list[tuple[int, int, Node]]]:
        """`hit` as the placement wants it served, and its blocks in tiers: cut back before its first tier block
        when recomputing the blocks from there is cheaper than restoring them (`Placement.restore_pays`)."""
        nodes = list(hit.nodes)
        entries = self._offloaded(nodes, hit.tokens)
        if not entries:
            return hit, entries
        first = min(i for _, i, _ in entries)
        pages: dict[int, int] = {}
        for g, _, node in entries:
            tier = self.places.tier_of[node.offloaded[g]]
            pages[tier] = pages.get(tier, 0) + 1
        if self.places.placement.restore_pays(pages, hit.tokens - first * self.block_size, first * self.block_size):
            return hit, entries
        k = first
        while k and not all(self._has_pages(g, nodes[:k], k * self.block_size) for g in range(len(self.groups))):
            k -= 1
        nodes, tokens = nodes[:k], k * self.block_size
        if self.hit_ends is not None and tokens:
            nodes, tokens = self._cut_to_kept_stats(nodes, tokens)
        return PrefixHit(seq.seq_id, tokens, tuple(nodes), recomputed=len(entries)), []

    def tier_ready(self, seq: Sequence, hit: PrefixHit) -> PrefixHit | None:
        """The hit `seq` is admitted on, once every page it takes from a tier is in memory: reads from a slow tier
        are started here (on the tier's worker); None while one is still in flight (the request waits, others
        run). A read that failed (a page file deleted or truncated) forgets its block and `seq` is looked up
        again: that block is recomputed. Without tiers, `hit` as it is."""
        if self.places is None or hit.turn is not None:
            return hit
        while True:
            hit, entries = self._tier_plan(seq, hit)
            if not entries:
                return hit
            failed = self.places.stats.failed_reads
            if self.prefix_cache.fetch([(node, g) for g, _, node in entries]):
                return hit
            if self.places.stats.failed_reads == failed:
                self.places.stats.waits += 1
                return None
            hit = self.lookup(seq)

    def prefetch(self, seq: Sequence) -> int:
        """`seq` was just added: start the reads of the tier pages its prefix hits that the placement wants read
        before the request is scheduled (a returning conversation); how many."""
        if self.places is None or self.kept_turns is not None:
            return 0
        _, entries = self._tier_plan(seq, self.lookup(seq))
        return self.prefix_cache.prefetch([(node, g) for g, _, node in entries]) if entries else 0

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of `seq` whose KV the prefix cache holds (0 without prefix caching)."""
        return self.lookup_prefix(seq).tokens

    def commit(self, seq: Sequence) -> None:
        """`seq`'s computed tokens are final: register its full pages in the prefix cache (none once a
        policy compacted it, or it was admitted onto a kept turn: its cache indices no longer follow token
        positions, and what it computes attended to a compressed history). Only tokens already in
        `token_ids` are hashed: after a verify step the accepted drafts are computed before the engine
        appends them; the engine commits again once it has (LLMEngine._postprocess)."""
        if self.registers(seq):
            self.prefix_cache.commit(seq.seq_id, seq.token_ids, self._committed(seq), self._salt(seq),
                                     [self.allocator.block_table(k) for k in self._keys(seq)])

    @staticmethod
    def _committed(seq: Sequence) -> int:
        """Leading tokens both computed and appended (their K/V final, their ids known)."""
        return min(seq.num_computed_tokens, len(seq.token_ids))

    # -- state machine ---------------------------------------------------------
    def begin_step(self) -> None:
        """A new step is being scheduled: no rows claimed yet."""
        self._claimed_rows = 0

    def _new_rows(self, seq: Sequence, num_new_tokens: int, start: int | None = None) -> int:
        """Residual rows that writing `num_new_tokens` into `seq`'s tables (after cache index `start`, default
        each table's length) will lease."""
        a, held = self.allocator, seq.tree_slots(num_new_tokens)
        return sum(self.rows.new_rows(a.block_table(k), a.num_tokens(k) if start is None else start, num_new_tokens,
                                      held) for k in self._keys(seq))

    def _lease_requests(self, rows: int) -> list[tuple[int, int]]:
        """`rows` leases as allocation requests (a lease is a table of pages_per_row full pages)."""
        tokens = self.rows.pages_per_row * self.block_size
        return [(tokens, tokens)] * rows

    def can_allocate(self, seq: Sequence, hit: PrefixHit | None = None, num_new_tokens: int | None = None) -> bool:
        """Whether `seq`'s first chunk of `num_new_tokens` (None: as many as a step computes) fits, its prefix
        `hit` (looked up here when not given) shared."""
        if hit is not None and hit.turn is not None:
            return self._can_allocate_turn(seq, hit)
        hit = hit or self.lookup_prefix(seq)  # (no hit without a prefix cache)
        if self.rows is not None:  # the rows its first chunk opens, in every group
            pending = self._claimed_rows + len(self.groups) * self._first_rows(seq, hit.tokens, num_new_tokens)
        if self.prefix_cache is None:
            return self.allocator.can_allocate_many(
                [(self._admission(g, seq), seq.max_len) for g in range(len(self.groups))]
                + (self._lease_requests(pending) if self.rows is not None else []))
        hit, nodes = self._checked(seq, hit)
        a, need = self.allocator, 0
        for g, group in enumerate(self.groups):
            cached = [p for p in self._cached_pages(g, nodes, hit) if p != NULL_BLOCK]
            need += max(a.blocks_for(self._footprint(group, seq.num_tokens)) - len(cached), 0)
            need += sum(1 for p in cached if a.is_parked(p))  # taking a parked page back uses up a free one
            if self.kept_turns is not None:  # as does one only kept turns hold (it counted as free)
                need += len(a.kept_only(cached))
            if not self.keep_shared:  # every cached page is copied at admission: as many fresh pages
                need += len(cached)
            need += 1 if hit % self.block_size else 0  # a partly used cached page is copied before writing
        if self.rows is not None:
            need += pending * self.rows.pages_per_row
        return need <= a.num_admissible_blocks

    def _first_rows(self, seq: Sequence, start: int, num_new_tokens: int | None) -> int:
        """Rows per group a first chunk of `num_new_tokens` after the hit's `start` tokens leases (None: the most
        any chunk of up to a step's tokens does)."""
        if num_new_tokens is None:
            return self.rows.most_first_rows(start, min(seq.num_tokens - start, self.max_chunk))
        return self.rows.first_rows(start, num_new_tokens)

    def allocate(self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None) -> None:
        """Tables for `seq`: the pages of its prefix `hit` (from `lookup`; none when not given), whose
        tokens `seq.num_computed_tokens` counts, then `num_tokens` new slots."""
        hit = hit or PrefixHit(seq.seq_id)
        self._allocate(seq, num_tokens, hit)
        if self.rows is not None and hit.turn is None:  # the tables now hold the hit's pages: what the chunk opens is known
            self._claimed_rows += self._new_rows(seq, num_tokens, start=seq.num_computed_tokens)

    def _checked(self, seq: Sequence, hit: PrefixHit) -> tuple[int, list[Node]]:
        if hit.seq_id != seq.seq_id:
            raise ValueError(f"the prefix hit of sequence {hit.seq_id} was given for sequence {seq.seq_id}")
        return hit.tokens, list(hit.nodes)

    def _allocate(self, seq: Sequence, num_tokens: int, found: PrefixHit) -> None:
        hit, nodes = self._checked(seq, found)
        if found.turn is not None:
            return self._allocate_turn(seq, num_tokens, found)
        if self.prefix_cache is None:
            for key in self._keys(seq):
                self.allocator.allocate(key, num_tokens, seq.max_len)
            return
        if hit != seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} starts at token {seq.num_computed_tokens} but its prefix hit "
                             f"holds {hit}: set num_computed_tokens to the hit's tokens before allocate")
        used, saved, taken = [], 0, set()
        for g, key in enumerate(self._keys(seq)):  # every cached page first: appending may evict parked ones
            self.allocator.allocate_cached(key, self._cached_pages(g, nodes, hit), hit)
        self._restore(seq, nodes, hit)  # then the pages that were in a tier, into fresh pages
        if found.recomputed:
            self.places.stats.recomputed += found.recomputed
        for g, key in enumerate(self._keys(seq)):
            pages = list(self.allocator.block_table(key))
            used += [p for p in pages if p != NULL_BLOCK]
            taken |= {(g, p) for p in pages if p != NULL_BLOCK}
            saved += sum(1 for p in pages[:hit // self.block_size] if p != NULL_BLOCK)  # a partial page is copied
        if not self.keep_shared:  # the request's own copy of every hit page (its compaction writes in place)
            for key in self._keys(seq):
                self.allocator.privatize(key)
        for key in self._keys(seq):
            self.allocator.append_slots(key, num_tokens)
        self.prefix_cache.start(seq.seq_id, nodes[:hit // self.block_size], used)
        if hit and self.on_hit is not None:
            self.on_hit(seq, nodes[-1])
        self._hits[seq.seq_id] = (hit, taken)
        stats = self.prefix_cache.stats
        stats.queried_tokens += seq.num_tokens_to_compute
        stats.hit_tokens += hit
        stats.queried_pages += len(self.groups) * (seq.num_tokens_to_compute // self.block_size)
        stats.hit_pages += saved

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        a, requests = self.allocator, [(key, num_new_tokens) for key in self._keys(seq)]
        if not a.can_append_many(requests):
            return False
        if self.rows is None:
            return True
        pages = sum(a.blocks_to_append(key, n) for key, n in requests)
        rows = (self._claimed_rows + self._new_rows(seq, num_new_tokens)) * self.rows.pages_per_row
        return pages + rows <= a.num_admissible_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        if self.rows is not None:
            self._claimed_rows += self._new_rows(seq, num_new_tokens)
        for key in self._keys(seq):
            self.allocator.append_slots(key, num_new_tokens)

    def free(self, seq: Sequence) -> None:
        if self.registers(seq):  # the radix tree keeps the last page
            self.prefix_cache.retire(seq.seq_id, seq.token_ids, self._committed(seq), self._salt(seq),
                                     [self.allocator.block_table(k) for k in self._keys(seq)])
        for key in self._keys(seq):
            self.allocator.free(key)
        if self.prefix_cache is not None:
            self.prefix_cache.forget_sequence(seq.seq_id)
        self._hits.pop(seq.seq_id, None)
        self._compacted.discard(seq.seq_id)
        self._on_turn.discard(seq.seq_id)
        if self.on_free is not None:
            self.on_free()

    def can_fork(self, parent: Sequence) -> bool:
        """Could `fork(parent, child)` give a child its tables now (an allocator that copies, not shares)?"""
        return self.allocator.can_fork_many(self._keys(parent))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every page of `parent` (copy-on-write on the first write into a shared page)."""
        for g in range(len(self.groups)):
            self.allocator.fork(self.key(parent, g), self.key(child, g))
        if self.prefix_cache is not None:
            self.prefix_cache.fork(parent.seq_id, child.seq_id)
        if parent.seq_id in self._hits:
            self._hits[child.seq_id] = self._hits[parent.seq_id]
        if parent.seq_id in self._compacted:
            self._compacted.add(child.seq_id)
        if parent.seq_id in self._on_turn:
            self._on_turn.add(child.seq_id)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the last `num_tokens` slots of every group (rejected speculative tokens)."""
        for key in self._keys(seq):
            self.allocator.truncate(key, self.allocator.num_tokens(key) - num_tokens)

    def release_out_of_window(self, seq: Sequence) -> None:
        """Free sliding-window pages no future query of `seq` can see."""
        for g, group in enumerate(self.groups):
            if group.sliding_window is not None:
                key = self.key(seq, g)
                first_query = self.allocator.num_tokens(key)  # the next token's cache index
                self.allocator.release_before(key, first_query - group.sliding_window + 1)

    def release_blocks(self, seq: Sequence, group: int, block_indices: list[int]) -> int:
        """Free pages in the middle of a table (an eviction policy); their entries are never read."""
        return self.allocator.release_blocks(self.key(seq, group), block_indices)

    def compact(self, seq: Sequence, group: int, keep: list[int]) -> list[tuple[int, int]]:
        """Keep only cache indices `keep` of one group, moved to the front; the (src, dst) slot moves
        the cache must apply at once (kvlab.cache.kv_cache.KVCache.move_slots). A shared or cached page is
        never written (the allocator copies what it must move into a fresh page), and from now on
        `seq` registers nothing in the prefix cache."""
        self._compacted.add(seq.seq_id)
        return self.allocator.compact(self.key(seq, group), keep)

    def protected_slots(self, seq: Sequence, group: int) -> int:
        """Leading cache indices of `seq` in `group` that a compressing policy must keep in place: those
        in the leading pages it shares, held by another table too or taken from the prefix cache at
        admission (0 without prefix caching). Pages `seq` computed and registered itself, held by no one
        else, are not protected: compacting them copies the survivors out, the originals stay cached.
        Without `keep_shared` a hit's pages were copied at admission: nothing is protected; nor for a sequence
        admitted onto a kept turn (its whole history is recompressed, as without prefix caching, though every
        page it forked from the turn is held by the turn too)."""
        if self.prefix_cache is None or not self.keep_shared or seq.seq_id in self._on_turn:
            return 0
        key = self.key(seq, group)
        table, n = self.allocator.block_table(key), self.allocator.num_tokens(key)
        hits = self._hits.get(seq.seq_id, (0, set()))[1]
        k = 0
        while k < len(table) and table[k] != NULL_BLOCK and ((group, table[k]) in hits
                                                             or self.allocator.num_owners(table[k]) > 1):
            k += 1
        return min(k * self.block_size, n)

    def registers(self, seq: Sequence) -> bool:
        """Will `seq`'s computed pages be registered in the prefix cache (prefix caching on, never compacted: not
        admitted onto a kept turn, whose pages hold K/V that attended to a compressed history)?"""
        return self.prefix_cache is not None and seq.seq_id not in self._compacted

    def registered_node(self, seq: Sequence, num_tokens: int) -> Node | None:
        """The prefix-cache node of `seq`'s block ending at token `num_tokens` (a page boundary), if `seq` still
        registers (never compacted) and that block is registered in every group; else None."""
        if not self.registers(seq) or not num_tokens or num_tokens % self.block_size:
            return None
        chain = self.prefix_cache.chains.get(seq.seq_id, [])
        k = num_tokens // self.block_size
        if len(chain) < k or not chain[k - 1].alive:
            return None
        node = chain[k - 1]
        return node if len(node.pages) == len(self.groups) else None

    def num_hit_tokens(self, seq: Sequence) -> int:
        """Tokens `seq` took from the prefix cache when it was last admitted (its first computed token)."""
        return self._hits.get(seq.seq_id, (0, set()))[0]

    def take_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write page copies (src, dst)."""
        copies = self.allocator.take_copies()
        self.num_cow_copies += len(copies)
        return copies

    # -- views for the planner and the metrics -----------------------------------
    def block_tables(self, seqs: Iterable[Sequence], group: int) -> list[list[int]]:
        return [self.allocator.block_table(self.key(s, group)) for s in seqs]

    def cached_lens(self, seqs: Iterable[Sequence], group: int) -> list[int]:
        """Cached slots of each sequence in one group (its tokens, less evicted, plus tentative ones)."""
        return [self.allocator.num_tokens(self.key(s, group)) for s in seqs]

    def slot_ids(self, seq: Sequence, group: int, start: int, end: int) -> list[int]:
        """Slots of cache indices [start, end) of `seq` in one group."""
        return self.allocator.slot_ids(self.key(seq, group), start, end)

    def cached_total(self, seq: Sequence) -> int:
        """Slots `seq` has written over the full-attention groups (for the waste figures)."""
        return sum(self.allocator.num_tokens(self.key(seq, g)) for g in self.full_groups)

    def num_used_blocks(self) -> int:
        return self.allocator.num_used_blocks

    def group_usage(self, seqs: Iterable[Sequence]) -> dict[str, int]:
        """Pages held by `seqs`, per kind of layer group ("full", "window512", ...)."""
        seqs = list(seqs)
        usage: dict[str, int] = {}
        for g, group in enumerate(self.groups):
            usage[group.kind] = usage.get(group.kind, 0) + sum(self._live_blocks(self.key(s, g)) for s in seqs)
        return usage

    def _live_blocks(self, key: int) -> int:
        return sum(1 for b in self.allocator.block_table(key) if b != NULL_BLOCK)

    def waste_view(self, seq: Sequence) -> tuple[int, int]:
        """(allocated, written) slots of `seq` over the full-attention groups, for the waste figures."""
        a = self.allocator
        keys = [self.key(seq, g) for g in self.full_groups]
        return sum(a.allocated_slots(k) for k in keys), sum(a.num_tokens(k) for k in keys)

    def external_fragmentation(self, seq: Sequence) -> int:
        """Free slots the next waiting request could not use (contiguous allocation only)."""
        a = self.allocator
        return a.external_fragmentation(a.reservation(seq.num_tokens, seq.max_len))

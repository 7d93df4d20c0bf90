"""Compressed conversation turns kept for the next turn (EngineConfig.reuse_compressed). Torch-free.

A request that a compressing policy compacted registers nothing in the prefix cache (its cache indices
no longer follow token positions). With this store, when such a request finishes its compacted tables
(every layer group's kept slots, RoPE already applied to the keys) are forked into tables the store
owns, keyed by the tokens they cover (the prompt and the output, less the last sampled token, whose KV
was never written), with the compressor's state a continuation needs (an opaque value: H2O's accumulated
attention of the kept keys). A later request whose prompt starts with exactly those tokens is admitted
onto a copy-on-write fork of them and computes only the rest.

Ownership: the paged allocator owns the store (`PagedAllocator.kept_turns`), as it owns the prefix index:
the store's tables are allocator tables under negative keys (`table_key`), so their pages are ref-counted
like any table's. A page only kept turns hold counts as free (`PagedAllocator.num_free_blocks`); when the
pool runs out of free pages the allocator drops the least recently used turn (`evict`) and frees its
tables. A turn also goes when more than `capacity` are kept. Nothing else drops one: a turn that was
hit stays, the next turn of the conversation keeps its own.

With prefix caching beside the store, a request takes a kept turn when one matches, else the prefix index's
hit (`BlockManager.lookup`); a request admitted onto a turn registers nothing (its K/V attended to a compressed
history). A turn whose request hit the prefix cache holds the registered pages it kept in place: held by a
table, they are never parked nor evicted; dropping the turn parks them, findable.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False)
class KeptTurn:
    tokens: tuple  # the token ids whose (compressed) KV the tables hold
    salt: bytes  # the request's cache salt: a turn serves only requests with the same salt
    keys: list[int]  # the allocator tables, one per layer group
    state: object = None  # the compressor's state for a continuation (kvlab.policies.compressor.Compressor.turn_state)


@dataclass
class KeptTurnStats:
    kept: int = 0  # finished requests whose compressed tables were kept
    hits: int = 0  # requests admitted onto a kept turn
    hit_tokens: int = 0  # tokens those requests did not compute
    evictions: int = 0  # turns dropped for room (pool pressure or capacity)


@dataclass
class KeptTurns:
    num_groups: int
    capacity: int = 64  # most turns kept; the least recently used goes first
    entries: OrderedDict = field(default_factory=OrderedDict)  # turn id -> KeptTurn, least recently used first
    stats: KeptTurnStats = field(default_factory=KeptTurnStats)
    _next: int = 0

    def table_key(self, turn_id: int, group: int) -> int:
        """The allocator key of a kept turn's table in `group` (negative: never a sequence's)."""
        return -(turn_id + 1) * self.num_groups + group

    def new_keys(self, taken=lambda key: False) -> tuple[int, list[int]]:
        """(a fresh turn id, its table keys) for `add`: none of them `taken` (the allocator's other negative
        keys: a packed format's residual-row leases, kvlab.cache.quant.lease)."""
        while True:
            turn_id, self._next = self._next, self._next + 1
            keys = [self.table_key(turn_id, g) for g in range(self.num_groups)]
            if not any(taken(k) for k in keys):
                return turn_id, keys

    def add(self, turn_id: int, turn: KeptTurn) -> None:
        self.entries[turn_id] = turn
        self.stats.kept += 1

    def over_capacity(self) -> bool:
        return len(self.entries) > self.capacity

    def match(self, token_ids: list[int], salt: bytes, limit: int) -> tuple[int | None, KeptTurn | None]:
        """The longest kept turn whose tokens are exactly the first tokens of `token_ids`, covering at most
        `limit` of them (the request computes at least its last prompt token); (None, None) if none."""
        best_id, best = None, None
        for turn_id, turn in self.entries.items():
            n = len(turn.tokens)
            if turn.salt == salt and n <= limit and (best is None or n > len(best.tokens)) \
                    and tuple(token_ids[:n]) == turn.tokens:
                best_id, best = turn_id, turn
        return best_id, best

    def touch(self, turn_id: int, tokens: int) -> None:
        """A request was admitted onto turn `turn_id`, reusing `tokens` tokens: most recently used now."""
        self.entries.move_to_end(turn_id)
        self.stats.hits += 1
        self.stats.hit_tokens += tokens

    def evict(self) -> KeptTurn:
        """Take the least recently used turn out (the allocator frees its tables)."""
        _, turn = self.entries.popitem(last=False)
        self.stats.evictions += 1
        return turn

    def table_keys(self) -> list[int]:
        return [k for turn in self.entries.values() for k in turn.keys]

    def __len__(self) -> int:
        return len(self.entries)

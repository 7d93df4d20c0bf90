"""The allocator interface: where a sequence's KV slots live in one pool.

An allocator manages the physical blocks of one KV pool (one per layer group:
every layer in the group uses the same block ids in its own tensors) and the
block table of every sequence stored in it. It is pure bookkeeping: no torch.

State machine, per table (vLLM / nano-vllm vocabulary):
    can_allocate -> allocate -> (can_append -> append_slots)* -> free
    fork(parent, child)     shares the parent's blocks (copy-on-write)
    truncate(seq, n)        rolls back tentative (speculative) tokens
    release_before(seq, p)  frees blocks wholly before cache index p (sliding window)
    release_blocks(seq, i)  frees the blocks at table indices i (their entries become NULL_BLOCK)
    compact(seq, keep)      keeps only the cache indices `keep`, moved to the front; frees the rest

The engine's block manager keeps one table per (sequence, layer group) in one
shared pool, so a "sequence id" here is any integer key of a table; the
`*_many` queries answer for several tables drawn from the pool at once.

Slot ids are `block * block_size + offset`; a table entry of NULL_BLOCK marks a
block that was released (its tokens are no longer attended to).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvlab.registry import ALLOCATORS

NULL_BLOCK = -1


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; callers check can_* first."""


@dataclass
class Allocator(ABC):
    """Base class of allocator plugins. Subclasses are dataclasses of their parameters."""

    num_blocks: int = field(default=0, init=False, repr=False)
    block_size: int = field(default=0, init=False, repr=False)
    # the prefix index (kvlab.cache.prefix_cache / radix_cache) of an allocator that shares cached pages
    # (`allocate_cached`): the pool owns it and the pages it parks; None without prefix caching
    prefix_cache = None

    def setup(self, num_blocks: int, block_size: int, max_model_len: int | None = None) -> None:
        """Size the pool; called once by the engine before any request."""
        if num_blocks < 1:
            raise ValueError(f"allocator needs at least one block, got num_blocks={num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len if max_model_len is not None else num_blocks * block_size
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self._reset()

    @abstractmethod
    def _reset(self) -> None:
        """Initialise the free-space structures for a pool of `num_blocks`."""

    # -- admission -----------------------------------------------------------
    @abstractmethod
    def can_allocate(self, num_tokens: int, max_tokens: int) -> bool:
        """Could a new sequence get room for `num_tokens` now (it may grow to `max_tokens`)?"""

    @abstractmethod
    def allocate(self, seq_id: int, num_tokens: int, max_tokens: int) -> None:
        """Give a new sequence slots for its first `num_tokens` tokens."""

    # -- growth --------------------------------------------------------------
    @abstractmethod
    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        """Is there room to extend `seq_id` by `num_new_tokens` slots?"""

    @abstractmethod
    def append_slots(self, seq_id: int, num_new_tokens: int) -> None:
        """Extend `seq_id` by `num_new_tokens` slots (copy-on-write copies land in pending_copies)."""

    # -- release -------------------------------------------------------------
    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Return every block of `seq_id` to the pool (shared blocks when their last owner goes)."""

    @abstractmethod
    def fork(self, parent_id: int, child_id: int) -> None:
        """Make `child_id` a sequence with the same cached tokens as `parent_id`."""

    @abstractmethod
    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Shrink `seq_id` to its first `num_tokens` slots (reject speculative tokens)."""

    @abstractmethod
    def release_before(self, seq_id: int, token_index: int) -> int:
        """Free the blocks of `seq_id` that hold only tokens before `token_index`; returns how many."""

    # -- queries -------------------------------------------------------------
    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence."""

    @property
    def num_admissible_blocks(self) -> int:
        """Free blocks a new claim may take: the free ones less those the watermark keeps back (the one
        count admission and growth checks read)."""
        return self.num_free_blocks - (self.num_blocks - self.usable_blocks)

    def can_fork_many(self, seq_ids: list[int]) -> bool:
        """Could `fork` give a child of each of `seq_ids` its table now? (Default: forks share pages.)"""
        return True

    def reservation(self, num_tokens: int, max_tokens: int) -> int:
        """Slots a new sequence takes at admission (on-demand allocators: just `num_tokens`)."""
        return num_tokens

    def external_fragmentation(self, num_tokens: int) -> int:
        """Free slots that a request needing `num_tokens` slots could not use (0 for paging)."""
        return 0

    def can_allocate_many(self, requests: list[tuple[int, int]]) -> bool:
        """Could new tables for every (num_tokens, max_tokens) in `requests` be allocated together now?
        (Default: on-demand allocators without fragmentation, like paging.)"""
        need = sum(self.blocks_for(self.reservation(n, m)) for n, m in requests)
        return need <= self.num_admissible_blocks

    def blocks_to_append(self, seq_id: int, num_new_tokens: int) -> float:
        """Free blocks that `append_slots(seq_id, num_new_tokens)` would take (inf if it cannot grow)."""
        return 0 if self.can_append(seq_id, num_new_tokens) else float("inf")

    def can_append_many(self, requests: list[tuple[int, int]]) -> bool:
        """Is there room to extend every (seq_id, num_new_tokens) of `requests` together?"""
        return sum(self.blocks_to_append(s, n) for s, n in requests) <= self.num_free_blocks

    def release_blocks(self, seq_id: int, block_indices: list[int]) -> int:
        """Free the blocks at these table indices (their entries become NULL_BLOCK); returns how many."""
        raise NotImplementedError(f"{type(self).__name__} cannot release single blocks")

    def compact(self, seq_id: int, keep: list[int]) -> list[tuple[int, int]]:
        """Keep only cache indices `keep` (sorted), moved to the front in order; free what is left over.

        Returns the (src_slot, dst_slot) moves the cache must make before anything else is written
        (all reads before writes: see kvlab.kernels.ops.compact_slots)."""
        raise NotImplementedError(f"{type(self).__name__} cannot compact a table")

    def _check_keep(self, seq_id: int, keep: list[int]) -> None:
        n = self.lengths[seq_id]
        if any(b <= a for a, b in zip(keep, keep[1:])) or (keep and not 0 <= keep[0] <= keep[-1] < n):
            raise ValueError(f"keep must be sorted, distinct cache indices of sequence {seq_id} in [0, {n})")
        table, bs = self.tables[seq_id], self.block_size
        if any(table[i // bs] == NULL_BLOCK for i in keep):
            raise ValueError(f"sequence {seq_id}: cannot keep cache indices in released blocks")

    @property
    def usable_blocks(self) -> int:
        """Blocks one sequence could ever hold (the pool, less any admission reserve)."""
        return self.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]

    def num_tokens(self, seq_id: int) -> int:
        return self.lengths[seq_id]

    def allocated_slots(self, seq_id: int) -> int:
        """Slots held by `seq_id` (live blocks x block_size)."""
        return sum(1 for b in self.tables[seq_id] if b != NULL_BLOCK) * self.block_size

    def slot_ids(self, seq_id: int, start: int, end: int) -> list[int]:
        """Physical slot ids of cache positions [start, end) of `seq_id`."""
        table, bs = self.tables[seq_id], self.block_size
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    def take_copies(self) -> list[tuple[int, int]]:
        """Block copies (src, dst) the cache must perform before the next forward."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


ALLOCATORS.base = Allocator

"""Contiguous reservation: the pre-PagedAttention baseline (Orca, FasterTransformer).

At admission a sequence reserves one contiguous run of slots for the longest it
may become (`max_tokens`: the request's prompt plus max new tokens, the default
`reserve="request"`; the engine's max_model_len with `reserve="max_model_len"`; the request's
length rounded up to a power of two with `reserve="pow2"`: Orca (Oracle / Max / Pow2) in Kwon et
al.'s Fig. 2), first fit. Nothing is shared; the unwritten part of each reservation and the holes
between reservations are the 60-80% waste of Kwon et al. 2023 (arXiv:2309.06180), §3. The default
reserves what a request can use, so the default model's requests fit the default pool (a
max_model_len reservation of SmolLM2's 8,192 tokens is more than 256 MiB holds); the waste
studies choose `reserve` explicitly.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvlab.cache.allocators.base import Allocator, OutOfBlocks
from kvlab.registry import ALLOCATORS


@ALLOCATORS.register("contiguous")
@dataclass
class ContiguousAllocator(Allocator):
    """One contiguous reservation per sequence, sized for its maximum length, first fit."""

    reserve: str = "request"  # "request" (prompt + max new tokens) | "max_model_len" (classic Orca Max) |
    # "pow2" (the request's length rounded up to a power of two)

    def __post_init__(self) -> None:
        if self.reserve not in ("max_model_len", "request", "pow2"):
            raise ValueError(f"contiguous.reserve must be 'request', 'max_model_len' or 'pow2', got {self.reserve!r}")

    def _reset(self) -> None:
        self.runs: list[tuple[int, int]] = [(0, self.num_blocks)]  # sorted free (start, length)
        self.reserved: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return sum(n for _, n in self.runs)

    def _find(self, n: int) -> int | None:
        for i, (_, length) in enumerate(self.runs):
            if length >= n:
                return i
        return None

    def _take(self, n: int) -> int:
        i = self._find(n)
        if i is None:
            raise OutOfBlocks(f"no contiguous run of {n} free blocks")
        start, length = self.runs[i]
        if length == n:
            del self.runs[i]
        else:
            self.runs[i] = (start + n, length - n)
        return start

    def _give_back(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self.runs, (start, 0))
        self.runs.insert(i, (start, n))
        if i + 1 < len(self.runs) and start + n == self.runs[i + 1][0]:
            self.runs[i] = (start, n + self.runs[i + 1][1])
            del self.runs[i + 1]
        if i > 0 and self.runs[i - 1][0] + self.runs[i - 1][1] == start:
            prev = self.runs[i - 1]
            self.runs[i - 1] = (prev[0], prev[1] + self.runs[i][1])
            del self.runs[i]

    def reservation(self, num_tokens: int, max_tokens: int) -> int:
        limit = self.max_model_len if self.reserve == "max_model_len" else max_tokens
        if self.reserve == "pow2":
            limit = min(1 << max(limit - 1, 0).bit_length(), max(self.max_model_len, limit))
        return max(num_tokens, limit)

    def can_allocate(self, num_tokens: int, max_tokens: int) -> bool:
        return self._find(self.blocks_for(self.reservation(num_tokens, max_tokens))) is not None

    def allocate(self, seq_id: int, num_tokens: int, max_tokens: int) -> None:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        n = max(1, self.blocks_for(self.reservation(num_tokens, max_tokens)))
        start = self._take(n)
        self.reserved[seq_id] = n
        self.tables[seq_id] = list(range(start, start + n))
        self.lengths[seq_id] = num_tokens

    def can_allocate_many(self, requests: list[tuple[int, int]]) -> bool:
        runs = [length for _, length in self.runs]  # first fit, simulated on the free runs' lengths
        for num_tokens, max_tokens in requests:
            n = max(1, self.blocks_for(self.reservation(num_tokens, max_tokens)))
            i = next((i for i, length in enumerate(runs) if length >= n), None)
            if i is None:
                return False
            runs[i] -= n
        return True

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        return self.lengths[seq_id] + num_new_tokens <= self.reserved[seq_id] * self.block_size

    def append_slots(self, seq_id: int, num_new_tokens: int) -> None:
        if not self.can_append(seq_id, num_new_tokens):
            raise OutOfBlocks(f"sequence {seq_id} would outgrow its contiguous reservation")
        self.lengths[seq_id] += num_new_tokens

    def free(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id)  # release_before never punches holes here
        self._give_back(table[0], len(table))
        del self.lengths[seq_id], self.reserved[seq_id]

    def can_fork_many(self, seq_ids: list[int]) -> bool:
        """A child copies its parent's whole reservation: is there a run for each, taken first-fit in turn?"""
        runs = list(self.runs)
        for seq_id in seq_ids:
            n = self.reserved[seq_id]
            i = next((i for i, (_, length) in enumerate(runs) if length >= n), None)
            if i is None:
                return False
            start, length = runs[i]
            runs[i] = (start + n, length - n)
        return True

    def fork(self, parent_id: int, child_id: int) -> None:
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        n = self.reserved[parent_id]
        start = self._take(n)
        self.reserved[child_id] = n
        self.tables[child_id] = list(range(start, start + n))
        self.lengths[child_id] = self.lengths[parent_id]
        used = self.blocks_for(self.lengths[parent_id])
        self.pending_copies.extend(zip(self.tables[parent_id][:used], self.tables[child_id][:used]))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.lengths[seq_id]:
            raise ValueError(f"cannot truncate sequence {seq_id} of {self.lengths[seq_id]} tokens to {num_tokens}")
        self.lengths[seq_id] = num_tokens  # the reservation stays

    def release_before(self, seq_id: int, token_index: int) -> int:
        return 0  # a contiguous reservation is held whole until the sequence ends

    def allocated_slots(self, seq_id: int) -> int:
        return self.reserved[seq_id] * self.block_size

    def external_fragmentation(self, num_tokens: int) -> int:
        need = self.blocks_for(num_tokens)
        return sum(n for _, n in self.runs if n < need) * self.block_size

    def compact(self, seq_id: int, keep: list[int]) -> list[tuple[int, int]]:
        """Kept tokens move to the front of the reservation, which stays held whole."""
        self._check_keep(seq_id, keep)
        start = self.tables[seq_id][0] * self.block_size
        self.lengths[seq_id] = len(keep)
        return [(start + j, start + i) for i, j in enumerate(keep) if i != j]

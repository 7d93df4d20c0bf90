"""A tier: a byte-budgeted store of pool pages below the pool (host memory, disk).

A page travels as one row of bytes (kvlab.cache.tiers.rows.PageRows): the slice `t[page]` of every tensor the
page layout indexes by page (`KVCache.page_tensors()`: keys and values of every layer slot; for a packed format
its codes, scales and zero points) at fixed offsets, so a quantised page moves as its codes and scales and comes
back bit for bit. A tier sees rows only: `put(key, write)` hands `write` a `[1, row_bytes]` buffer to fill (the
host tier's own slab row, the disk tier's staging row), `load(key, read)` hands `read` the page's row.

Slow tiers (disk) write behind: `put` may return before the page is on disk (the disk tier's worker writes it);
such a page is held, counted and ready (served from the row the write still holds); `flush()` waits for the writes.
Slow tiers read ahead: `start_read(key)` begins bringing a page's row into memory (on a worker thread, or
at once), `ready(key)` says it is there (a `load` then needs no I/O), `poll()` reports the reads that finished
since the last call (with their error, if the file was deleted or truncated), `wait()` blocks until one does.
The scheduler admits a request only once every page of its hit is ready (docs/design.md, "Tiers below the pool").

Tiers hold data only; which page goes where is the placement's (kvlab.cache.tiers.placement) and the
bookkeeping is `Places` (kvlab.cache.tiers.places); only the one door for KV moves
(kvlab.cache.paged_kv.PagedKV) calls `put` / `load` / `drop` / `start_read`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Hashable

import torch

Fill = Callable[[torch.Tensor], None]  # a [n, row_bytes] uint8 buffer -> filled / consumed


class TierReadError(RuntimeError):
    """A tier could not give a page back (a deleted or truncated file)."""


class Tier(ABC):
    """Pages by key, at most `capacity` of them (the tier's byte budget over one page's row)."""

    kind: str = ""

    def __init__(self, capacity: int, row_bytes: int):
        if capacity < 1:
            raise ValueError(f"the {self.kind} tier's budget holds no page of {row_bytes} bytes; raise its memory")
        self.capacity = capacity
        self.row_bytes = row_bytes

    @abstractmethod
    def put(self, key: Hashable, write: Fill) -> None:
        """Keep one page under `key`: `write` fills the [1, row_bytes] row it is given."""

    @abstractmethod
    def load(self, key: Hashable, read: Fill) -> None:
        """Hand page `key`'s row ([1, row_bytes]) to `read`, then forget the page; TierReadError if it cannot
        be read."""

    @abstractmethod
    def drop(self, key: Hashable) -> None:
        """Forget page `key` (its memory or file goes; a read in flight is abandoned)."""

    @abstractmethod
    def __len__(self) -> int:
        """Pages held."""

    # -- reading ahead (slow tiers) ------------------------------------------------
    def ready(self, key: Hashable) -> bool:
        """Is `key`'s row in memory (a `load` needs no I/O)?"""
        return True

    def start_read(self, key: Hashable) -> None:
        """Begin bringing `key`'s row into memory (no-op where it is)."""

    def poll(self) -> list[tuple[Hashable, str | None]]:
        """Reads finished since the last call: (key, None) now ready, or (key, why it failed)."""
        return []

    def wait(self) -> None:
        """Block until a read in flight finishes (no-op when none is)."""

    def read_seconds(self, keys: list[Hashable]) -> float:
        """Seconds the file reads of `keys` took (reads ahead finished, or the last `load`s), forgotten once told."""
        return 0.0

    def behind_seconds(self) -> float:
        """CPU seconds this tier spends on one page off the caller's thread (a file write behind, the file's
        removal): what the step loses to it on cores with none free (0: none)."""
        return 0.0

    @property
    def in_flight(self) -> int:
        """Reads started and not yet reported by `poll`."""
        return 0

    def flush(self) -> None:
        """Wait until every write in flight is done (a write-behind tier; no-op elsewhere)."""

    def close(self) -> None:
        """Drop every page and give back what the tier holds (a disk tier's files, its worker)."""

"""A slow tier for deterministic tests of reads ahead: its reads complete only when the test says so.

    tier = manual_tier(llm)          # replaces the engine's disk tier (before any page went down)
    ... llm.engine.step() ...        # a request whose hit needs a page of `tier` waits; others run
    tier.complete()                  # every read started so far arrives (or fails: complete(fail=True))

A `load` of a page whose read has not arrived raises: no step may read a page in flight.
"""

from __future__ import annotations

from typing import Hashable

from kvlab.cache.tiers.store import HostTier
from kvlab.cache.tiers.tier import Fill


class ManualTier(HostTier):
    """Host memory behind a disk tier's interface; reads ahead complete on `complete`, or on `wait` (the engine
    blocks only when nothing else can run) unless `hold` is set."""

    kind = "disk"

    def __init__(self, capacity: int, row_bytes: int):
        super().__init__(capacity, row_bytes)
        self.arrived: set = set()
        self.pending: list = []
        self.done: list[tuple[Hashable, str | None]] = []
        self.started: list = []  # every read started, in order
        self.failed: set = set()  # keys whose read failed (their data is gone)
        self.hold = False  # True: `wait` completes nothing (a test that must see the engine wait)

    def put(self, key: Hashable, write: Fill) -> None:
        self.arrived.discard(key)
        super().put(key, write)

    def ready(self, key: Hashable) -> bool:
        return key in self.arrived

    def start_read(self, key: Hashable) -> None:
        if key not in self.arrived and key not in self.pending:
            self.pending.append(key)
            self.started.append(key)

    def complete(self, keys=None, fail: bool = False) -> int:
        """Reads of `keys` (default: every read in flight) arrive, or fail; how many."""
        keys = list(self.pending) if keys is None else [k for k in keys if k in self.pending]
        for key in keys:
            self.pending.remove(key)
            if fail:
                self.failed.add(key)
                self.done.append((key, "the test failed this read"))
            else:
                self.arrived.add(key)
                self.done.append((key, None))
        return len(keys)

    def poll(self) -> list[tuple[Hashable, str | None]]:
        done, self.done = self.done, []
        return done

    def wait(self) -> None:
        if not self.hold:
            self.complete()

    @property
    def in_flight(self) -> int:
        return len(self.pending) + len(self.done)

    def load(self, key: Hashable, read: Fill) -> None:
        self._check([key])
        self.arrived.discard(key)
        super().load(key, read)

    def _check(self, keys: list[Hashable]) -> None:
        late = [k for k in keys if k not in self.arrived]
        if late:
            raise AssertionError(f"a step read {len(late)} page(s) whose read has not arrived: {late[:3]}")

    def drop(self, key: Hashable) -> None:
        self.arrived.discard(key)
        if key in self.pending:
            self.pending.remove(key)
        self.done = [(k, e) for k, e in self.done if k != key]
        super().drop(key)


def manual_tier(llm) -> ManualTier:
    """Replace `llm`'s disk tier (engine `offload="disk"` or `"host_disk"`, nothing demoted yet) by a ManualTier."""
    kv = llm.engine.kv
    t = next(i for i, tier in enumerate(kv.tiers) if tier.kind == "disk")
    old = kv.tiers[t]
    if len(old):
        raise ValueError("the disk tier holds pages already: install the manual tier before any page goes down")
    kv.tiers[t] = ManualTier(old.capacity, old.row_bytes)
    old.close()
    return kv.tiers[t]

"""A sequence's lifecycle events, announced in one place.

Components that keep per-sequence state (the compressor's recorded queries and accumulated attention,
the speculator's draft lengths and its draft's shadows, the engine's random streams) subscribe once;
the engine announces each event instead of calling each one's cleanup:

    dropped    its KV is gone and it will be recomputed from its tokens (preempted, or put back in
               the queue after a failed step): state a recompute rebuilds must go
    finished   it stopped (its pages are already freed by the scheduler)
    aborted    it was stopped by the user, or a sample spawned by a failed step was discarded

A subscriber has `on_sequence(event, seq)` and `num_tracked()` (the sequences it still keeps state for:
tests/engine/test_lifecycle_leaks.py checks every subscriber is at 0 once all requests are done).
"""

from __future__ import annotations

from typing import Iterable, Protocol

from kvlab.sequence import Sequence

EVENTS = ("dropped", "finished", "aborted")


class Subscriber(Protocol):
    def on_sequence(self, event: str, seq: Sequence) -> None: ...

    def num_tracked(self) -> int: ...


class Lifecycle:
    def __init__(self) -> None:
        self.subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber | None) -> None:
        if subscriber is not None:
            self.subscribers.append(subscriber)

    def emit(self, event: str, seqs: Iterable[Sequence]) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown sequence event {event!r}; one of {EVENTS}")
        for seq in list(seqs):
            for subscriber in self.subscribers:
                subscriber.on_sequence(event, seq)

    def tracked(self) -> dict[str, int]:
        """Subscribers still keeping state for some sequence -> how many."""
        counts = {type(s).__name__: s.num_tracked() for s in self.subscribers}
        return {name: n for name, n in counts.items() if n}

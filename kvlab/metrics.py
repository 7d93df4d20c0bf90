"""Run metrics: throughput, latency, KV usage and the seed essay's waste breakdown. Torch-free.

Waste is measured every step on the pool that requests compete for (the
full-attention group) as fractions of its slots, in the three kinds of Kwon
et al. 2023 (arXiv:2309.06180, §3), averaged over steps:

- internal fragmentation: slots a sequence holds that it will never fill
  (beyond its final length: over-reservation, or the empty tail of its last block);
- reservation waste: slots held for tokens the sequence will write later;
- external fragmentation: free slots that the next waiting request cannot use
  (holes smaller than its contiguous reservation; zero for paging).

A sequence's final length is only known when it finishes, so its per-step
(allocated, written) pairs are kept until then.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


@dataclass
class Metrics:
    pool_slots: int
    num_blocks: int
    start_time: float | None = None
    end_time: float | None = None
    num_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    num_requests: int = 0
    preemptions: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    blocks_used: list[int] = field(default_factory=list)
    concurrent: list[int] = field(default_factory=list)
    external: list[int] = field(default_factory=list)
    internal: list[float] = field(default_factory=list)
    reservation: list[float] = field(default_factory=list)
    _live: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # seq -> [(step, alloc, written)]

    def begin(self, now: float | None = None) -> None:
        if self.start_time is None:
            self.start_time = time.perf_counter() if now is None else now

    def record_step(self, blocks_used: int, running: list[tuple[int, int, int]], external_free: int,
                    num_preempted: int) -> None:
        """running: (seq_id, allocated slots, written slots) for every sequence holding blocks."""
        step = self.num_steps
        self.num_steps += 1
        self.blocks_used.append(blocks_used)
        self.concurrent.append(len(running))
        self.external.append(external_free)
        self.internal.append(0.0)
        self.reservation.append(0.0)
        self.preemptions += num_preempted
        for seq_id, allocated, written in running:
            self._live.setdefault(seq_id, []).append((step, allocated, written))
        self.end_time = time.perf_counter()

    def record_finish(self, seq_id: int, final_len: int, num_prompt: int, num_generated: int,
                      ttft: float | None, tpot: float | None) -> None:
        self.num_requests += 1
        self.prompt_tokens += num_prompt
        self.generated_tokens += num_generated
        if ttft is not None:
            self.ttft.append(ttft)
        if tpot is not None:
            self.tpot.append(tpot)
        self._settle(seq_id, final_len)
        self.end_time = time.perf_counter()

    def _settle(self, seq_id: int, final_len: int, internal: list[float] | None = None,
                reservation: list[float] | None = None) -> None:
        """Split a sequence's per-step holdings into internal / reservation waste, given its final length."""
        history = self._live.pop(seq_id, ()) if internal is None else self._live.get(seq_id, ())
        internal = self.internal if internal is None else internal
        reservation = self.reservation if reservation is None else reservation
        for step, allocated, written in history:
            internal[step] += max(0, allocated - max(final_len, written))
            reservation[step] += max(0, min(allocated, final_len) - written)

    def summary(self, live_lengths: dict[int, int] | None = None) -> dict:
        internal, reservation = list(self.internal), list(self.reservation)
        for seq_id, length in (live_lengths or {}).items():  # unfinished: judged by their length so far
            self._settle(seq_id, length, internal, reservation)
        steps = max(self.num_steps, 1)
        elapsed = (self.end_time - self.start_time) if self.start_time and self.end_time else float("nan")
        frac = lambda xs: sum(xs) / steps / self.pool_slots  # noqa: E731
        return {
            "tokens_per_s": self.generated_tokens / elapsed if elapsed and elapsed > 0 else float("nan"),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "elapsed_s": elapsed,
            "num_requests": self.num_requests,
            "num_steps": self.num_steps,
            "ttft_median_s": statistics.median(self.ttft) if self.ttft else float("nan"),
            "ttft_p90_s": _percentile(self.ttft, 0.9),
            "tpot_median_s": statistics.median(self.tpot) if self.tpot else float("nan"),
            "tpot_p90_s": _percentile(self.tpot, 0.9),
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_peak": max(self.blocks_used, default=0),
            "kv_blocks_mean": sum(self.blocks_used) / steps,
            "waste_internal": frac(internal),
            "waste_reservation": frac(reservation),
            "waste_external": frac(self.external),
            "preemptions": self.preemptions,
            "max_concurrent_seqs": max(self.concurrent, default=0),
            "mean_concurrent_seqs": sum(self.concurrent) / steps,
        }

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
(allocated, written) pairs are kept until then; after that only running totals
remain, so memory stays bounded however long the engine runs. Latencies keep
the most recent `window` values.

KV held, three ways (`LLMEngine.stats()`):

- `kv_blocks_peak` / `kv_blocks_mean` (and per kind of layer group, `kv_blocks_*/<kind>`): pages of the
  one shared pool in use (peak over steps / mean per step). A page's size depends on the layer grouping:
  it holds `block_size` tokens of every layer of one group, and a compressing policy gives each layer (or
  each KV head) its own table, so its pages hold one layer (or one head): up to layers x KV heads times
  fewer bytes than a full cache's. Page counts compare only configurations with one grouping.
- `kv_bytes_peak` / `kv_bytes_mean`: the pages in use times what one page costs (K and V of the layers
  and heads it holds, in the cache format, scales and zero points included): comparable across
  groupings. KIVI's full-precision residual rows live in leased pool pages (kvlab.cache.quant.lease), so they
  are counted as pages in use; a stand-alone cache's own residual area (no lessor) is not.
- `kv_tokens_peak` / `kv_tokens_mean`: the token slots those pages hold, per layer and KV head of the
  model, summed over sequences (`tokens_per_page`: a page of one layer of a 30-layer model counts
  block_size / 30): what a full cache of every layer would need to hold as much. Comparable across
  groupings and formats; slots held but not yet written (the tail of a table's last page) count, and so
  do the pages KIVI's residual rows lease (their bytes hold rows, not tokens: a format's tokens held are
  better read from its sequences, as experiments/bench_quant_capacity.py does).

Throughput is per second of engine work (`busy_s`: time spent inside
`step()`), so idle time between calls does not dilute it; `elapsed_s` is the
wall time from the first request to the last event.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field


def _percentile(values, q: float) -> float:
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
    window: int = 10_000  # latency values kept (the most recent)
    start_time: float | None = None
    end_time: float | None = None
    busy_s: float = 0.0  # seconds spent inside engine steps
    num_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    num_requests: int = 0
    preemptions: int = 0
    blocks_peak: int = 0
    blocks_sum: int = 0
    concurrent_peak: int = 0
    concurrent_sum: int = 0
    external_sum: int = 0
    internal_sum: float = 0.0  # settled (finished sequences) waste, summed over steps
    reservation_sum: float = 0.0
    group_blocks_peak: dict[str, int] = field(default_factory=dict)  # per layer group
    group_blocks_sum: dict[str, int] = field(default_factory=dict)
    ttft: deque = field(default_factory=deque)
    tpot: deque = field(default_factory=deque)
    _live: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # seq -> [(allocated, written)]

    def __post_init__(self) -> None:
        self.ttft, self.tpot = deque(self.ttft, maxlen=self.window), deque(self.tpot, maxlen=self.window)

    def begin(self, now: float | None = None) -> None:
        if self.start_time is None:
            self.start_time = time.perf_counter() if now is None else now

    def add_busy(self, seconds: float) -> None:
        self.busy_s += seconds

    def record_step(self, blocks_used: int, running: list[tuple[int, int, int]], external_free: int,
                    num_preempted: int, group_blocks: dict[str, int] | None = None) -> None:
        """running: (seq_id, allocated slots, written slots) for every sequence holding blocks."""
        self.num_steps += 1
        self.blocks_peak = max(self.blocks_peak, blocks_used)
        self.blocks_sum += blocks_used
        self.concurrent_peak = max(self.concurrent_peak, len(running))
        self.concurrent_sum += len(running)
        self.external_sum += external_free
        self.preemptions += num_preempted
        for name, used in (group_blocks or {}).items():
            self.group_blocks_peak[name] = max(self.group_blocks_peak.get(name, 0), used)
            self.group_blocks_sum[name] = self.group_blocks_sum.get(name, 0) + used
        for seq_id, allocated, written in running:
            self._live.setdefault(seq_id, []).append((allocated, written))
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
        internal, reservation = _waste(self._live.pop(seq_id, ()), final_len)
        self.internal_sum += internal
        self.reservation_sum += reservation
        self.end_time = time.perf_counter()

    def discard(self, seq_id: int) -> None:
        """Forget an aborted sequence's history (it never finished, so it has no final length)."""
        self._live.pop(seq_id, None)

    def summary(self, live_lengths: dict[int, int] | None = None) -> dict:
        internal, reservation = self.internal_sum, self.reservation_sum
        for seq_id, length in (live_lengths or {}).items():  # unfinished: judged by their length so far
            i, r = _waste(self._live.get(seq_id, ()), length)
            internal, reservation = internal + i, reservation + r
        steps = max(self.num_steps, 1)
        elapsed = (self.end_time - self.start_time) if self.start_time and self.end_time else float("nan")
        out = {
            "tokens_per_s": self.generated_tokens / self.busy_s if self.busy_s > 0 else float("nan"),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "busy_s": self.busy_s,
            "elapsed_s": elapsed,
            "num_requests": self.num_requests,
            "num_steps": self.num_steps,
            "ttft_median_s": statistics.median(self.ttft) if self.ttft else float("nan"),
            "ttft_p90_s": _percentile(self.ttft, 0.9),
            "tpot_median_s": statistics.median(self.tpot) if self.tpot else float("nan"),
            "tpot_p90_s": _percentile(self.tpot, 0.9),
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_peak": self.blocks_peak,
            "kv_blocks_mean": self.blocks_sum / steps,
            "waste_internal": internal / steps / self.pool_slots,
            "waste_reservation": reservation / steps / self.pool_slots,
            "waste_external": self.external_sum / steps / self.pool_slots,
            "preemptions": self.preemptions,
            "max_concurrent_seqs": self.concurrent_peak,
            "mean_concurrent_seqs": self.concurrent_sum / steps,
        }
        for name in self.group_blocks_peak:
            out[f"kv_blocks_peak/{name}"] = self.group_blocks_peak[name]
            out[f"kv_blocks_mean/{name}"] = self.group_blocks_sum[name] / steps
        return out


def tokens_per_page(groups, block_size: int, num_kv_heads: int) -> float:
    """Tokens of the whole model's KV one page holds: `block_size` tokens of the layers (and KV heads) of
    one group, as a fraction of every layer and KV head of the model (`groups`: the block manager's
    LayerGroups, all of one layer count; a group with `head` set holds that one KV head)."""
    num_layers = len({layer for g in groups for layer in g.layers})
    heads = 1 if groups[0].head is not None else num_kv_heads
    return block_size * len(groups[0].layers) * heads / (num_layers * num_kv_heads)


def _waste(history, final_len: int) -> tuple[float, float]:
    """(internal, reservation) slot-steps of one sequence's (allocated, written) history, given its final length."""
    internal = reservation = 0
    for allocated, written in history:
        internal += max(0, allocated - max(final_len, written))
        reservation += max(0, min(allocated, final_len) - written)
    return internal, reservation

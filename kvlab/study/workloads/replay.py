"""Drive the engine with requests that arrive over time, and report serving metrics.

`replay` adds each request to `llm.engine` when its arrival time comes (or all
at once with arrival="asap"), steps the engine until everything has finished,
and returns the engine's statistics (throughput, TTFT, TPOT, KV usage and
waste, preemptions) plus one row per request. A `follow_up` callback may add
requests when one finishes (the next turn of a conversation).
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Literal

from kvlab.study.tasks.base import Result
from kvlab.study.tasks.progress import progress_bar


@dataclass
class Request:
    """One request of a workload."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0          # seconds after the start of the replay
    tag: str = ""                   # e.g. "conv3/turn1"


FollowUp = Callable[[Request, object, float], list[Request]]

# llm.stats() keys (kvlab.metrics, LLMEngine.stats), as fnmatch patterns: the optional families
# (compressing policy, prefix cache, sparse reading, speculation, tiers, kept turns, packed residual rows,
# per layer group) by prefix
ENGINE_STATS = ("tokens_per_s", "prompt_tokens", "generated_tokens", "busy_s", "elapsed_s", "num_requests",
                "num_steps", "ttft_median_s", "ttft_p90_s", "tpot_median_s", "tpot_p90_s", "kv_blocks_total",
                "kv_blocks_peak", "kv_blocks_mean", "kv_blocks_peak/*", "kv_blocks_mean/*", "kv_bytes_peak",
                "kv_bytes_mean", "kv_tokens_peak", "kv_tokens_mean", "waste_internal", "waste_reservation",
                "waste_external", "preemptions", "max_concurrent_seqs", "mean_concurrent_seqs", "cow_copies",
                "policy_*", "prefix_*", "sparse_*", "spec_*", "tier_*", "turn_*", "turns_*", "residual_*")


def replay_metrics(prefix: str = "workload") -> tuple[str, ...]:
    """The metric-name patterns `replay` returns (a workload's METRICS)."""
    return tuple(f"{prefix}/{stat}" for stat in ENGINE_STATS)


def replay(llm, requests: list[Request], arrival: Literal["asap", "real"] = "asap", speedup: float = 1.0,
           follow_up: FollowUp | None = None, progress: bool = False, prefix: str = "workload") -> Result:
    """Run `requests` through `llm.engine`; metrics are `<prefix>/<llm.stats() key>`."""
    import pandas as pd

    from kvlab import SamplingParams

    engine = llm.engine
    order = itertools.count()
    pending = [(r.arrival_s if arrival == "real" else 0.0, next(order), r) for r in requests]
    heapq.heapify(pending)
    live: dict = {}  # engine request id -> (Request, arrival offset)
    rows = []
    llm.reset_stats()
    start = time.perf_counter()
    with progress_bar(progress, total=len(requests), desc=prefix) as bar:
        while pending or engine.has_unfinished():
            now = time.perf_counter() - start
            while pending and pending[0][0] / speedup <= now:
                _, _, req = heapq.heappop(pending)
                params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
                live[engine.add_request(req.prompt_token_ids, params)] = (req, now)
            if not engine.has_unfinished():
                time.sleep(max(0.0, min(pending[0][0] / speedup - now, 0.05)))
                continue
            for out in engine.step():
                req, added = live.pop(out.request_id)
                done = time.perf_counter() - start
                rows.append({"tag": req.tag, "arrival_s": added, "finish_s": done,
                             "prompt_tokens": len(req.prompt_token_ids), "output_tokens": len(out.token_ids),
                             "ttft_s": getattr(out, "ttft_s", None), "tpot_s": getattr(out, "tpot_s", None)})
                bar.update(1)
                for new in follow_up(req, out, done) if follow_up else ():
                    heapq.heappush(pending, (new.arrival_s, next(order), new))
                    bar.total += 1
    stats = llm.stats()
    metrics = {f"{prefix}/{k}": v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return Result(metrics, {f"{prefix}_requests": pd.DataFrame(rows)})

"""A model-free replay of a request trace through the engine's own scheduler and block manager. Torch-free.

How much KV memory holds token states, and where the rest goes, depends only on the bookkeeping
(which slots are held for which sequence), not on what the model computes (Kwon et al. 2023,
arXiv:2309.06180, §3 and Fig. 2). So this replay builds the engine's `Scheduler`, `BlockManager`
and allocator plugin over one layer group of `kv_tokens` slots, lets the trace's requests arrive
at their real times on a simulated clock, and advances every scheduled sequence as if the model
had run: a step costs `step_s + token_s * tokens computed` simulated seconds (a cost model, not a
measurement) and appends one placeholder token to each sequence that reached its last token. A
request finishes after its trace output length; its final length in the cache is prompt + output
- 1 (the last sampled token is never written).

Each step is recorded after the sequences advanced (where `LLMEngine.step` records), and the
pool is split into

    tokens       slots holding the KV of written tokens (token states)
    reservation  held slots for tokens the sequence will write later
    internal     held slots it will never write (past its final length; a page's empty tail)
    external     free slots the first waiting request cannot use (holes too small for its reservation)
    free         the rest

with paging's analytic bound: a sequence holds at most block_size - 1 slots it has not written
(the empty tail of its last page, counted as reservation while it will still fill it and as
internal waste past its final length), so reservation + internal <= (block_size - 1) x running.
The engine's own `kvlab.metrics.Metrics` is fed the same steps, so the summary's
`waste_internal` / `waste_reservation` / `waste_external` are the figures `llm.stats()` reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvlab.cache.block_manager import BlockManager, LayerGroup
from kvlab.metrics import Metrics
from kvlab.registry import ALLOCATORS
from kvlab.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.sequence import Sequence, SequenceStatus
from kvlab.study.tasks.base import Result, RunContext, Task, check_positive

COLUMNS = ("time_s", "running", "waiting", "tokens", "reservation", "internal", "external", "free",
           "internal_bound")


@dataclass
class TraceRequest:
    """One request of a trace: when it arrives and how long it is."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass
class BookkeepingResult:
    """Per-step pool breakdown (`steps`: one tuple of COLUMNS a step, in slots) and run totals."""

    pool_slots: int
    block_size: int
    steps: list[tuple] = field(default_factory=list)
    summary: dict[str, float] = field(default_factory=dict)

    def column(self, name: str) -> list:
        i = COLUMNS.index(name)
        return [row[i] for row in self.steps]


def fit_requests(rows: list[tuple[float, int, int]], max_model_len: int) -> tuple[list[TraceRequest], int]:
    """Trace rows (arrival s, context, generated) as requests that fit `max_model_len` (output kept,
    at most half the context; the prompt cut to what is left); also how many were cut."""
    out, cut = [], 0
    for t, context, generated in rows:
        g = min(max(1, generated), max_model_len // 2)
        p = min(max(1, context), max_model_len - g)
        cut += (p, g) != (max(1, context), max(1, generated))
        out.append(TraceRequest(t, p, g))
    return out, cut


def replay_bookkeeping(requests: list[TraceRequest], allocator: str = "paged", allocator_args: dict | None = None,
                       block_size: int = 16, kv_tokens: int = 32768, max_model_len: int = 2048,
                       max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, step_s: float = 0.02,
                       token_s: float = 1e-4, speedup: float = 1.0, system_prompt_tokens: int = 0,
                       prefix_cache: str | None = None, prefix_eviction: str = "lru",
                       seed: int = 0) -> BookkeepingResult:
    """Replay `requests` at their arrival times (divided by `speedup`) without a model.

    `system_prompt_tokens`: one shared prompt of that many tokens before every request's own prompt
    (`TraceRequest.prompt_tokens` counts it). `prefix_cache`: None (no sharing), "hash" or "radix", with
    the `prefix_eviction` policy; then every request's own tokens and outputs are distinct random ids
    (seeded), so only the system prompt and a request's own pages after a preemption can hit. With
    sharing, a shared page counts once per sequence holding it in `tokens` (logical token states)."""
    import random

    if kv_tokens < max_model_len:
        raise ValueError(f"kv_tokens ({kv_tokens}) must hold at least one max_model_len ({max_model_len}) sequence")
    num_blocks = kv_tokens // block_size
    alloc = ALLOCATORS.build(allocator, **(allocator_args or {}))
    cache, match = _prefix_cache(prefix_cache, prefix_eviction, block_size)
    bm = BlockManager([LayerGroup((0,))], alloc, num_blocks, block_size, max_model_len, max_num_batched_tokens,
                      cache, match)
    rng = random.Random(seed)
    system = [rng.randrange(1, 1 << 30) for _ in range(system_prompt_tokens)]
    scheduler = Scheduler(bm, max_num_seqs, max_num_batched_tokens)
    pool = num_blocks * block_size
    metrics = Metrics(pool_slots=pool, num_blocks=num_blocks)
    result = BookkeepingResult(pool, block_size)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    final: dict[int, int] = {}
    t, nxt, busy_steps = 0.0, 0, 0
    while nxt < len(order) or scheduler.has_unfinished():
        while nxt < len(order) and requests[order[nxt]].arrival_s / speedup <= t:
            r = requests[order[nxt]]
            own = r.prompt_tokens - len(system)
            ids = system + ([rng.randrange(1, 1 << 30) for _ in range(own)] if cache else [0] * own)
            seq = Sequence(nxt, ids, SamplingParams(max_tokens=r.output_tokens, ignore_eos=True),
                           r.prompt_tokens + r.output_tokens, r.arrival_s / speedup)
            error = bm.capacity_error(seq)
            if error:
                raise ValueError(f"trace request {order[nxt]} can never run: {error}")
            final[nxt] = r.prompt_tokens + r.output_tokens - 1
            scheduler.add(seq)
            nxt += 1
        if not scheduler.has_unfinished():
            t = requests[order[nxt]].arrival_s / speedup
            continue
        batch = scheduler.schedule()
        if not batch.seqs:
            stuck = scheduler.waiting[0]  # a capacity bug: capacity_error admitted it
            raise RuntimeError(f"request {stuck.seq_id} cannot be scheduled in an empty pool: {bm.lone_need(stuck)}")
        t += step_s + token_s * batch.num_tokens
        scheduler.advance(batch)
        result.steps.append(_breakdown(t, scheduler, bm, final, pool))
        busy_steps += bool(scheduler.waiting)
        metrics.record_step(bm.num_used_blocks(), [(s.seq_id, *bm.waste_view(s)) for s in scheduler.running],
                            result.steps[-1][COLUMNS.index("external")], batch.num_preempted)
        for seq in [s for s in batch.seqs if s.status is SequenceStatus.RUNNING and s.num_computed_tokens == s.num_tokens]:
            seq.token_ids.append(rng.randrange(1, 1 << 30) if cache else 0)
            if seq.num_output_tokens >= seq.params.max_tokens:
                metrics.record_finish(seq.seq_id, bm.cached_total(seq), seq.num_prompt_tokens, seq.num_output_tokens,
                                      None, None)
                scheduler.finish(seq, "length")
    result.summary = _summary(result, metrics, t, busy_steps)
    if cache is not None:
        st = cache.stats
        result.summary.update(prefix_hit_rate_tokens=st.hit_tokens / st.queried_tokens if st.queried_tokens else 0.0,
                              prefix_hit_tokens=st.hit_tokens, prefix_evictions=st.evictions,
                              kv_blocks_peak=metrics.blocks_peak, kv_blocks_mean=metrics.blocks_sum / max(1, metrics.num_steps))
    return result


def _prefix_cache(kind: str | None, eviction: str, block_size: int):
    """(prefix cache or None, the block manager's prefix_match) by name."""
    from kvlab.cache.prefix_index import prefix_index
    from kvlab.registry import PREFIX_EVICTIONS

    if kind not in (None, "hash", "radix"):
        raise ValueError(f"prefix_cache must be None, 'hash' or 'radix', got {kind!r}")
    return prefix_index(kind, PREFIX_EVICTIONS.build(eviction) if kind else None, block_size, b"replay")


def _breakdown(t: float, scheduler: Scheduler, bm: BlockManager, final: dict[int, int], pool: int) -> tuple:
    """One COLUMNS row: the pool split after a step."""
    tokens = reservation = internal = 0
    for seq in scheduler.running:
        held, written = bm.waste_view(seq)
        end = final[seq.seq_id]
        tokens += written
        reservation += max(0, min(held, end) - written)
        internal += max(0, held - max(end, written))
    external = bm.external_fragmentation(scheduler.waiting[0]) if scheduler.waiting else 0
    free = pool - tokens - reservation - internal - external
    bound = len(scheduler.running) * (bm.block_size - 1)
    return (t, len(scheduler.running), len(scheduler.waiting), tokens, reservation, internal, external, free, bound)


def _summary(result: BookkeepingResult, metrics: Metrics, end_s: float, busy_steps: int) -> dict[str, float]:
    """Means over steps as fractions of the pool (all steps, and the steps with a request waiting:
    the pool is then what limits the batch), the engine's own waste figures, and modelled throughput."""
    out: dict[str, float] = {}
    pool, steps = result.pool_slots, result.steps
    busy = [row for row in steps if row[COLUMNS.index("waiting")]]
    for scope, rows in (("", steps), ("busy_", busy)):
        for name in ("tokens", "reservation", "internal", "external", "free"):
            i = COLUMNS.index(name)
            out[f"{scope}frac_{name}"] = sum(r[i] for r in rows) / len(rows) / pool if rows else float("nan")
        held = sum(r[3] + r[4] + r[5] + r[6] for r in rows)  # tokens + reservation + internal + external
        out[f"{scope}token_share_of_used"] = sum(r[3] for r in rows) / held if held else float("nan")
    res, i, b = COLUMNS.index("reservation"), COLUMNS.index("internal"), COLUMNS.index("internal_bound")
    out["unwritten_max_slots"] = max((r[res] + r[i] for r in steps), default=0)
    out["paging_bound_exceeded_steps"] = sum(1 for r in steps if r[res] + r[i] > r[b])
    out["busy_steps"] = busy_steps
    stats = metrics.summary()
    for key in ("waste_internal", "waste_reservation", "waste_external", "max_concurrent_seqs",
                "mean_concurrent_seqs", "preemptions", "num_steps", "num_requests", "generated_tokens"):
        out[key] = stats[key]
    out["sim_time_s"] = end_s
    out["sim_tokens_per_s"] = stats["generated_tokens"] / end_s if end_s else float("nan")
    out["sim_requests_per_s"] = stats["num_requests"] / end_s if end_s else float("nan")
    return out


@dataclass
class TraceBookkeeping(Task):
    """Waste over time on a real trace, without a model: the engine's allocator (`engine.allocator`,
    `engine.allocator_args`), `engine.block_size`, `max_num_seqs` and `max_num_batched_tokens`
    from the built LLM's config; the pool size in tokens, the context limit and the step cost here."""

    trace: str = "conv"            # conv | code | a CSV path with TIMESTAMP,ContextTokens,GeneratedTokens
    num_requests: int = 1000       # trace rows replayed, from row `start`
    start: int = 0                 # first trace row
    kv_tokens: int = 32768         # KV pool size in token slots (one layer group)
    max_model_len: int = 2048      # longest sequence (contiguous max reservation); longer requests are cut
    speedup: float = 1.0           # inter-arrival times divided by this
    step_s: float = 0.02           # modelled cost of a step (s) ...
    token_s: float = 1e-4          # ... plus this per token computed in it
    timeline_rows: int = 2000      # rows kept in the logged timeline table (evenly spaced steps)
    system_prompt_tokens: int = 0  # one shared system prompt of this many tokens before every request

    def __post_init__(self) -> None:
        check_positive(self, "num_requests", "kv_tokens", "max_model_len", "speedup", "timeline_rows")
        if self.start < 0 or self.step_s < 0 or self.token_s < 0 or self.step_s + self.token_s == 0:
            raise ValueError(f"TraceBookkeeping: start, step_s and token_s must be >= 0 (and a step must cost "
                             f"time), got start={self.start}, step_s={self.step_s}, token_s={self.token_s}")
        if not 0 <= self.system_prompt_tokens < self.max_model_len - 1:
            raise ValueError(f"TraceBookkeeping.system_prompt_tokens must be in [0, max_model_len - 1), got "
                             f"{self.system_prompt_tokens}")
        if self.kv_tokens < self.max_model_len:
            raise ValueError(f"TraceBookkeeping.kv_tokens ({self.kv_tokens}) must hold one max_model_len "
                             f"({self.max_model_len}) sequence")

    def run(self, llm: Any, ctx: RunContext) -> Result:
        import pandas as pd

        from kvlab.study.workloads.azure import read_trace

        cfg = llm.config
        rows = read_trace(self.trace, ctx.data_dir)[self.start:self.start + self.num_requests]
        if len(rows) < self.num_requests:
            raise ValueError(f"trace {self.trace!r} has only {len(rows)} rows from row {self.start}")
        t0 = rows[0][0]
        sys_len = self.system_prompt_tokens
        requests, cut = fit_requests([(t - t0, c, g) for t, c, g in rows], self.max_model_len - sys_len)
        for r in requests:
            r.prompt_tokens += sys_len
        out = replay_bookkeeping(requests, cfg.allocator, cfg.allocator_args, cfg.block_size, self.kv_tokens,
                                 self.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.step_s,
                                 self.token_s, self.speedup, sys_len,
                                 cfg.prefix_cache if cfg.enable_prefix_caching else None, cfg.prefix_eviction,
                                 ctx.seed)
        metrics = {f"waste/{k}": v for k, v in out.summary.items()}
        metrics["waste/requests_cut"] = cut
        stride = max(1, len(out.steps) // self.timeline_rows)
        table = pd.DataFrame(out.steps[::stride], columns=list(COLUMNS))
        for name in ("tokens", "reservation", "internal", "external", "free", "internal_bound"):
            table[name] = table[name] / out.pool_slots  # fractions of the pool
        return Result(metrics, {"waste_timeline": table})

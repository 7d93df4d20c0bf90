"""Start-up compute calibration for a placement's cost model: forwards of the prompt lengths it asks for
(`Placement.compute_sizes`, kvlab.cache.tiers.placement), timed before any request and told to
`observe_calibration`, round after round until it asks for none (at most `MAX_ROUNDS`), so its recompute rate
is a line through steady points from the first decision on.

Each forward runs one throwaway sequence of token 0s through the model runner on fresh pool pages, with the
prefix cache set aside (nothing is looked up or registered, nothing is evicted: the pool is empty) and freed
after; the pool, the prefix cache and the engine's metrics are as before. One warm-up forward is not counted.
Skipped with a compressing policy or a draft (their per-sequence state hears of every sequence); a size beyond a step is cut to
the step's budget, one that does not fit the pool halved until it does.
"""

from __future__ import annotations

import time

from kvlab.engine.scheduler import ScheduledBatch
from kvlab.sampling_params import SamplingParams
from kvlab.sequence import Sequence


MAX_ROUNDS = 100  # whatever a placement asks


def calibrate_compute(engine) -> int:
    """Time the forwards `engine`'s placement asks for, round after round until it asks for none; how many were
    told."""
    places = engine.kv.places
    if places is None or engine.compressor is not None or engine.speculator is not None:
        return 0
    placement, bm = places.placement, engine.block_manager
    limit = min(engine.scheduler.max_num_batched_tokens, engine.max_model_len - 1)
    told, warm = 0, False
    saved, bm.allocator.prefix_cache = bm.allocator.prefix_cache, None  # set aside: nothing looked up or registered
    try:
        for _ in range(MAX_ROUNDS):
            sizes = [min(n, limit) for n in placement.compute_sizes() if n > 0]
            if not sizes:
                break
            if not warm:  # one forward not counted (first-call costs)
                _forward(engine, sizes[0])
                warm = True
            timed = [t for t in (_forward(engine, n) for n in sizes) if t is not None]
            if not timed:
                break
            for n, seconds in timed:
                placement.observe_calibration(n, seconds)
            told += len(timed)
    finally:
        bm.allocator.prefix_cache = saved
    return told


def _forward(engine, n: int) -> tuple[int, float] | None:
    """(tokens, seconds) of one forward of a throwaway `n`-token sequence (halved until the pool holds it; None if
    it cannot); its pages are freed after."""
    bm = engine.block_manager
    seq = Sequence(-1, [0] * n, SamplingParams(max_tokens=1), n + 1, time.perf_counter())  # no request id used
    while n > 1 and not bm.can_allocate(seq, None, n):
        n //= 2
        seq = Sequence(-1, [0] * n, SamplingParams(max_tokens=1), n + 1, time.perf_counter())
    if not bm.can_allocate(seq, None, n):
        return None
    bm.allocate(seq, n)
    try:
        started = time.perf_counter()
        engine.runner.run(ScheduledBatch([seq], [n]))
        return n, time.perf_counter() - started
    finally:
        bm.free(seq)

"""Start-up compute calibration for a placement's cost model: forwards of the prompt lengths it asks for
(`Placement.compute_sizes`, kvlab.cache.tiers.placement), timed before any request and told to
`observe_calibration`, so its recompute rate is a line through steady points from the first decision on.

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


def calibrate_compute(engine) -> int:
    """Time the forwards `engine`'s placement asks for; how many were told."""
    places = engine.kv.places
    sizes = places.placement.compute_sizes() if places is not None else ()
    if not sizes or engine.compressor is not None or engine.speculator is not None:
        return 0
    bm, limit = engine.block_manager, engine.scheduler.max_num_batched_tokens
    sizes = [min(n, limit, engine.max_model_len - 1) for n in sizes if n > 0]
    told = 0
    saved, bm.allocator.prefix_cache = bm.allocator.prefix_cache, None  # set aside: nothing looked up or registered
    try:
        for i, n in enumerate([sizes[0], *sizes] if sizes else []):
            seq = Sequence(-1 - i, [0] * n, SamplingParams(max_tokens=1), n + 1, time.perf_counter())  # no request id
            while n > 1 and not bm.can_allocate(seq, None, n):  # a size the pool cannot hold: the most it can
                n //= 2
                seq = Sequence(-1 - i, [0] * n, SamplingParams(max_tokens=1), n + 1, time.perf_counter())
            if not bm.can_allocate(seq, None, n):
                continue
            bm.allocate(seq, n)
            try:
                started = time.perf_counter()
                engine.runner.run(ScheduledBatch([seq], [n]))
                seconds = time.perf_counter() - started
            finally:
                bm.free(seq)
            if i:
                places.placement.observe_calibration(n, seconds)
                told += 1
    finally:
        bm.allocator.prefix_cache = saved
    return told

"""The cost model's compute side measured on this machine, once at start-up (kvlab/speculation/cost_model.py's
`PassTimes`): what a verification pass's attention and linear layers cost over a plain decode pass's.

    verify_attention_ratio(batch, context, q_len, ...)   # a q_len-query chunk a sequence over one query, same keys
    verify_linear_ratio(model, rows, verify_rows)        # an MLP and the head at verify_rows rows over rows
    pass_times(parts, attention_ratio, linear_ratio)     # PassTimes from a plain step's measured parts (ms)

The attention ratio runs the engine's attention op (kvlab.kernels.ops: the native CPU kernel where it runs) on one
layer's pool of random pages (randn: constant pages read faster than memory delivers), `batch` sequences of
`context` tokens, each sequence its own pages as the cell's kernel reads them; the linear ratio the model's first
decoder layer's MLP and its head (through their forward: the linear backend the engine set), on random rows.
Medians of `repeats`, after one warm-up call.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvlab.kernels import ops
from kvlab.kernels.attention_plan import plan_paged_attention
from kvlab.speculation.cost_model import PassTimes


def median_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def verify_attention_ratio(batch: int, context: int, q_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                           dtype: torch.dtype = torch.float32, block_size: int = 16, repeats: int = 5) -> float:
    """Seconds of one layer's attention for a q_len-query chunk a sequence (the last q_len of context + q_len
    keys, causal) over those of one query a sequence over context + 1 keys."""
    per_seq = -(-(context + q_len) // block_size)
    pages = batch * per_seq
    g = torch.Generator().manual_seed(0)
    k = torch.randn(pages + 1, block_size, num_kv_heads, head_dim, generator=g).to(dtype)  # [pages + null, bs, Hkv, D]
    v = torch.randn(pages + 1, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]

    def timed(n: int) -> float:
        plan = plan_paged_attention([b * n for b in range(batch + 1)], [context + n] * batch, tables, block_size,
                                    null_block=pages)
        q = torch.randn(batch * n, num_heads, head_dim, generator=g).to(dtype)  # [B n, Hq, D]
        return median_seconds(lambda: ops.run_paged_attention(q, k, v, plan, head_dim ** -0.5), repeats)

    return timed(q_len) / timed(1)


@torch.inference_mode()
def verify_linear_ratio(model: torch.nn.Module, rows: int, verify_rows: int, repeats: int = 5) -> float:
    """Seconds of the first decoder layer's MLP and the head at `verify_rows` rows over `rows` rows."""
    mlp, head = model.model.layers[0].mlp, model.lm_head
    hidden = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(0)

    def timed(n: int) -> float:
        x = torch.randn(n, hidden, generator=g).to(dtype)  # [n, H]
        return median_seconds(lambda: (mlp.forward(x), head.forward(x)), repeats)

    return timed(verify_rows) / timed(rows)


def pass_times(parts_ms: dict[str, float], attention_ratio: float, linear_ratio: float) -> PassTimes:
    """PassTimes from a plain decode step's parts (kvlab/study/round_profile.py's ms_per_step of a plain engine)."""
    linear = parts_ms["verify: linear"] + parts_ms["verify: lm_head"]
    attention = parts_ms["verify: attention"]
    per_pass = parts_ms["verify: plan"] + parts_ms["verify: forward rest"]
    step = parts_ms["step"] - linear - attention - per_pass
    return PassTimes(linear / 1e3, attention / 1e3, per_pass / 1e3, max(step, 0.0) / 1e3, linear_ratio,
                     attention_ratio)

"""This machine's limits, measured now: streaming read bandwidth and the linear layers' FLOP rate at many rows
(kvlab/speculation/roofline.py's `Machine`). Ceilings, so each is the best of its repeats: a shared machine's
other jobs only ever slow a run down.

    machine = measure_machine(torch.bfloat16)          # Machine(bandwidth, linear_flops, attention_flops)
    describe(machine)                                  # one line for a results file

Bandwidth: torch.sum over `mib` MiB of random float32 (constant data reads faster than memory delivers). Linear:
the engine's CPU kernel (kvlab.kernels.cpu.linear, F.linear where it does not run) and F.linear on random
[rows, 576] x [1536, 576] (SmolLM2's MLP shape), the faster of the two. Attention's arithmetic runs in float32
whatever the cache's dtype (the CPU kernel widens bf16), so its rate is the float32 linear rate.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kvlab.speculation.roofline import Machine


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(mib: int = 1024, repeats: int = 7) -> float:
    """Bytes / s of a streaming read (torch.sum) over `mib` MiB of random float32."""
    x = torch.rand(mib * (1 << 20) // 4, generator=torch.Generator().manual_seed(0))
    return x.numel() * 4 / best_seconds(x.sum, repeats)


@torch.inference_mode()
def linear_flops(dtype: torch.dtype, rows: int = 96, out_features: int = 1536, in_features: int = 576,
                 repeats: int = 9) -> float:
    """FLOP / s of a linear layer at `rows` rows in `dtype`: the faster of kvlab's CPU kernel and F.linear."""
    from kvlab.kernels.cpu import linear as cpu_linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)  # [N, K]
    x = torch.randn(rows, in_features, generator=g).to(dtype)  # [M, K]
    calls = [lambda: F.linear(x, w)]
    if cpu_linear.available():
        packed = cpu_linear.pack(w)
        calls.append(lambda: cpu_linear.linear(x, w, None, packed))
    flops = 2.0 * rows * out_features * in_features
    inner = 8  # calls a timing: one call is ~0.1-1 ms

    def many(call):
        return lambda: [call() for _ in range(inner)]

    return max(flops * inner / best_seconds(many(call), repeats) for call in calls)


def measure_machine(dtype: torch.dtype, mib: int = 1024) -> Machine:
    fp32 = linear_flops(torch.float32)
    return Machine(read_bandwidth(mib), fp32 if dtype == torch.float32 else linear_flops(dtype), fp32)


def describe(m: Machine) -> str:
    return (f"read {m.bandwidth / 1e9:.1f} GB/s, linear {m.linear_flops / 1e9:.0f} GFLOP/s, attention "
            f"{m.attention_flops / 1e9:.0f} GFLOP/s (ridge {m.ridge():.1f} FLOP a byte)")

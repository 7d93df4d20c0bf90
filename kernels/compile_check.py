"""Compile every kernel variant for a GPU target without a GPU (ahead-of-time, through ptxas).

Triton's interpreter runs kernels as numpy and accepts code the GPU compiler
rejects (type changes across branches, dot shapes below the MMA minimum, ...),
so this drives each launcher with small CPU tensors, catches its launch instead
of running it, and compiles that exact specialisation for the target:

    python -m kvlab.kernels.compile_check               # sm_90 (H100 / H200)
    python -m kvlab.kernels.compile_check --arch 80     # A100

Exits non-zero if any variant fails to compile. Must run in a process of its
own: it replaces the Triton launch path, and TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from dataclasses import dataclass

import torch

_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
}


@dataclass
class Launch:
    variant: str
    kernel: object  # JITFunction
    args: tuple
    kwargs: dict


def _signature(kernel, args, kwargs):
    """(signature, constexprs, attrs); attrs mark 16-divisible ints and 16-aligned pointers the way
    Triton's JIT specialises them at launch (so loads vectorise as they will on the GPU)."""
    sig, consts, attrs = {}, {}, {}
    for i, (name, a) in enumerate(zip(kernel.arg_names, args)):
        aligned = a.data_ptr() % 16 == 0 if isinstance(a, torch.Tensor) else (
            isinstance(a, int) and not isinstance(a, bool) and a % 16 == 0)
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + _TYPES[a.dtype]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: cannot type argument {name}={a!r}")
    for name, value in kwargs.items():
        sig[name] = "constexpr"
        consts[name] = value
    for param in kernel.params:  # constexprs the launch left at their defaults
        if param.name not in sig and param.is_constexpr and param.default is not inspect.Parameter.empty:
            sig[param.name] = "constexpr"
            consts[param.name] = param.default
    return {n: sig[n] for n in kernel.arg_names}, consts, attrs


def compile_launch(launch: Launch, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    kwargs = dict(launch.kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    sig, consts, attrs = _signature(launch.kernel, launch.args, kwargs)
    target = GPUTarget("cuda", arch, 32)
    opts = make_backend(target).parse_options(options)
    return triton.compile(ASTSource(fn=launch.kernel, signature=sig, constexprs=consts, attrs=attrs), target=target,
                          options=opts.__dict__)


def collect_launches() -> list[Launch]:
    """Run the launchers on CPU tensors with the launch replaced by a recorder."""
    from triton.runtime.jit import JITFunction

    import kvlab.kernels._checks as checks
    import kvlab.kernels.paged_attention as attn
    from kvlab.kernels.block_ops import compact_slots, copy_blocks
    from kvlab.kernels.store_kv import store_kv
    from kvlab.kernels.testing import CACHE_DTYPES, make_paged_batch

    launches: list[Launch] = []
    variant = [""]

    def record(self, grid):
        return lambda *args, **kwargs: launches.append(Launch(variant[0], self, args, kwargs))

    JITFunction.__getitem__ = record
    checks.check_runnable = lambda kernel, device: None
    # the GPU's tl.dot operand dtype (the CPU path upcasts for the interpreter)
    attn._dot_dtype = _gpu_dot_dtype

    for cache in ("bf16", "fp32", "fp8_e4m3", "fp8_e5m2"):
        variant[0] = f"store_kv {cache}"
        dtype = CACHE_DTYPES[cache]
        scale = torch.ones(2) if dtype.itemsize == 1 else None
        key = torch.randn(3, 2, 128, dtype=torch.bfloat16)
        pool = torch.zeros(4, 16, 2, 128).to(dtype)
        store_kv(key, key, pool, pool.clone(), torch.tensor([0, 1, 2]), scale, scale)

    cases = [
        # variant, q_lens, seq_lens, group, head_dim, cache, q dtype, kwargs
        ("decode bf16", [1, 1], [40, 9], 4, 128, "bf16", torch.bfloat16, {}),
        ("decode bf16 split-K", [1, 1], [40, 9], 4, 128, "bf16", torch.bfloat16, dict(num_splits=4)),
        ("decode fp8_e4m3 window softcap", [1], [40], 8, 128, "fp8_e4m3", torch.bfloat16,
         dict(sliding_window=16, softcap=30.0)),
        ("decode fp8_e5m2 d256 ratio 3", [1], [40], 3, 256, "fp8_e5m2", torch.bfloat16, {}),
        ("decode fp16 d64 ratio 1", [1], [40], 1, 64, "fp16", torch.float16, {}),
        ("decode fp32 (ieee dot)", [1], [40], 2, 64, "fp32", torch.float32, dict(num_splits=2)),
        ("extend bf16 d128", [7, 1], [40, 9], 4, 128, "bf16", torch.bfloat16, {}),
        ("extend bf16 d256 ratio 3 split", [7], [40], 3, 256, "bf16", torch.bfloat16, dict(num_splits=2)),
        ("extend tree fp8 + stats", [5, 3], [40, 9], 4, 128, "fp8_e4m3", torch.bfloat16,
         dict(return_stats=True, stats_window=2)),
        ("decode stats d64", [1, 1], [40, 9], 4, 64, "bf16", torch.bfloat16, dict(return_stats=True)),
    ]
    for name, q_lens, seq_lens, g, d, cache, q_dtype, kw in cases:
        variant[0] = name
        tree = "tree" in name
        b = make_paged_batch(q_lens, seq_lens, 2, g, d, 16, CACHE_DTYPES[cache], q_dtype,
                             sliding_window=kw.get("sliding_window"), tree=tree)
        kw = dict(kw)
        attn.paged_attention(*b.args(), kw.pop("sliding_window", None), kw.pop("softcap", None), b.k_scale,
                             b.v_scale, tree_mask=b.tree_mask, **kw)

    pool = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)
    variant[0] = "copy_blocks"
    copy_blocks(pool, pool.clone(), torch.tensor([0]), torch.tensor([1]))
    variant[0] = "compact_slots"
    compact_slots(pool, pool.clone(), torch.tensor([3]), torch.tensor([0]))
    return launches


def _gpu_dot_dtype(q):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[q.dtype]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlab.kernels.compile_check", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this compiles the kernels for a GPU")
        return 2
    failures = 0
    for launch in collect_launches():
        name = f"{launch.variant}: {launch.kernel.__name__}"
        start = time.time()
        try:
            compile_launch(launch, args.arch)
            print(f"ok    sm_{args.arch} {name} ({time.time() - start:.1f} s)", flush=True)
        except Exception as exc:  # report every variant, then fail
            failures += 1
            print(f"FAIL  sm_{args.arch} {name}: {type(exc).__name__}: {exc}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

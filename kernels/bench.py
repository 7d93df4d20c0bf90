"""Check every kernel against its torch reference, then time decode attention.

    python -m kvlab.kernels.bench                  # CUDA: checks + decode timing table
    python -m kvlab.kernels.bench --check-only     # checks only; on a CPU-only machine under
                                                   # TRITON_INTERPRET=1 on tiny shapes

Timing (CUDA only): paged decode attention (Flash-Decoding split-K over a
PagedAttention pool, arXiv:2309.06180) at contexts 1k-32k and batches 1-256,
`triton.testing.do_bench` medians, achieved bandwidth = bytes of K and V read
(+ q and out) / time, as a fraction of the device-to-device copy bandwidth
measured in the same run; beside it torch SDPA over a contiguous cache
(the G query heads of a KV head as its query rows, so SDPA needs no GQA expand).
The table (markdown + JSON, with the command line and device) goes to
experiments/results/kernels_bench_<device>.{md,json} and is printed.
Goal on an H200: >= 70% of copy bandwidth for contexts >= 4k.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton reads this when the kernels are first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

RESULTS_DIR = Path("experiments/results")
GOAL_FRACTION = 0.70
GOAL_MIN_CONTEXT = 4096


# ---------------------------------------------------------------- correctness


@dataclass
class Check:
    kernel: str
    case: str
    max_rel_error: float
    ok: bool


def _attention_checks(device, tiny: bool) -> list[Check]:
    from kvlab.kernels.paged_attention import paged_attention
    from kvlab.kernels.reference.paged_attention import paged_attention_ref
    from kvlab.kernels.testing import CACHE_DTYPES, attention_tolerance, make_paged_batch, max_rel_error

    bs = 16
    if tiny:
        hkv, g, d, long = 2, 4, 64, 40
    else:
        hkv, g, d, long = 8, 4, 128, 3000
    dt = torch.float32 if tiny else torch.bfloat16
    cases = [
        # name, q_lens, seq_lens, cache, extra kwargs
        ("decode", [1, 1, 1], [1, bs + 1, long], "bf16", {}),
        ("decode split-K", [1, 1], [bs - 1, long], "bf16", dict(num_splits=4)),
        ("decode fp8_e4m3 window softcap", [1, 1], [bs, long], "fp8_e4m3", dict(sliding_window=bs + 3, softcap=30.0)),
        ("decode fp8_e5m2 head_dim 256", [1, 1], [5, long // 2], "fp8_e5m2", dict(head_dim=256)),
        ("decode ratio 3", [1, 1], [bs + 1, long], "bf16", dict(group=3)),
        ("extend chunked prefill", [5, 1, bs + 1], [long, 9, bs + 1], "bf16", {}),
        ("extend tree mask", [4, 6], [bs + 4, long], "bf16", dict(tree=True)),
        ("extend fp32 cache window", [7, 3], [bs * 2 + 1, long], "fp32", dict(sliding_window=bs)),
        ("stats decode", [1, 1], [bs + 1, long], "bf16", dict(return_stats=True)),
        ("stats extend window", [6, 3], [bs + 6, long], "fp8_e4m3", dict(return_stats=True, stats_window=4, sliding_window=bs)),
    ]
    checks = []
    for name, q_lens, seq_lens, cache, kw in cases:
        kw = dict(kw)
        batch = make_paged_batch(
            q_lens, seq_lens, hkv, kw.pop("group", g), kw.pop("head_dim", d), bs, CACHE_DTYPES[cache], dt, device,
            sliding_window=kw.get("sliding_window"), tree=kw.pop("tree", False),
        )
        num_splits = kw.pop("num_splits", None)
        common = dict(
            sliding_window=kw.pop("sliding_window", None), softcap=kw.pop("softcap", None),
            k_scale=batch.k_scale, v_scale=batch.v_scale, tree_mask=batch.tree_mask, **kw,
        )
        out = paged_attention(*batch.args(), num_splits=num_splits, **common)
        ref = paged_attention_ref(*batch.args(), **common)
        pairs = [(out[0], ref[0]), (out[1], ref[1])] if kw.get("return_stats") else [(out, ref)]
        tol = attention_tolerance(dt)
        ok = all(torch.allclose(a.float(), b.float(), **tol) for a, b in pairs)
        err = max(max_rel_error(a, b) for a, b in pairs)
        checks.append(Check("paged_attention" if "stats" not in name else "attention_stats", name, err, ok))
    return checks


def _store_checks(device) -> list[Check]:
    from kvlab.kernels.reference.store_kv import store_kv_ref
    from kvlab.kernels.store_kv import store_kv
    from kvlab.kernels.testing import CACHE_DTYPES, FP8, random_pool, random_scales, storage_close

    checks = []
    gen = torch.Generator().manual_seed(0)
    for fmt in ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2"):
        dtype = CACHE_DTYPES[fmt]
        hkv, d, bs, nb, T = 3, 64, 16, 6, 37
        scales = (random_scales(hkv, gen, device), random_scales(hkv, gen, device)) if dtype in FP8 else (None, None)
        pools = [random_pool(nb, bs, hkv, d, dtype, None, gen, device) for _ in range(2)]
        key = (4 * torch.randn(T, hkv, d, generator=gen)).to(device)
        value = (4 * torch.randn(T, hkv, d, generator=gen)).to(device)
        slots = torch.randperm(nb * bs, generator=gen)[:T].to(device)
        slots[::5] = -1  # padding tokens
        mine = [p.clone() for p in pools]
        store_kv(key, value, *mine, slots, *scales)
        store_kv_ref(key, value, *pools, slots, *scales)
        ok = all(bool(storage_close(a, b).all()) for a, b in zip(mine, pools))
        err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(mine, pools))
        checks.append(Check("store_kv", fmt, err, ok))
    return checks


def _block_checks(device) -> list[Check]:
    from kvlab.kernels.block_ops import compact_slots, copy_blocks
    from kvlab.kernels.reference.block_ops import compact_slots_ref, copy_blocks_ref
    from kvlab.kernels.testing import random_pool

    gen = torch.Generator().manual_seed(1)
    checks = []
    for fmt, dtype in (("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        pools = [random_pool(8, 16, 2, 64, dtype, None, gen, device) for _ in range(2)]
        mine = [p.clone() for p in pools]
        src, dst = torch.tensor([1, 4], device=device), torch.tensor([6, 7], device=device)
        copy_blocks(*mine, src, dst)
        copy_blocks_ref(*pools, src, dst)
        ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(mine, pools))
        checks.append(Check("copy_blocks", fmt, 0.0 if ok else float("inf"), ok))
        src, dst = torch.tensor([3, 17, 18, 40, 2], device=device), torch.arange(5, device=device)
        compact_slots(*mine, src, dst)
        compact_slots_ref(*pools, src, dst)
        ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(mine, pools))
        checks.append(Check("compact_slots", fmt, 0.0 if ok else float("inf"), ok))
    return checks


def run_checks(device: torch.device) -> list[Check]:
    tiny = device.type != "cuda"
    return _store_checks(device) + _attention_checks(device, tiny) + _block_checks(device)


# ---------------------------------------------------------------- timing


@dataclass
class Row:
    cache: str
    context: int
    batch: int
    kv_mib: float
    splits: int
    triton_us: float | None = None
    triton_gbps: float | None = None
    triton_frac: float | None = None
    sdpa_us: float | None = None
    sdpa_gbps: float | None = None
    sdpa_frac: float | None = None
    note: str = ""


def copy_bandwidth(device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s ((read + write) / median time)."""
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def time_decode(ctx, batch, cache, args, copy_bw, device) -> Row:
    from triton.testing import do_bench

    from kvlab.kernels.paged_attention import _launch_config, choose_num_splits, run_paged_attention
    from kvlab.kernels.attention_plan import plan_paged_attention
    from kvlab.kernels.testing import CACHE_DTYPES, FP8

    hq, hkv, d, bs = args.q_heads, args.kv_heads, args.head_dim, args.block_size
    dtype = CACHE_DTYPES[cache]
    kv_bytes = 2 * batch * ctx * hkv * d * dtype.itemsize
    io_bytes = 2 * batch * hq * d * 2  # q in, out back (bf16)
    row = Row(cache, ctx, batch, kv_bytes / 2**20, 0)
    free, _ = torch.cuda.mem_get_info(device)
    if kv_bytes * 1.25 > free:
        row.note = "skipped: memory"
        return row
    scale = d**-0.5
    nb = batch * ctx // bs
    shape = (nb, bs, hkv, d)
    if dtype in FP8:
        k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device).to(dtype)
        v_cache = torch.randn(shape, dtype=torch.bfloat16, device=device).to(dtype)
        k_scale = torch.ones(hkv, device=device)
        v_scale = torch.ones(hkv, device=device)
    else:
        k_cache = torch.randn(shape, dtype=dtype, device=device)
        v_cache = torch.randn(shape, dtype=dtype, device=device)
        k_scale = v_scale = None
    tables = torch.randperm(nb, device=device, dtype=torch.int32).view(batch, -1)  # [B, ctx / bs]
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=device)
    plan = plan_paged_attention(list(range(batch + 1)), [ctx] * batch, tables, bs, None, device)
    out = torch.empty_like(q)
    fn = lambda: run_paged_attention(q, k_cache, v_cache, plan, scale, None, k_scale, v_scale, out=out)  # noqa: E731
    fn()
    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    cfg = _launch_config(hq // hkv, d, decode=True)
    row.splits = choose_num_splits(batch * hkv, ctx, cfg["BLOCK_N"], device)
    row.triton_us = ms * 1e3
    row.triton_gbps = (kv_bytes + io_bytes) / (ms * 1e-3) / 1e9
    row.triton_frac = row.triton_gbps * 1e9 / copy_bw
    del k_cache, v_cache, tables, plan
    torch.cuda.empty_cache()
    if dtype not in FP8 and not args.no_sdpa:
        g = hq // hkv
        k4 = torch.randn(batch, hkv, ctx, d, dtype=dtype, device=device)  # contiguous cache
        v4 = torch.randn_like(k4)
        q4 = q.view(batch, hkv, g, d).to(dtype)  # the G heads of a KV head as query rows
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, scale=scale)  # noqa: E731
        sdpa()
        ms = do_bench(sdpa, warmup=25, rep=100, return_mode="median")
        row.sdpa_us = ms * 1e3
        row.sdpa_gbps = (kv_bytes + io_bytes) / (ms * 1e-3) / 1e9
        row.sdpa_frac = row.sdpa_gbps * 1e9 / copy_bw
        del k4, v4
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------- report


@dataclass
class Report:
    command: str
    device: str
    torch: str
    triton: str
    checks: list[Check]
    copy_gbps: float | None = None
    model: dict = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    goal: str = ""
    seconds: float = 0.0


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def to_markdown(r: Report) -> str:
    lines = [
        f"# Kernel bench: {r.device}",
        "",
        f"- command: `{r.command}`",
        f"- torch {r.torch}, triton {r.triton}; {r.seconds:.0f} s",
    ]
    if r.copy_gbps is not None:
        lines.append(f"- copy bandwidth (device to device, read + write): {r.copy_gbps:.0f} GB/s")
    if r.model:
        lines.append("- decode model: " + ", ".join(f"{k}={v}" for k, v in r.model.items()))
    if r.goal:
        lines.append(f"- goal (>= {GOAL_FRACTION:.0%} of copy bandwidth at context >= {GOAL_MIN_CONTEXT}): {r.goal}")
    lines += ["", "## Correctness (Triton vs torch reference)", "", "| kernel | case | max rel. error | ok |", "|---|---|---|---|"]
    lines += [f"| {c.kernel} | {c.case} | {c.max_rel_error:.2e} | {'yes' if c.ok else 'NO'} |" for c in r.checks]
    if r.rows:
        lines += [
            "",
            "## Decode attention (median of do_bench)",
            "",
            "| cache | context | batch | KV MiB | splits | Triton µs | Triton GB/s | % copy BW | SDPA µs | SDPA GB/s | SDPA % copy BW | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for w in r.rows:
            lines.append(
                f"| {w.cache} | {w.context} | {w.batch} | {w.kv_mib:.0f} | {w.splits} | {_fmt(w.triton_us, '.1f')} "
                f"| {_fmt(w.triton_gbps, '.0f')} | {_fmt(w.triton_frac and 100 * w.triton_frac, '.0f')} "
                f"| {_fmt(w.sdpa_us, '.1f')} | {_fmt(w.sdpa_gbps, '.0f')} | {_fmt(w.sdpa_frac and 100 * w.sdpa_frac, '.0f')} "
                f"| {w.note} |"
            )
    return "\n".join(lines) + "\n"


def _goal(rows: list[Row]) -> str:
    timed = [w for w in rows if w.cache in ("bf16", "fp16") and w.context >= GOAL_MIN_CONTEXT and w.triton_frac]
    if not timed:
        return "not measured"
    worst = min(timed, key=lambda w: w.triton_frac)
    met = sum(w.triton_frac >= GOAL_FRACTION for w in timed)
    return (f"{met}/{len(timed)} configurations meet it; worst {100 * worst.triton_frac:.0f}% "
            f"(context {worst.context}, batch {worst.batch})")


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlab.kernels.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--check-only", action="store_true", help="run the correctness checks only")
    ap.add_argument("--contexts", type=_ints, default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--batches", type=_ints, default=[1, 4, 16, 64, 256])
    ap.add_argument("--caches", default="bf16,fp8_e4m3", help="cache formats to time (comma list)")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-sdpa", action="store_true", help="skip the SDPA baseline")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="where the table goes (not written with --check-only unless --write)")
    ap.add_argument("--write", action="store_true", help="write the table even with --check-only")
    args = ap.parse_args(argv)

    import triton

    start = time.time()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.machine()}, Triton interpreter)"
    report = Report(
        command=" ".join(["python -m kvlab.kernels.bench", *(sys.argv[1:] if argv is None else argv)]),
        device=name, torch=torch.__version__, triton=triton.__version__, checks=run_checks(device),
    )
    failed = [c for c in report.checks if not c.ok]
    if cuda and not args.check_only:
        report.copy_gbps = copy_bandwidth(device) / 1e9
        report.model = dict(q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                            block_size=args.block_size, q_dtype="bf16")
        for cache in args.caches.split(","):
            for ctx in args.contexts:
                for batch in args.batches:
                    row = time_decode(ctx, batch, cache, args, report.copy_gbps * 1e9, device)
                    report.rows.append(row)
                    print(f"{cache} ctx={ctx} batch={batch}: {_fmt(row.triton_us, '.1f')} us "
                          f"{_fmt(row.triton_frac and 100 * row.triton_frac, '.0f')}% {row.note}", flush=True)
        report.goal = _goal(report.rows)
    elif not cuda and not args.check_only:
        print("no CUDA device: running the correctness checks only (under the Triton interpreter)")
    report.seconds = time.time() - start
    text = to_markdown(report)
    print(text)
    if (cuda and not args.check_only) or args.write:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        stem = args.out_dir / f"kernels_bench_{_slug(name)}"
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps(asdict(report), indent=2))
        print(f"wrote {stem}.md and {stem}.json")
    if failed:
        print(f"{len(failed)} check(s) FAILED: " + ", ".join(f"{c.kernel}/{c.case}" for c in failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

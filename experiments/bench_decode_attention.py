"""Decode attention on the CPU: the native kernel (kvlab.kernels.cpu) against the torch reference, at the memory roof.

One layer's decode attention (one query per sequence) over a paged pool in SmolLM2-135M's shape (9 query heads,
3 KV heads, head_dim 64, 16-token pages held in shuffled order), for batch x context x cache format. Both
backends run on the same pool and plan, interleaved within every repeat; the time is the median over repeats
of the mean over --iters calls. Bytes read are the pages' K and V bytes as stored (codes, scales and zero points
of packed pages; residual rows of open pages), each once; GB/s is bytes / time, and the roof is the machine's
streaming read measured in the same run (`torch.sum` over a --roof-gib GiB tensor of random float32, same thread
count). A decode step of SmolLM2 runs this 30 times (30 layers).

    python experiments/bench_decode_attention.py                       # the full grid, 1 thread
    python experiments/bench_decode_attention.py --batch 1 --context 512 --formats fp32 --repeats 2 --out /tmp/da
    python experiments/bench_decode_attention.py --baseline 42069e7   # also the kernel of that commit, same run
    python experiments/bench_decode_attention.py --batch 16 --context 4096 --formats fp32 --q-len 1 5 \
        --out experiments/results/verify_attention_cpu   # a verification pass: k + 1 = 5 query rows a sequence

--q-len n gives each sequence n query rows (a chain: row j sees the keys up to cache index context - n + j), the
shape of a verification pass; the kernel runs chunks of n <= MAX_KERNEL_Q as n decode rows, the reference the rest.
The bytes column still counts each stored byte once (the kernel reads a sequence's pages once per query row).

With --baseline REV the kernel source of that git revision is built the same way (its own library in the kernel
cache, kvlab.study.kernel_revision) and timed beside this one's, interleaved with it. --threads 1 2 gives every
cell once per thread count, each count with its own roof. "in decode steps" divides a row's kernel time by the
q_len-1 row's of the same cell (add --q-len 1): what a verification chunk of q_len queries costs in decode steps.

    python experiments/bench_decode_attention.py --batch 16 --context 4096 --formats fp32 bf16-q --q-len 1 3 5 9 \
        --threads 1 2 --baseline a2790e0 --no-reference   # chunk cost before / after, one and two threads
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from kvlab.study.bench_io import REPO, log, metadata, provenance, save, table
from kvlab.study.kernel_revision import kernel_at, kernel_swapped

FORMATS = ["fp32", "bf16", "bf16-q", "fp16", "int8", "fp8_e4m3", "int4"]
DEFAULT_FORMATS = ["fp32", "bf16", "fp16", "int8", "int4"]
QUERY_BF16 = {"bf16-q": "bf16"}  # a bf16 pool read by bf16 queries (the engine's bf16 compute dtype)
HQ, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30  # SmolLM2-135M
COLUMNS = [("threads", "threads"), ("batch", "batch"), ("context", "context"), ("format", "format"), ("q_len", "query rows a sequence"), ("mib", "K+V MiB read"),
           ("kernel_ms", "kernel ms"), ("per_decode", "in decode steps"), ("ref_ms", "reference ms"), ("speedup", "reference / kernel"),
           ("kernel_gbs", "kernel GB/s"), ("kernel_roof", "kernel / roof"), ("ref_roof", "reference / roof"),
           ("kernel_cpu_roof", "kernel / roof, CPU time"), ("ref_cpu_roof", "reference / roof, CPU time"),
           ("step_ms", "kernel ms per step (x30 layers)"), ("max_diff_s", "max |kernel - ref|")]


def read_roof(gib: float, repeats: int) -> tuple[float, float]:
    """Streaming read GB/s by wall time and by this thread's CPU time: torch.sum over random float32 (constant
    data reads faster than memory can deliver)."""
    import torch

    x = torch.rand(int(gib * (1 << 30)) // 4)
    x.sum()
    wall, cpu = zip(*(timed(x.sum, 1) for _ in range(repeats)))
    return x.numel() * 4 / statistics.median(wall) / 1e9, x.numel() * 4 / statistics.median(cpu) / 1e9


def pool(fmt: str, batch: int, context: int, seed: int):
    """(k, v, plan, bytes read): `batch` sequences of `context` random tokens in a pool of shuffled pages."""
    import torch

    from kvlab.cache.block_manager import LayerGroup
    from kvlab.cache.kv_cache import KVCache
    from kvlab.engine.attention import leaving_window
    from kvlab.kernels.attention_plan import plan_paged_attention
    from kvlab.registry import build

    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BS)
    num_pages = batch * per_seq + 1
    pages = torch.randperm(num_pages, generator=g).tolist()
    tables = [pages[b * per_seq:(b + 1) * per_seq] for b in range(batch)]
    quant = build("quant", fmt)
    cache = KVCache([LayerGroup((0,))], num_pages + 1, BS, HKV, D, quant, torch.float32, "cpu",
                    residual_rows=batch * 4 if quant.packed else None)
    for table in tables:
        index = torch.arange(context)
        slots = torch.tensor(table)[index // BS] * BS + index % BS
        x = torch.randn(context, HKV, D, generator=g)
        seal = leaving_window([table], [context], [context], getattr(quant, "residual", None) or 0, BS)
        cache.begin_step([slots], None if cache.residual is None else [seal])
        cache.store(0, x, torch.randn(context, HKV, D, generator=g), slots)
    plan = plan_paged_attention(list(range(batch + 1)), [context] * batch, tables, BS)
    return cache.k(0), cache.v(0), plan, bytes_read(cache, tables, context)


def bytes_read(cache, tables, context: int) -> int:
    """K and V bytes of every page the batch reads, as stored (an open page: its residual row)."""
    k, v = cache.k(0), cache.v(0)
    if not cache.quant.packed:
        return 2 * len(tables) * context * HKV * D * k.element_size()
    total = 0
    for store in (k, v):
        page_bytes = sum(t[0].numel() * t.element_size() for t in store.parts.values())
        row_bytes = BS * HKV * D * (store.residual.element_size() if store.residual is not None else 0)
        for table in tables:
            for page in table:
                total += row_bytes if cache.area is not None and cache.area.row(page) >= 0 else page_bytes
    return total


def timed(fn, iters: int) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) per call, the mean over `iters` calls. With one thread the
    kernel runs on the calling thread, so CPU time leaves out the time other jobs held the core."""
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - w0) / iters, (time.thread_time() - c0) / iters


def run(args) -> tuple[list[dict], dict[int, tuple[float, float]]]:
    import torch

    from kvlab.kernels.attention_plan import plan_paged_attention
    from kvlab.kernels.cpu import decode_attention as cpu
    from kvlab.kernels.reference import paged_attention as ref

    if not cpu.available():
        raise SystemExit("the CPU kernels are not available (no g++, or KVLAB_CPU_KERNELS=0)")
    baseline = kernel_at(args.baseline) if args.baseline else None
    rows, roofs = [], {}
    for threads in args.threads:
        torch.set_num_threads(threads)  # the kernel runs torch.get_num_threads() OpenMP threads
        roofs[threads] = read_roof(args.roof_gib, 5)
        log(f"streaming read roof: {roofs[threads][0]:.1f} GB/s, {roofs[threads][1]:.1f} GB/s by CPU time "
            f"({threads} thread(s))")
        for batch, context, fmt in itertools.product(args.batch, args.context, args.formats):
            k, v, plan0, nbytes = pool(QUERY_BF16.get(fmt, fmt), batch, context, args.seed)
            for q_len in args.q_len:
                rows.append(cell(args, threads, roofs[threads], batch, context, fmt, q_len, k, v, plan0, nbytes,
                                 baseline, cpu, ref, plan_paged_attention))
            del k, v, plan0
    add_per_decode_step(rows)
    return rows, roofs


def cell(args, threads, roof, batch, context, fmt, q_len, k, v, plan0, nbytes, baseline, cpu, ref, plan_paged_attention):
    """One (threads, batch, context, format, q_len) row: kernel, reference and baseline interleaved per repeat."""
    import torch

    roof, roof_cpu = roof
    plan = plan_paged_attention([b * q_len for b in range(batch + 1)], plan0.seq_lens, plan0.block_tables, BS)
    q = torch.randn(batch * q_len, HQ, D).to(torch.bfloat16 if fmt in QUERY_BF16 else torch.float32)
    run_kernel = lambda: cpu.run_paged_attention(q, k, v, plan, 0.125)  # noqa: E731
    run_ref = lambda: ref.run_paged_attention(q, k, v, plan, 0.125)  # noqa: E731
    diff = float((run_kernel().float() - run_ref().float()).abs().max())  # also warms both up (plans, memos)
    kt, rt, bt = [], [], []
    for _ in range(args.repeats):
        kt.append(timed(run_kernel, args.iters))
        if not args.no_reference:
            rt.append(timed(run_ref, max(1, args.iters // 4)))
        if baseline is not None:
            with kernel_swapped(baseline):
                bt.append(timed(run_kernel, args.iters))
    km, kc = (statistics.median(t[i] for t in kt) for i in (0, 1))
    row = {"threads": threads, "batch": batch, "q_len": q_len, "context": context, "format": fmt,
           "mib": nbytes / 2**20, "kernel_ms": 1e3 * km, "kernel_gbs": nbytes / km / 1e9,
           "kernel_roof": nbytes / km / 1e9 / roof, "kernel_cpu_roof": nbytes / kc / 1e9 / roof_cpu,
           "step_ms": 1e3 * km * LAYERS, "max_diff": diff, "max_diff_s": f"{diff:.1e}", "kernel_s": kt,
           "roof_gbs": roof}
    if rt:
        rm, rc = (statistics.median(t[i] for t in rt) for i in (0, 1))
        row.update(ref_ms=1e3 * rm, speedup=rm / km, ref_gbs=nbytes / rm / 1e9, ref_roof=nbytes / rm / 1e9 / roof,
                   ref_cpu_roof=nbytes / rc / 1e9 / roof_cpu, ref_s=rt)
    if bt:
        bm, bc = statistics.median(t[0] for t in bt), statistics.median(t[1] for t in bt)
        row.update(baseline_ms=1e3 * bm, baseline_speedup=bm / km, baseline_cpu_roof=nbytes / bc / 1e9 / roof_cpu,
                   baseline_s=bt)
    log(f"{threads}t b{batch} q{q_len} ctx{context} {fmt}: kernel {1e3 * km:.2f} ms ({nbytes / km / 1e9:.1f} GB/s, "
        f"{nbytes / kc / 1e9:.1f} by CPU time)" + (f", baseline {row['baseline_ms']:.2f} ms" if bt else ""))
    return row


def add_per_decode_step(rows: list[dict]) -> None:
    """A chunk's time in decode steps: its kernel ms over the q_len-1 row's of the same threads / batch / context /
    format (the cost a verification pass pays), for this kernel and the baseline alike."""
    key = lambda r: (r["threads"], r["batch"], r["context"], r["format"])  # noqa: E731
    decode = {key(r): r for r in rows if r["q_len"] == 1}
    for r in rows:
        one = decode.get(key(r))
        if one is None:
            continue
        r["per_decode"] = r["kernel_ms"] / one["kernel_ms"]
        if "baseline_ms" in r:
            r["baseline_per_decode"] = r["baseline_ms"] / one["baseline_ms"]


def report(rows: list[dict], roofs: dict[int, tuple[float, float]], meta: dict, args) -> str:
    columns = COLUMNS
    if args.no_reference:
        columns = [c for c in columns if c[0] not in ("ref_ms", "speedup", "ref_roof", "ref_cpu_roof")]
    if args.baseline:
        at = [c[0] for c in columns].index("speedup" if not args.no_reference else "kernel_ms") + 1
        columns = columns[:at] + [("baseline_ms", f"kernel at {args.baseline} ms"),
                                  ("baseline_speedup", f"{args.baseline} / kernel"),
                                  ("baseline_per_decode", f"{args.baseline}: in decode steps"),
                                  ("baseline_cpu_roof", f"{args.baseline} / roof, CPU time")] + columns[at:]
    roof_text = "; ".join(f"{t} thread(s): **{w:.1f} GB/s** by wall time, **{c:.1f} GB/s** by the thread's CPU time"
                          for t, (w, c) in roofs.items())
    return "\n".join([
        "# Paged decode attention on the CPU: native kernel vs torch reference",
        "",
        *provenance(meta, "other jobs share the cores: timings are indicative only"),
        f"One layer's decode attention in SmolLM2-135M's shape ({HQ} query heads, {HKV} KV heads, head_dim {D}, "
        f"{BS}-token pages in shuffled order), fp32 queries (bf16-q: bf16 queries); threads: "
        f"{', '.join(map(str, args.threads))}. Time: median over "
        f"{args.repeats} repeats of the mean of {args.iters} kernel calls ({max(1, args.iters // 4)} reference "
        f"calls), both backends interleaved in every repeat. Bytes read: the pages' K and V as stored (int8: codes "
        "and fp16 scales; int4: KIVI codes, fp16 scales and zero points, and the fp32 residual rows of the open "
        "pages), once each. Roof: `torch.sum` over "
        f"{args.roof_gib} GiB of random float32 in the same run, each thread count before its rows: {roof_text}. "
        "The CPU-time columns divide bytes by the calling thread's CPU time (with one thread the kernel runs on it; "
        "with more they count the calling thread's share only) and compare with the roof's CPU-time figure: they "
        "leave out the time other jobs held the core, not the memory they shared. 'in decode steps': the row's "
        "kernel time over the q_len-1 row's (same threads, batch, context, format), what a verification chunk costs.",
        "",
        table(rows, columns),
        "",
    ])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, nargs="+", default=[512, 3000, 8192])
    p.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS, choices=FORMATS,
                   help="bf16-q: a bf16 pool and bf16 queries")
    p.add_argument("--q-len", type=int, nargs="+", default=[1], help="query rows a sequence (5: a k = 4 verification)")
    p.add_argument("--threads", type=int, nargs="+", default=[1],
                   help="torch and kernel threads, each its own rows and roof (the machine is shared)")
    p.add_argument("--no-reference", action="store_true", help="time the kernel (and baseline) only")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--iters", type=int, default=8, help="kernel calls per repeat (a quarter as many reference calls)")
    p.add_argument("--roof-gib", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", default=None, help="git revision whose kernel is timed beside this one")
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "decode_attention_cpu"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.model = "SmolLM2-135M attention shape"  # what metadata() records as the model
    meta = metadata(args)
    rows, roofs = run(args)
    meta["roofs"] = {str(t): {"gbs": w, "cpu_gbs": c} for t, (w, c) in roofs.items()}
    save(args.out, report(rows, roofs, meta, args), meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How fast a page moves between the pool and the tiers below it (kvlab/cache/tiers/rows.py), in MB/s of page data.

On a model's real pool (SmolLM2-135M: 30 layers x K/V = 60 pool tensors, a 16-token fp32 page is 737 KB in 60
slices of 12 KB), pages filled with random bits:
- per-slice (the earlier code): a page as 60 separate tensors, one allocation and one copy each, and back;
- host tier, one page at a time: `PagedKV.demote` then `restore_many` of one page (one batched copy per side);
- host tier, runs: `restore_many` of --run pages at once (a hit's pages: one copy a page);
- disk tier: `demote` (one file write per page), then the read ahead (one `readinto` per page, on the worker) and
  `restore_many` of the run; the read and the copy are timed together (page cache warm: the files were just written);
- the copy roof: one large contiguous copy of as many bytes.
Each figure is the median of --repeats; every restored page is checked bit for bit.

    nice -n 10 .venv/bin/python experiments/bench_tier_moves.py --out experiments/results/tier_moves_smollm2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from kvlab import LLM

    torch.set_num_threads(args.threads)
    n = args.pages
    mem = (2 * n + 2) * 737280 if args.model == "smollm2-135m" else "8MiB"
    llm = LLM(args.model, block_size=args.block_size, kv_cache_memory=args.kv_memory or mem,
              enable_prefix_caching=True, offload="host_disk",
              offload_args={"memory": "2GiB", "disk_memory": "4GiB"})
    kv = llm.engine.kv
    tensors = kv.cache.page_tensors()
    g = torch.Generator().manual_seed(0)
    for t in tensors:
        t[:2 * n].copy_(torch.randn(t[:2 * n].shape, generator=g).to(t.dtype) if t.is_floating_point()
                        else torch.randint(0, 255, t[:2 * n].shape, generator=g).to(t.dtype))
    want = [t[:n].clone() for t in tensors]
    page_bytes = kv.rows.nbytes
    rows: list[dict] = []

    def record(name: str, seconds: float, pages: int, note: str = "") -> None:
        mb = pages * page_bytes / 1e6
        rows.append({"move": name, "pages": pages, "ms": seconds * 1e3, "MB_per_s": mb / seconds, "note": note})
        print(f"{name}: {seconds * 1e3:.2f} ms for {pages} pages, {mb / seconds:.0f} MB/s", flush=True)

    def check() -> None:
        for t, w in zip(tensors, want):
            assert torch.equal(t[n:2 * n], w), "a restored page differs from the page demoted"

    def per_slice():
        for p in range(n):
            parts = [torch.empty(t[p].shape, dtype=t.dtype).copy_(t[p]) for t in tensors]
            for t, part in zip(tensors, parts):
                t[n + p].copy_(part)

    record("per-slice put+load (before)", timed(per_slice, args.repeats), 2 * n, "one copy per (page, tensor), both ways")
    check()

    def host(run: int):
        def go():
            for p in range(n):
                kv.demote(p, 0, ("h", p))
            for s in range(0, n, run):
                kv.restore_many([(("h", p), 0, n + p) for p in range(s, min(n, s + run))])
        return go

    record("host demote+restore, 1 page at a time", timed(host(1), args.repeats), 2 * n)
    check()
    record(f"host demote+restore, runs of {args.run}", timed(host(args.run), args.repeats), 2 * n)
    check()

    def host_restore_only(run: int):
        for p in range(n):
            kv.demote(p, 0, ("h", p))
        start = time.perf_counter()
        for s in range(0, n, run):
            kv.restore_many([(("h", p), 0, n + p) for p in range(s, min(n, s + run))])
        return time.perf_counter() - start

    record(f"host restore, runs of {args.run}", statistics.median(host_restore_only(args.run)
                                                                  for _ in range(args.repeats)), n)
    check()
    record("host restore, 1 page at a time", statistics.median(host_restore_only(1) for _ in range(args.repeats)), n)
    check()

    disk = kv.tiers[1]

    def disk_cycle(run: int) -> tuple[float, float]:
        start = time.perf_counter()
        for p in range(n):
            kv.demote(p, 1, ("d", p))
        wrote = time.perf_counter() - start
        start = time.perf_counter()
        for p in range(n):
            disk.start_read(("d", p))
        while disk.in_flight and len(disk.staged) < n:
            disk.wait()
            disk.poll()
        for s in range(0, n, run):
            kv.restore_many([(("d", p), 1, n + p) for p in range(s, min(n, s + run))])
        return wrote, time.perf_counter() - start

    cycles = [disk_cycle(args.run) for _ in range(args.repeats)]
    check()
    record("disk demote (one file write per page)", statistics.median(c[0] for c in cycles), n)
    record(f"disk read ahead on the worker + restore, runs of {args.run}", statistics.median(c[1] for c in cycles), n,
           "page cache warm")

    big = torch.empty(n * kv.rows.row_bytes, dtype=torch.uint8)
    src = torch.randint(0, 255, (n * kv.rows.row_bytes,), dtype=torch.uint8)
    record("copy roof (one contiguous copy)", timed(lambda: big.copy_(src), args.repeats), n)
    llm.close()
    load = Path("/proc/loadavg").read_text().split()[:3]
    results = {"command": " ".join(["python experiments/bench_tier_moves.py", *(sys.argv[1:] if argv is None else argv)]),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg": load, "args": vars(args),
               "page_bytes": page_bytes, "row_bytes": kv.rows.row_bytes, "pool_tensors": len(tensors), "rows": rows,
               "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    text = report(results, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(text)
    print(text)
    return results


def report(results: dict, args) -> str:
    lines = ["| move | pages | ms | MB/s | note |", "|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['move']} | {r['pages']} | {r['ms']:.2f} | {r['MB_per_s']:.0f} | {r['note']} |")
    return "\n".join([
        f"# Page moves between the pool and the tiers: {args.model}", "",
        f"{results['pool_tensors']} pool tensors; a page is {results['page_bytes']} bytes of data "
        f"({results['row_bytes']} in a tier row); {args.pages} pages, block {args.block_size}; medians of "
        f"{args.repeats}; {args.threads} torch thread(s). Run {results['date']}, `uptime`: {results['uptime']}", "",
        *lines, "", f"Command: `{results['command']}`", ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--pages", type=int, default=128)
    p.add_argument("--run", type=int, default=32, help="pages restored together")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-memory", default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "tier_moves_smollm2"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()

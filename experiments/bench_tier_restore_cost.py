"""What a request waits for when its pages come back from the disk tier, and what a step pays to send one down:
the parts of the cost model's two prices (kvlab/cache/tiers/placement/cost_model.py), timed on the real `DiskTier`.

For each page size (--page-bytes: SmolLM2-135M's fp32 page at block 2 and 16 by default) and run length N
(--pages: a hit of N pages), interleaved, --repeats times, warm and cold (the files synced and dropped from the OS
page cache, `DiskTier.drop_cached`: a history written long ago):
- restore, per request: the N reads ahead started on the tier's worker, waited for, each copied into a pool row
  (a [N, row_bytes] stand-in for the pool: one contiguous row a page, as the plain-format pool is) - what a
  request admitted on the hit waits for, from the reads' start to the last copy;
- restore, per page: one `read_row` (open + fstat + readinto + close) on the caller's thread;
- demote, the step's side: N `put`s with writes behind (a fresh row and one copy each, the write handed to the
  writer thread), and with writes inline (`async_writes=False`: the file write on the step);
- demote, behind: the writer's own time for the N writes (the queue drained, timed from the first submit) and
  the removal of N page files once restored (cold: synced files, whose blocks the removal frees), and the
  writer's CPU seconds for one page's write and removal (`DiskTier.behind_seconds`, what cost_aware charges);
- demote, what the step pays: a fixed forward-sized compute (--probe-ms of matmuls on one torch thread) timed
  alone and right after the N `put`s while their writes run behind; (put + slowdown) / N is the price a page's
  demotion costs the step on this machine: on cores with nothing free the writer's time is the step's.
Medians of the repeats; `latency` and `per_page` are the Theil-Sen line through (N, request seconds).

    nice -n 19 .venv/bin/python experiments/bench_tier_restore_cost.py --out experiments/results/tier_restore_cost
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvlab.study.bench_io import key_table, uptime, write_results

REPO = Path(__file__).resolve().parents[1]


def probe(threads_work) -> float:
    start = time.perf_counter()
    threads_work()
    return time.perf_counter() - start


def cycle(tier_cls, row_bytes: int, n: int, cold: bool, work, rng_row) -> dict:
    """One repeat of one (page size, N, warm/cold) cell: every timing in seconds."""
    import torch

    pool = torch.zeros((n, row_bytes), dtype=torch.uint8)  # the pool's rows the pages come back into
    keys = list(range(n))
    out = {}
    with tempfile.TemporaryDirectory(prefix="kvlab-restore-cost-") as folder:
        inline = tier_cls(n, row_bytes, path=folder + "/inline", async_writes=False)
        start = time.perf_counter()
        for k in keys:
            inline.put(k, lambda row: row.copy_(rng_row))
        out["put_inline_s"] = time.perf_counter() - start
        inline.close()

        tier = tier_cls(n, row_bytes, path=folder + "/tier")
        alone = probe(work)
        start = time.perf_counter()
        for k in keys:
            tier.put(k, lambda row: row.copy_(rng_row))
        out["put_behind_s"] = time.perf_counter() - start
        out["probe_alone_s"], out["probe_with_writes_s"] = alone, probe(work)
        tier.flush()
        out["writes_drained_s"] = time.perf_counter() - start  # from the first put to the last write's end
        if cold:
            tier.drop_cached()
        start = time.perf_counter()
        for k in keys:
            tier.start_read(k)
        while not all(tier.ready(k) for k in keys):
            assert not any(err for _, err in tier.poll()), "a read failed"
            if not all(tier.ready(k) for k in keys):
                tier.wait()
        for i, k in enumerate(keys):
            tier.load(k, lambda row, i=i: pool[i:i + 1].copy_(row))
        out["request_s"] = time.perf_counter() - start
        assert bool((pool == rng_row).all()), "a restored row differs from the row demoted"
        start = time.perf_counter()
        tier.writer.submit(lambda: None).result()  # the removals of the restored pages' files, behind
        out["removals_s"] = time.perf_counter() - start
        out["behind_cpu_s"] = tier.behind_seconds()  # the price's part behind the step: write + removal, CPU
        # one page on the caller's thread: write it, then read it (warm, or synced and dropped: cold)
        tier2 = tier_cls(1, row_bytes, path=folder + "/one", async_writes=False)
        tier2.put("p", lambda row: row.copy_(rng_row))
        if cold:
            tier2.drop_cached()
        from kvlab.cache.tiers.disk import read_row
        _, out["read_one_s"] = read_row(tier2.files["p"], row_bytes)
        tier2.close()
        tier.close()
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from kvlab.cache.tiers.disk import DiskTier
    from kvlab.cache.tiers.placement.cost_model import theil_sen

    torch.set_num_threads(1)
    started, before = time.strftime("%Y-%m-%d %H:%M", time.gmtime()), uptime()
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    probe(lambda: [a @ b for _ in range(200)])  # warm-up
    one = min(probe(lambda: [a @ b for _ in range(20)]) for _ in range(5)) / 20  # the fastest: unslowed
    reps = max(1, round(args.probe_ms / 1e3 / max(one, 1e-6)))

    def work():
        for _ in range(reps):
            a @ b

    sizes = [int(x) for x in args.page_bytes.split(",")]
    ns = [int(x) for x in args.pages.split(",")]
    cells = {(rb, n, cold): [] for rb in sizes for n in ns for cold in (False, True)}
    for r in range(args.repeats):
        order = list(cells) if r % 2 == 0 else list(cells)[::-1]
        for rb, n, cold in order:
            row = torch.randint(0, 255, (1, rb), dtype=torch.uint8)
            cells[(rb, n, cold)].append(cycle(DiskTier, rb, n, cold, work, row))
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    rows, lines = [], []
    for (rb, n, cold), runs in cells.items():
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        slow = statistics.median(x["probe_with_writes_s"] - x["probe_alone_s"] for x in runs)
        rows.append({"page_bytes": rb, "pages": n, "reads": "cold" if cold else "warm",
                     "request_ms": med["request_s"] * 1e3, "request_per_page_ms": med["request_s"] * 1e3 / n,
                     "read_one_page_ms": med["read_one_s"] * 1e3,
                     "put_behind_per_page_ms": med["put_behind_s"] * 1e3 / n,
                     "put_inline_per_page_ms": med["put_inline_s"] * 1e3 / n,
                     "writes_drained_per_page_ms": med["writes_drained_s"] * 1e3 / n,
                     "removal_per_page_ms": med["removals_s"] * 1e3 / n,
                     "behind_cpu_per_page_ms": med["behind_cpu_s"] * 1e3,
                     "probe_alone_ms": med["probe_alone_s"] * 1e3,
                     "step_slowdown_per_page_ms": slow * 1e3 / n,
                     "demote_paid_per_page_ms": (med["put_behind_s"] + slow) * 1e3 / n})
    fits = []
    for rb in sizes:
        for cold in (False, True):
            pts = [(n, x["request_s"]) for n in ns for x in cells[(rb, n, cold)]]
            lat, per = theil_sen(pts)
            fits.append({"page_bytes": rb, "reads": "cold" if cold else "warm", "latency_ms": lat * 1e3,
                         "per_page_ms": per * 1e3})
    results = {"command": " ".join(["python experiments/bench_tier_restore_cost.py",
                                    *(sys.argv[1:] if argv is None else argv)]),
               "date": f"{started} - {time.strftime('%H:%M UTC', time.gmtime())}", "uptime_before": before,
               "uptime_after": uptime(), "args": vars(args), "probe_matmuls": reps, "rows": rows, "fits": fits,
               "runs": {f"{rb}/{n}/{'cold' if c else 'warm'}": v for (rb, n, c), v in cells.items()}}
    text = "\n".join([
        "# What a disk-tier restore and demotion cost, as a request and a step pay them", "",
        f"Medians of {args.repeats} repeats, cells interleaved (kvlab.cache.tiers.disk.DiskTier in a temporary "
        f"folder on this machine's disk; one torch thread). See the script's docstring for each column.", "",
        key_table(rows), "", "Restore per request, Theil-Sen line through (pages, seconds) over every run:", "",
        key_table(fits), "", f"Command: `{results['command']}`, run {results['date']}.", "",
        f"`uptime` before: {before}; after: {results['uptime_after']}", ""])
    write_results(args.out, results, text)
    return results


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-bytes", default="92160,737280", help="SmolLM2-135M fp32 pages at block 2 and 16")
    p.add_argument("--pages", default="1,4,16,64")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--probe-ms", type=float, default=20.0, help="the compute the demotions' slowdown is timed on")
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "tier_restore_cost"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()

"""Restore or recompute: the history length where bringing a conversation's pages back from the disk tier stops
beating recomputing them, and whether the cost-aware placement chooses the faster side of it.

For each history length L (--lengths) and variant, on a fresh engine whose pool holds one history: a first turn of
L WikiText-2 tokens (1 greedy token), a filler prompt that takes every pool page (the whole history leaves the
pool: down to the disk tier where there is one), then the returning turn: the history, its answer and a
--user-len-token message. Its time to first token is what is compared (medians of --repeats, each on different
text, the variants run back to back on it, in alternating order):
- pool_hit: a pool three times as large, so the history stays resident: only the message is computed (the floor
  the two sides below are measured against);
- recompute: prefix caching without tiers (the history is recomputed with the new message);
- disk_recompute: the disk tier, every hit recomputed (cost_aware with fixed priors that never restore): the
  evicted pages are demoted as in `disk`, so `disk - disk_recompute` is restore against recompute alone;
- disk: the history comes back from the disk tier (read ahead on the worker, one copy per page; the pages its
  fresh pages evict are written behind, on the tier's second worker);
- disk_sync_writes (not run by default): the same with the evicted pages' file writes made inline;
- cost_aware: the disk tier with the cost-aware placement and its measured rates (start-up calibration of the
  tier and of the model's forwards, then the engine's own steps): it restores, recomputes, or keeps no page in the
  tier at all (none worth it: the pages are dropped, as without tiers); the table says which (`recompute` for
  both of the last), and its crossover estimate.
With --cold the tier's page files are synced and dropped from the OS page cache before the returning turn
(`DiskTier.drop_cached`: a history written long ago, read from the device), and cost_aware calibrates cold reads
(`cold_calibration`). Outputs are checked equal across the variants.

    python experiments/bench_tier_crossover.py --model random:llama-tiny --block-size 4 --lengths 4,8,16,32,64 \
        --user-len 8 --repeats 3 --out /tmp/crossover_tiny        # seconds
    nice -n 10 .venv/bin/python experiments/bench_tier_crossover.py --out experiments/results/tier_crossover_smollm2
    nice -n 10 .venv/bin/python experiments/bench_tier_crossover.py --model random:kv-smollm2 --block-size 2 \
        --lengths 16,64,128,256 --user-len 16 --repeats 9 --cold \
        --out experiments/results/tier_crossover_kv_smollm2_bs2_cold                  # ~4 min on 2 loaded cores
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

from kvlab.study.bench_io import key_table, uptime, write_results

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"pool_hit": {}, "recompute": {}, "disk": {"offload": "disk"},
            "disk_recompute": {"offload": "disk", "offload_placement": "cost_aware",  # demotes, never restores
                               "offload_placement_args": {"measured": False, "disk_latency_s": 1e6}},
            "disk_sync_writes": {"offload": "disk", "offload_args": {"async_writes": False}},
            "cost_aware": {"offload": "disk", "offload_placement": "cost_aware"}}


def one(loaded, text: list[int], length: int, variant: str, args, page_bytes: int) -> dict:
    from kvlab import LLM, SamplingParams

    bs = args.block_size
    pool_pages = pool_size(length, args)
    pages = pool_pages * (3 if variant == "pool_hit" else 1)  # pool_hit: the history stays in the pool
    engine = copy.deepcopy(VARIANTS[variant])
    if args.cold and variant == "cost_aware":  # it is told its pages come back cold: it calibrates cold reads
        engine["offload_placement_args"] = {"cold_calibration": True}
    llm = LLM(args.model, loaded=copy.deepcopy(loaded), block_size=bs, kv_cache_memory=pages * page_bytes,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True, **engine)
    one_token = SamplingParams(max_tokens=1, ignore_eos=True)
    filler_len = pool_pages * bs - 1  # with its sampled token it takes every page: the whole history leaves
    first, filler, message = text[:length], text[length:length + filler_len], text[-args.user_len:]
    answer = llm.generate([first], one_token)[0].token_ids
    llm.generate([filler], one_token)
    if args.cold:  # the history was written long ago: its page files are read from the device
        for tier in llm.engine.kv.tiers:
            if hasattr(tier, "drop_cached"):
                tier.drop_cached()
    demoted_before = llm.stats().get("tier_demoted", 0)
    start = time.perf_counter()
    out = llm.generate([first + answer + message], one_token)[0]
    wall = time.perf_counter() - start
    stats = llm.stats()
    placement = llm.engine.kv.places.placement if llm.engine.kv.places is not None else None
    cross = placement.crossover_tokens(0) if hasattr(placement, "crossover_tokens") else None
    hist = length // bs  # the history's full pages (the ones a hit can restore): the model's two sides, at the end
    predicted = (placement.restore_seconds(0, hist), placement.recompute_seconds(hist * bs)) \
        if hasattr(placement, "rates") else (None, None)
    demote = placement.demote_seconds(0) if hasattr(placement, "demote_seconds") else None
    worth = placement.worth(0) if hasattr(placement, "worth") else None
    llm.close()
    return {"ttft_s": out.ttft_s if out.ttft_s is not None else wall, "restored": stats.get("tier_restored", 0),
            "demoted": stats.get("tier_demoted", 0) - demoted_before, "predicted_demote_s": demote,
            "worth": worth,
            "refused": stats.get("tier_refused", 0),
            "recomputed": stats.get("tier_recomputed", 0), "crossover_estimate": cross, "predicted": predicted,
            "answer": out.outputs[0].token_ids}


def pool_size(length: int, args) -> int:
    """Pool pages: one history, its answer and message, and two spare."""
    return -(-(length + args.user_len + 8) // args.block_size) + 2


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from kvlab import LLM
    from kvlab.models import load_model
    from kvlab.study.tasks.data import ByteTokenizer, corpus_tokens
    from kvlab.study.workloads.azure import DEFAULT_CORPUS

    started, before = time.strftime("%Y-%m-%d %H:%M", time.gmtime()), uptime()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    tokenizer = loaded.tokenizer or ByteTokenizer(loaded.model.config.vocab_size)
    corpus = corpus_tokens(DEFAULT_CORPUS, None, tokenizer)
    probe = LLM(args.model, loaded=copy.deepcopy(loaded), block_size=args.block_size, kv_cache_memory="1MiB")
    page_bytes = probe.engine.bytes_per_block
    del probe
    lengths = [int(x) for x in args.lengths.split(",")]
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    rows = []
    for length in lengths:
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for r in range(args.repeats):
            size = length + pool_size(length, args) * args.block_size + args.user_len  # history, filler, message
            offset = (r * 7919 + length * 131) % (len(corpus) - size - 1)
            text = corpus[offset:offset + size]
            for v in (variants if r % 2 == 0 else variants[::-1]):
                runs[v].append(one(loaded, text, length, v, args, page_bytes))
        rows.append(row(length, runs))
        print({k: v for k, v in rows[-1].items() if k != "runs_ttft_ms"}, flush=True)
        results = finish(args, argv, started, before, page_bytes, rows)  # every length kept, should a run be cut
    return results


def finish(args, argv, started: str, before: str, page_bytes: int, rows: list[dict]) -> dict:
    command = " ".join(["python experiments/bench_tier_crossover.py", *(sys.argv[1:] if argv is None else argv)])
    results = {"command": command, "date": f"{started} - {time.strftime('%H:%M UTC', time.gmtime())}",
               "uptime_before": before, "uptime_after": uptime(), "args": vars(args), "page_bytes": page_bytes,
               "rows": rows}
    write_results(args.out, results, report(results, args))
    return results



def row(length: int, runs: dict[str, list[dict]]) -> dict:
    """One history length's table row: TTFT medians, the two sides measured against the pool hit (the history
    resident: only the message computed) and as cost_aware predicted them, its choice and whether it was right."""
    med = {v: statistics.median(x["ttft_s"] for x in rs) for v, rs in runs.items()}
    ca = runs["cost_aware"]
    choice = ("restore" if all(x["restored"] for x in ca) else "recompute" if not any(x["restored"] for x in ca)
              else "mixed")
    hit = statistics.median(x["restored"] for x in runs["disk"]) > 0  # else no variant restores: nothing to choose
    recomputes = [v for v in ("recompute", "disk_recompute") if v in runs]

    def paired(v: str) -> float:  # disk minus `v` on the same text, run back to back: the median over runs
        return statistics.median(a["ttft_s"] - b["ttft_s"] for a, b in zip(runs["disk"], runs[v]))

    diffs = {v: paired(v) for v in recomputes}
    faster = ("restore" if all(d < 0 for d in diffs.values()) else "recompute") if hit else "n/a"
    best = min(med[v] for v in ("disk", *recomputes))
    close = abs(med["disk"] / min(med[v] for v in recomputes) - 1) < 0.1
    return {"history_tokens": length, **{f"ttft_{v}_ms": m * 1e3 for v, m in med.items()},
            **{f"restore_minus_{v}_ms": d * 1e3 for v, d in diffs.items()},
            "faster": faster, "cost_aware_chose": choice,
            "cost_aware_correct": (choice == faster or close) if hit else "n/a",
            "cost_aware_vs_best": med["cost_aware"] / best,
            "crossover_estimate_tokens": statistics.median(x["crossover_estimate"] for x in ca),
            "measured_restore_ms": (med["disk"] - med["pool_hit"]) * 1e3,
            "predicted_restore_ms": statistics.median(x["predicted"][0] for x in ca) * 1e3,
            "measured_recompute_ms": (med["disk_recompute"] - med["pool_hit"]) * 1e3,
            "predicted_recompute_ms": statistics.median(x["predicted"][1] for x in ca) * 1e3,
            "demoted_pages": statistics.median(x["demoted"] for x in runs["disk_recompute"]),
            "measured_demote_ms_per_page": (med["disk_recompute"] - med["recompute"]) * 1e3 / max(
                statistics.median(x["demoted"] for x in runs["disk_recompute"]), 1) if "recompute" in med else None,
            "predicted_demote_ms_per_page": statistics.median(x["predicted_demote_s"] for x in ca) * 1e3,
            "cost_aware_keeps_pages": statistics.median(1.0 if x["worth"] else 0.0 for x in ca),
            "cost_aware_refused_pages": statistics.median(x["refused"] for x in ca),
            "disk_restored_pages": statistics.median(x["restored"] for x in runs["disk"]),
            "answers_identical": all(x["answer"] == rs[0]["answer"] for rs in zip(*runs.values()) for x in rs),
            "runs_ttft_ms": {v: [round(x["ttft_s"] * 1e3, 3) for x in rs] for v, rs in runs.items()}}


def report(results: dict, args) -> str:
    lines = [key_table([{k: v for k, v in r.items() if k != "runs_ttft_ms"} for r in results["rows"]])]
    return "\n".join([
        f"# Restore from disk or recompute: {args.model}", "",
        f"A returning turn: a history of `history_tokens` WikiText-2 tokens and its answer, then a {args.user_len}-token "
        f"message; the pool holds one history (block {args.block_size}, {results['page_bytes']} bytes a page) and a "
        f"filler pushed all of it out{' (then dropped from the OS page cache: cold reads)' if args.cold else ''}. "
        f"TTFT medians of {args.repeats} runs (fresh engine each, different text, the variants back to back); "
        f"{args.threads} torch thread(s). `pool_hit`: the history resident (only the message computed); "
        f"`disk_recompute`: the tier demotes as `disk` does but every hit is recomputed. `restore_minus_<v>_ms`:"
        f" the median over runs of disk minus variant v on the same text; `faster`: restore where it beats both "
        f"ways of recomputing (without a tier, and with it), else recompute; `cost_aware_correct`: its choice is "
        f"the faster one (or disk's median is within 10% of the faster recompute's); `cost_aware_chose` "
        f"`recompute` also where it kept no page in the tier; `cost_aware_vs_best`: its TTFT over the fastest of "
        f"disk, recompute and disk_recompute; `measured_restore_ms` / `measured_recompute_ms`: disk / disk_recompute minus pool_hit (each "
        f"includes the same demotions of the evicted filler pages); `predicted_*`: cost_aware's model of the two "
        f"sides for the history at the end of the run; `cost_aware_refused_pages`: pages it kept out of the tier; "
        f"`disk_restored_pages`: pages the disk variant restored (0: no hit reached the tier: n/a); "
        f"`demoted_pages`: pages the returning turn demoted (disk_recompute); `measured_demote_ms_per_page`: "
        f"(disk_recompute - recompute) over them, the tier's whole cost to the turn (demotions, the recomputed "
        f"pages' files removed); `predicted_demote_ms_per_page`: cost_aware's price (the put and the work behind "
        f"it); `cost_aware_keeps_pages`: share of runs where its `worth` said a page is worth a tier at the end "
        f"(medians). "
        f"Per-run TTFTs are in the .json.", "", *lines, "",
        f"Command: `{results['command']}`, run {results['date']}.", "",
        f"`uptime` before: {results['uptime_before']}; after: {results['uptime_after']}", ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="4,8,16,32,64,128,256,512,1024")
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variants", default="pool_hit,recompute,disk_recompute,disk,cost_aware",
                   help=f"of {', '.join(VARIANTS)} (pool_hit, disk_recompute, disk and cost_aware needed)")
    p.add_argument("--cold", action="store_true",
                   help="drop the tier's page files from the OS page cache before the returning turn (cold reads)")
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "tier_crossover_smollm2"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()

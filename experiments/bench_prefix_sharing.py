"""Prefix sharing at one KV byte budget: hit rate, concurrent sequences and throughput, on vs off.

Workload: one WikiText-2 "system prompt" of --system-len tokens prepended to --num-requests WikiText-2
suffixes of --suffix-len tokens, all queued at t=0, greedy, --max-tokens new tokens each with EOS
ignored. The KV budget holds --fits whole requests without sharing. With `enable_prefix_caching` the
first request computes the system prompt and every later one reuses its full pages, so more
requests fit at once and their prefill shrinks to their suffix.

One process, one model load; the variants alternate for --repeats rounds, each on a fresh engine (so
no hit survives from an earlier round); tables show medians.

    python experiments/bench_prefix_sharing.py                  # a few minutes on 2 quiet cores
    python experiments/bench_prefix_sharing.py --num-requests 4 --repeats 1 --out /tmp/prefix_sharing
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

from kvlab.study.bench_io import REPO, commit_line, load_average, log, metadata, table

STATS = ("max_concurrent_seqs", "mean_concurrent_seqs", "tokens_per_s", "busy_s", "preemptions", "num_steps",
         "ttft_median_s", "kv_blocks_peak")
PREFIX = ("prefix_hit_rate_tokens", "prefix_hit_rate_pages", "prefix_pages_saved", "prefix_evictions")
COLUMNS = [("variant", "prefix caching"), ("prefix_hit_rate_tokens", "hit rate (tokens)"),
           ("prefix_hit_rate_pages", "hit rate (pages)"), ("prefix_pages_saved", "pages saved"),
           ("max_concurrent_seqs", "max seqs"), ("mean_concurrent_seqs", "mean seqs"),
           ("tokens_per_s", "tok/s (busy)"), ("wall_s", "wall s"), ("ttft_median_s", "TTFT p50 s"),
           ("kv_blocks_peak", "pages peak"), ("preemptions", "preemptions"), ("num_steps", "steps")]


def make_prompts(tokenizer, args) -> list[list[int]]:
    from kvlab.study.tasks.data import corpus_tokens, evenly_spaced_windows
    from kvlab.study.workloads.azure import DEFAULT_CORPUS

    windows = evenly_spaced_windows(corpus_tokens(DEFAULT_CORPUS, None, tokenizer), args.system_len,
                                    args.num_requests + 2)
    system = windows[0]
    return [system + w[:args.suffix_len] for w in windows[1:args.num_requests + 1]], windows[-1][:32]


def measure(loaded, prompts, warmup, on: bool, args) -> dict:
    from kvlab import LLM, SamplingParams

    llm = LLM(args.model, loaded=copy.deepcopy(loaded), block_size=args.block_size, kv_cache_memory=args.kv_bytes,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=on)
    llm.generate([warmup], SamplingParams(max_tokens=2))  # no prefix in common with the workload
    llm.reset_stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    wall = time.perf_counter() - start
    stats = llm.stats()
    return {**{k: stats[k] for k in STATS}, **{k: stats.get(k, 0) for k in PREFIX}, "wall_s": wall,
            "kv_blocks_total": llm.engine.block_manager.num_blocks, "token_ids": [o.token_ids for o in outputs]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from kvlab.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    meta = metadata(args)
    loaded = load_model(args.model)
    prompts, warmup = make_prompts(loaded.tokenizer, args)
    cfg = loaded.model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, float32
    per_request = args.system_len + args.suffix_len + args.max_tokens
    args.kv_bytes = args.fits * -(-per_request // args.block_size) * args.block_size * per_token
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(args.repeats):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            log(f"round {r + 1}/{args.repeats}: prefix caching {name}")
            runs[name].append(measure(loaded, prompts, warmup, name == "on", args))
            log(f"  {runs[name][-1]['tokens_per_s']:.2f} tok/s, max seqs {runs[name][-1]['max_concurrent_seqs']}")
    rows = [{"variant": name, **{k: statistics.median(x[k] for x in rs) for k in (*STATS, *PREFIX, "wall_s")}}
            for name, rs in runs.items()]
    off, on = rows
    same = all(x["token_ids"] == runs["off"][0]["token_ids"] for rs in runs.values() for x in rs)
    ratios = {k: on[k] / off[k] for k in ("max_concurrent_seqs", "mean_concurrent_seqs", "tokens_per_s", "wall_s")}
    meta["load_end"] = load_average()
    results = {"rows": rows, "ratios": ratios, "same_greedy_tokens": same, "kv_bytes": args.kv_bytes,
               "runs": {n: [{k: v for k, v in x.items() if k != "token_ids"} for x in rs] for n, rs in runs.items()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": {k: str(v) for k, v in meta.items()}, **results},
                                                   indent=1))
    out.with_suffix(".md").write_text(report(results, meta, args))
    log(f"wrote {out.with_suffix('.md')}")
    return results


def report(results: dict, meta: dict, args) -> str:
    r = results["ratios"]
    return "\n".join([
        f"# Prefix sharing on vs off, {args.model} ({commit_line(meta)})", "",
        f"Command: `{meta['command']}`  ", f"Date: {meta['started_at']}  ", f"Machine: {meta['machine']}  ",
        f"Load average (1/5/15 min) at start: {meta['load_start']}, at end: {meta['load_end']} (other agents' jobs "
        f"shared the 2 cores during the run; wall and busy time include their interference)", "",
        f"{args.num_requests} requests = one {args.system_len}-token WikiText-2 system prompt + a "
        f"{args.suffix_len}-token suffix each, {args.max_tokens} new tokens (greedy, EOS ignored), all queued at "
        f"t=0. KV budget {results['kv_bytes'] / 2**20:.1f} MiB = {args.fits} whole requests without sharing; block "
        f"{args.block_size}, max_num_batched_tokens {args.max_num_batched_tokens}, float32. Medians of "
        f"{args.repeats} runs per variant, alternating, fresh engine each run (one model load).", "",
        table(results["rows"], COLUMNS), "",
        f"on / off: max concurrent sequences {r['max_concurrent_seqs']:.2f}x, mean {r['mean_concurrent_seqs']:.2f}x, "
        f"tok/s {r['tokens_per_s']:.2f}x, wall time {r['wall_s']:.2f}x  ",
        f"Greedy outputs identical with and without prefix caching (every request, every run): "
        f"{'yes' if results['same_greedy_tokens'] else 'NO'}", ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--system-len", type=int, default=500)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--fits", type=int, default=4, help="whole requests the KV budget holds without sharing")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "prefix_sharing_smollm2"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()

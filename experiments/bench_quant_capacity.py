"""Tokens a KV byte budget holds per cache format: what the bits promise against what the engine keeps.

For each format (fp32, bf16, fp8_e4m3, int8, int4, int2 by default) and each --max-num-seqs, one engine
at --kv-cache-memory and --block-size receives prompts of --prompt-len random tokens at once (max_tokens
--max-tokens, ignore_eos), one more than the budget could hold at the format's pool bytes per token (so
the pool fills), and runs them to the end. Reported per run:
  - the promise: fp32's bytes per token over the format's (pool bytes per token, scales and zero points
    included: int4 with group 32 promises 6.4x, int2 10.7x), times fp32's pool tokens;
  - the pool: pages x block size (token slots) and the residual area's own bytes (0 where residual rows
    are leased from the pool's pages);
  - measured: the most tokens cached at once (summed over running sequences, after every step), the most
    sequences running at once, pages sealed early for want of a residual row, preemptions.
The model's weights do not matter here (random:llama-135m is SmolLM2-135M's shape); only its shapes do.

    python experiments/bench_quant_capacity.py                                  # ~15 minutes on 2 busy cores
    python experiments/bench_quant_capacity.py --formats fp32 int4 --max-num-seqs 4 --out /tmp/cap
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from bench_throughput import REPO, log, metadata, provenance, save, table

FORMATS = ("fp32", "bf16", "fp8_e4m3", "int8", "int4", "int2")
COLUMNS = [("format", "format"), ("max_num_seqs", "max_num_seqs"), ("bytes_per_token", "pool B/token/layer"),
           ("pool_tokens", "pool token slots"), ("residual_mib", "residual area MiB"),
           ("promise", "promise (x fp32)"), ("held_peak", "tokens held (peak)"), ("held_x_fp32", "held x fp32"),
           ("held_of_promise", "held / promise"), ("seqs_peak", "max running seqs"),
           ("early_seals", "early seals"), ("preemptions", "preemptions"), ("seconds", "s")]


def run_one(args, loaded, name: str, max_num_seqs: int) -> dict:
    import copy
    import random

    from kvlab import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, loaded=copy.deepcopy(loaded), quant=name, block_size=args.block_size,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=max_num_seqs)
    engine, cache = llm.engine, llm.engine.cache
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    per_token = engine.bytes_per_block / args.block_size  # pool bytes of one token, every layer
    num_requests = int(engine.config.kv_cache_memory / per_token // (args.prompt_len + args.max_tokens)) + 2
    for _ in range(num_requests):
        engine.add_request([rng.randrange(1, vocab) for _ in range(args.prompt_len)], params)
    held_peak = seqs_peak = 0
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        held_peak = max(held_peak, sum(s.num_computed_tokens for s in running))
        seqs_peak = max(seqs_peak, len(running))
    layers = len(cache.groups[0].layers)
    pages = cache.null_page + 1
    area = cache.area
    return {"format": name, "max_num_seqs": max_num_seqs,
            "bytes_per_token": cache.pool_nbytes() / (pages * args.block_size) / layers,
            "pool_tokens": engine.block_manager.num_blocks * args.block_size,
            "residual_mib": cache.residual_nbytes() / 2**20, "held_peak": held_peak, "seqs_peak": seqs_peak,
            "num_requests": num_requests, "leased_rows_peak": getattr(area, "leased_peak", None),
            "early_seals": 0 if area is None else area.early_seals,
            "preemptions": llm.stats().get("preemptions", 0), "kv_cache_nbytes": cache.nbytes(),
            "seconds": time.perf_counter() - t0}


def run(args) -> list[dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvlab.models import load_model

    loaded = load_model(args.model, seed=args.seed)
    rows = []
    for max_num_seqs in args.max_num_seqs:
        for name in args.formats:
            log(f"{name} max_num_seqs={max_num_seqs}")
            rows.append(run_one(args, loaded, name, max_num_seqs))
    for r in rows:
        base = next(b for b in rows if b["format"] == "fp32" and b["max_num_seqs"] == r["max_num_seqs"])
        r["promise"] = base["bytes_per_token"] / r["bytes_per_token"]
        r["held_x_fp32"] = r["held_peak"] / max(base["held_peak"], 1)
        r["held_of_promise"] = r["held_x_fp32"] / r["promise"]
    return rows


def report(rows: list[dict], meta: dict, args) -> str:
    return "\n".join([
        f"# Tokens held per cache format at {args.kv_cache_memory} ({args.model}, block {args.block_size})",
        "",
        *provenance(meta, "capacity does not depend on the load; seconds do"),
        f"Requests of {args.prompt_len} random prompt tokens and {args.max_tokens} new ones, all queued at once "
        f"(one more than the budget holds at the format's bytes per token). *Promise*: fp32's pool bytes per token over the format's (scales and zero points "
        f"included). *Tokens held*: the most tokens cached at once over the running sequences (fp32's pool "
        f"holds {next(r['pool_tokens'] for r in rows if r['format'] == 'fp32')} tokens). KIVI formats with "
        f"their defaults (residual 32 tokens in the compute dtype).",
        "",
        table(rows, COLUMNS),
        "",
    ])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama-135m", help="only the shapes matter")
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS,
                   help="fp32 is always needed (the baseline)")
    p.add_argument("--max-num-seqs", nargs="+", type=int, default=[256])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "quant_capacity_tokens_held"))
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "fp32" not in args.formats:
        raise SystemExit("--formats must include fp32 (the baseline)")
    meta = metadata(args)
    rows = run(args)
    save(args.out, report(rows, meta, args), meta, rows)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()

"""Tokens a KV byte budget holds per cache format: what the bits promise against what the engine keeps.

For each format (fp32, bf16, fp8_e4m3, int8, int4, int2 by default) and each of --prompt-len (1,024
tokens: many sequences; 4,096: a few), one engine at --kv-cache-memory and --block-size receives prompts
of that many random tokens at once (max_tokens --max-tokens, ignore_eos), one more than the budget
could hold at the format's pool bytes per token (so the pool fills; steps of --max-num-batched-tokens
admit them before the first ones finish), and runs them to the end. Reported per run:
  - the promise: fp32's bytes per token over the format's (pool bytes per token, scales and zero points
    included: int4 with group 32 promises 6.4x, int2 10.7x), times fp32's pool tokens;
  - the pool: pages x block size (token slots) and the residual area's own bytes (0 where residual rows
    are leased from the pool's pages);
  - measured: the most tokens cached at once (summed over running sequences, after every step), the most
    sequences running at once, pages sealed early for want of a residual row, preemptions.
Only the KV shapes matter here (layers, KV heads, head_dim, positions), not the weights nor the hidden
sizes: by default the model is random weights with SmolLM2-135M's KV shapes (30 layers, 3 KV heads of 64,
8,192 positions) and a tiny hidden size and vocabulary (`random:kv-smollm2`), so the runs cost little.

    python experiments/bench_quant_capacity.py                                  # ~15 minutes on 2 busy cores
    python experiments/bench_quant_capacity.py --formats fp32 int4 --prompt-len 4096 --out /tmp/cap
"""

from __future__ import annotations

import argparse
import os
import time

from kvlab.study.bench_io import REPO, log, metadata, provenance, save, table

FORMATS = ("fp32", "bf16", "fp8_e4m3", "int8", "int4", "int2")
COLUMNS = [("format", "format"), ("prompt_len", "prompt tokens"), ("bytes_per_token", "pool B/token/layer"),
           ("pool_tokens", "pool token slots"), ("residual_mib", "residual area MiB"),
           ("promise", "promise (x fp32)"), ("held_peak", "tokens held (peak)"), ("held_x_fp32", "held x fp32"),
           ("held_of_promise", "held / promise"), ("seqs_peak", "max running seqs"),
           ("early_seals", "early seals"), ("preemptions", "preemptions"), ("seconds", "s")]


def run_one(args, loaded, name: str, prompt_len: int) -> dict:
    import copy
    import random

    from kvlab import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, loaded=copy.deepcopy(loaded), quant=name, block_size=args.block_size,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    engine, cache = llm.engine, llm.engine.cache
    layers, pages = len(cache.groups[0].layers), cache.null_page + 1
    row = {"format": name, "prompt_len": prompt_len,
           "bytes_per_token": cache.pool_nbytes() / (pages * args.block_size) / layers,
           "pool_tokens": engine.block_manager.num_blocks * args.block_size,
           "residual_mib": cache.residual_nbytes() / 2**20, "kv_cache_nbytes": cache.nbytes()}
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    per_token = engine.bytes_per_block / args.block_size  # pool bytes of one token, every layer
    num_requests = int(engine.config.kv_cache_memory / per_token // (prompt_len + args.max_tokens)) + 1
    try:
        for _ in range(num_requests):
            engine.add_request([rng.randrange(1, vocab) for _ in range(prompt_len)], params)
    except ValueError as exc:  # a request this pool can never hold
        log(f"  {name}: {exc}")
        return {**row, "held_peak": 0, "refused": str(exc), "seconds": time.perf_counter() - t0}
    held_peak = seqs_peak = 0
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        held_peak = max(held_peak, sum(s.num_computed_tokens for s in running))
        seqs_peak = max(seqs_peak, len(running))
    area = cache.area
    return {**row, "held_peak": held_peak, "seqs_peak": seqs_peak, "num_requests": num_requests,
            "leased_rows_peak": getattr(area, "leased_peak", None),
            "early_seals": 0 if area is None else area.early_seals,
            "preemptions": llm.stats().get("preemptions", 0), "seconds": time.perf_counter() - t0}


def run(args) -> list[dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvlab.models import load_model

    loaded = load_model(args.model, seed=args.seed)
    rows = []
    for prompt_len in args.prompt_len:
        for name in args.formats:
            log(f"{name} prompt_len={prompt_len}")
            rows.append(run_one(args, loaded, name, prompt_len))
    fp32 = next(r for r in rows if r["format"] == "fp32")
    for r in rows:
        r["promise"] = fp32["bytes_per_token"] / r["bytes_per_token"]
        r["held_x_fp32"] = r["held_peak"] / fp32["pool_tokens"]
        r["held_of_promise"] = r["held_x_fp32"] / r["promise"]
    return rows


def report(rows: list[dict], meta: dict, args) -> str:
    return "\n".join([
        f"# Tokens held per cache format at {args.kv_cache_memory} ({args.model}, block {args.block_size})",
        "",
        *provenance(meta, "capacity does not depend on the load; seconds do"),
        f"Requests of {' or '.join(map(str, args.prompt_len))} random prompt tokens and {args.max_tokens} new "
        f"ones, all queued at once "
        f"(one more than the budget holds at the format's bytes per token). *Promise*: fp32's pool bytes per "
        f"token over the format's (scales and zero points included). *Tokens held*: the most tokens cached at "
        f"once over the running sequences; *held x fp32*: that over the tokens fp32's pool holds "
        f"({next(r['pool_tokens'] for r in rows if r['format'] == 'fp32')}). KIVI formats with "
        f"their defaults (residual 32 tokens in the compute dtype).",
        "",
        table(rows, COLUMNS),
        "",
    ])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:kv-smollm2", help="only the KV shapes matter")
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS,
                   help="fp32 is always needed (the baseline)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens per step: the pool fills at admission, before the first requests finish")
    p.add_argument("--prompt-len", nargs="+", type=int, default=[1024, 4096])
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
    main()

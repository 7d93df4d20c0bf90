"""Multi-turn conversations: prefix caching off, hashed full pages, and the radix tree, on a real model.

Workload (kvlab.study.workloads.synthetic.MultiTurn's shape): --conversations conversations side by side, each
of --turns turns; a turn's prompt is the whole conversation so far (earlier prompts and answers) plus a
new --user-len-token WikiText-2 user message, and it arrives as soon as the previous answer is done;
--max-tokens new tokens per turn, greedy, EOS ignored. The hashed cache reuses the full pages of the
history; the radix tree also keeps a finished turn's partly filled last page, so the next turn reuses
every cached token (`kvlab/cache/radix_cache.py`).

One process, one model load; the variants alternate for --repeats rounds, each on a fresh engine (no hit
survives from an earlier round); tables show medians. Greedy outputs must not depend on the variant.

    nice -n 10 python experiments/bench_multiturn_prefix.py            # a few minutes on 2 quiet cores
    python experiments/bench_multiturn_prefix.py --conversations 2 --turns 2 --repeats 1 --out /tmp/multiturn
    python experiments/bench_multiturn_prefix.py --quant int4 --quant-args '{"residual": 32}' --block-size 32 \
        --out experiments/results/multiturn_prefix_smollm2_int4      # every variant on KIVI int4 pages

With a residual window (int4 / int2) a prompt's K/V depend on its prefill chunks (what each chunk reads
open or sealed, docs/design.md "Prefix caching with a residual window"): a turn that hits the previous
turn's pages reads the prefix as that turn computed it, so its greedy tokens may differ from caching
off; the report counts the turns whose tokens are identical.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from pathlib import Path

from kvlab.study.bench_io import REPO, commit_line, load_average, log, metadata, table

VARIANTS = {"off": {}, "hash": {"enable_prefix_caching": True, "prefix_cache": "hash"},
            "radix": {"enable_prefix_caching": True, "prefix_cache": "radix"}}
STATS = ("tokens_per_s", "busy_s", "num_steps", "ttft_median_s", "max_concurrent_seqs", "kv_blocks_peak",
         "preemptions", "prompt_tokens")
PREFIX = ("prefix_hit_rate_tokens", "prefix_hit_tokens", "prefix_queried_tokens", "prefix_pages_saved",
          "prefix_evictions", "cow_copies")
COLUMNS = [("variant", "prefix cache"), ("prefix_hit_rate_tokens", "hit rate (tokens)"),
           ("prefix_hit_tokens", "hit tokens"), ("computed_prompt_tokens", "prompt tokens computed"),
           ("prefix_pages_saved", "pages saved"), ("cow_copies", "CoW copies"), ("tokens_per_s", "tok/s (busy)"),
           ("busy_s", "busy s"), ("wall_s", "wall s"), ("cpu_s", "CPU s"), ("ttft_median_s", "TTFT p50 s"), ("num_steps", "steps"),
           ("kv_blocks_peak", "pages peak"), ("prefix_evictions", "evictions"), ("preemptions", "preemptions")]


def measure(loaded, tokens: list[int], variant: str, args) -> dict:
    from kvlab import LLM
    from kvlab.study.workloads.replay import Request, replay

    llm = LLM(args.model, loaded=copy.deepcopy(loaded), block_size=args.block_size, kv_cache_memory=args.kv_memory,
              max_num_batched_tokens=args.max_num_batched_tokens, quant=args.quant, quant_args=args.quant_args,
              **VARIANTS[variant])
    rng = random.Random(args.seed)  # the same user messages for every variant

    def cut() -> list[int]:
        offset = rng.randrange(0, len(tokens) - args.user_len + 1)
        return tokens[offset:offset + args.user_len]

    answers: dict[str, list[int]] = {}

    def next_turn(req, out, now: float):
        answers[req.tag] = list(out.token_ids)
        conv, turn = req.tag.split("/turn")
        if int(turn) + 1 >= args.turns:
            return []
        return [Request(req.prompt_token_ids + list(out.token_ids) + cut(), args.max_tokens, now,
                        tag=f"{conv}/turn{int(turn) + 1}")]

    first = [Request(cut(), args.max_tokens, 0.0, tag=f"conv{c}/turn0") for c in range(args.conversations)]
    start, cpu = time.perf_counter(), time.process_time()
    result = replay(llm, first, "real", follow_up=next_turn)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    stats = {k.split("/", 1)[1]: v for k, v in result.metrics.items()}
    row = {**{k: stats[k] for k in STATS}, **{k: stats.get(k, 0) for k in PREFIX}, "wall_s": wall, "cpu_s": cpu}
    row["computed_prompt_tokens"] = row["prompt_tokens"] - row["prefix_hit_tokens"]
    return {**row, "answers": answers}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from kvlab.models import load_model
    from kvlab.study.tasks.data import ByteTokenizer, corpus_tokens
    from kvlab.study.workloads.azure import DEFAULT_CORPUS

    if args.threads:
        torch.set_num_threads(args.threads)
    meta = metadata(args)
    loaded = load_model(args.model)
    tokenizer = loaded.tokenizer or ByteTokenizer(loaded.model.config.vocab_size)  # random: models have none
    tokens = corpus_tokens(DEFAULT_CORPUS, None, tokenizer)
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            log(f"round {r + 1}/{args.repeats}: {name}")
            runs[name].append(measure(loaded, tokens, name, args))
            log(f"  {runs[name][-1]['tokens_per_s']:.2f} tok/s, hit rate {runs[name][-1]['prefix_hit_rate_tokens']:.3f}")
    keys = (*STATS, *PREFIX, "wall_s", "cpu_s", "computed_prompt_tokens")
    rows = [{"variant": name, **{k: statistics.median(x[k] for x in rs) for k in keys}} for name, rs in runs.items()]
    by = {row["variant"]: row for row in rows}
    ratios = {f"{a}/{b}": {k: by[a][k] / by[b][k] if by[b][k] else float("nan")
                           for k in ("tokens_per_s", "busy_s", "wall_s", "cpu_s", "computed_prompt_tokens")}
              for a, b in (("hash", "off"), ("radix", "off"), ("radix", "hash"))}
    same = all(x["answers"] == runs["off"][0]["answers"] for rs in runs.values() for x in rs)
    reference = runs["off"][0]["answers"]
    turns_same = {name: (sum(x["answers"][t] == reference[t] for x in rs for t in reference),
                         sum(len(reference) for _ in rs)) for name, rs in runs.items()}
    meta["load_end"] = load_average()
    results = {"rows": rows, "ratios": ratios, "same_greedy_tokens": same, "turns_same_as_off": turns_same,
               "runs": {n: [{k: v for k, v in x.items() if k != "answers"} for x in rs] for n, rs in runs.items()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": {k: str(v) for k, v in meta.items()}, **results},
                                                   indent=1))
    text = report(results, meta, args)
    out.with_suffix(".md").write_text(text)
    print(text)
    log(f"wrote {out.with_suffix('.md')}")
    return results


def report(results: dict, meta: dict, args) -> str:
    ratio_lines = [f"{pair}: CPU time {r['cpu_s']:.2f}x, busy time {r['busy_s']:.2f}x, wall time {r['wall_s']:.2f}x, "
                   f"tok/s {r['tokens_per_s']:.2f}x, prompt tokens computed {r['computed_prompt_tokens']:.2f}x  "
                   for pair, r in results["ratios"].items()]
    per_run = "; ".join(f"{n}: " + ", ".join(f"{x['tokens_per_s']:.2f} tok/s ({x['cpu_s']:.1f} CPU s)" for x in rs)
                        for n, rs in results["runs"].items())
    return "\n".join([
        f"# Multi-turn conversations: prefix caching off / hash / radix, {args.model} ({commit_line(meta)})", "",
        f"Command: `{meta['command']}`  ", f"Date: {meta['started_at']}  ", f"Machine: {meta['machine']}  ",
        f"Load average (1/5/15 min) at start: {meta['load_start']}, at end: {meta['load_end']} (the machine was "
        f"shared: other agents' jobs ran on the 2 cores during the run; wall and busy time include their "
        f"interference; CPU s (the process's CPU time, one torch thread) counts only the time the run had a core, so it is "
        f"the steadier measure of work here)", "",
        f"{args.conversations} conversations side by side, {args.turns} turns each; a turn = the conversation so "
        f"far + a {args.user_len}-token WikiText-2 user message, arriving when the previous answer is done; "
        f"{args.max_tokens} new tokens per turn (greedy, EOS ignored). KV budget {args.kv_memory}, block "
        f"{args.block_size}, max_num_batched_tokens {args.max_num_batched_tokens}, float32 model, cache format "
        f"{args.quant} {json.dumps(args.quant_args) if args.quant_args else ''}. Medians of "
        f"{args.repeats} runs per variant, alternating, fresh engine each run (one model load).", "",
        table(results["rows"], COLUMNS), "", *ratio_lines,
        f"Greedy outputs identical for every variant (every turn, every run): "
        f"{'yes' if results['same_greedy_tokens'] else 'NO'}  ",
        "Turns whose greedy tokens equal caching off's (first run): " + ", ".join(
            f"{n} {a}/{b}" for n, (a, b) in results["turns_same_as_off"].items()) + "  ",
        f"Per run: {per_run}", ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-memory", default="256MiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quant", default="auto", help="cache format of every variant (kvlab.cache.quant), e.g. int4")
    p.add_argument("--quant-args", type=json.loads, default={}, help='the format\'s arguments as JSON, e.g. \'{"residual": 32}\'')
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "multiturn_prefix_smollm2"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()

"""Multi-turn conversations over a pool too small for every conversation's history: recompute evicted prefixes
(prefix caching, no tier) or bring them back from a tier below the pool (EngineConfig.offload, kvlab/cache/tiers/).

Workload (as experiments/bench_compressed_turns.py): --conversations conversations side by side, --turns turns
each; a turn's prompt is the conversation so far (earlier prompts and this run's own answers) plus a new
--user-len-token WikiText-2 user message, arriving when the previous answer is done; --max-tokens greedy new
tokens per turn, EOS ignored. Every variant runs prefix caching (hash, LRU eviction) on the same --kv-memory pool:
- recompute: a history the prefix cache evicted is recomputed;
- host / disk: evicted pages go to a host-memory / disk tier (LRU placement) and are restored on a hit;
- host_arc, host_cost_aware: the host tier with the other built-in placements (--variants picks which run).
Offloading changes only speed: the report checks every variant's answers equal the recompute run's. It gives the
median time to first token of returning turns (turn >= 1), tok/s, the prefix hit rate (tokens), prompt tokens
computed, pages restored per tier, bytes moved and the copy rate the tiers achieved (bytes moved / time moving),
medians over --repeats runs (fresh engine each; variant order alternates between rounds).

    python experiments/bench_kv_tiers.py --model random:llama-tiny --conversations 3 --turns 3 --repeats 1 \
        --user-len 32 --max-tokens 8 --kv-memory 64KiB --block-size 4 --out /tmp/kv_tiers_smoke   # smoke (seconds)
    nice -n 10 .venv/bin/python experiments/bench_kv_tiers.py --kv-memory 48MiB --conversations 6 --turns 4 \
        --user-len 128 --max-tokens 16 --out experiments/results/kv_tiers_smollm2
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "recompute": {},
    "host": {"offload": "host"},
    "disk": {"offload": "disk"},
    "host_arc": {"offload": "host", "offload_placement": "arc"},
    "host_cost_aware": {"offload": "host", "offload_placement": "cost_aware"},
}


def measure(loaded, tokens: list[int], variant: str, args) -> dict:
    from kvlab import LLM
    from kvlab.study.workloads.replay import Request, replay

    llm = LLM(args.model, loaded=copy.deepcopy(loaded), block_size=args.block_size, kv_cache_memory=args.kv_memory,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True,
              offload_args={"memory": args.tier_memory, "disk_memory": args.tier_memory}, **VARIANTS[variant])
    rng = random.Random(args.seed)  # the same user messages for every variant

    def cut() -> list[int]:
        offset = rng.randrange(0, len(tokens) - args.user_len + 1)
        return tokens[offset:offset + args.user_len]

    messages = {(c, t): cut() for c in range(args.conversations) for t in range(args.turns)}
    answers: dict[str, list[int]] = {}

    def request(prompt: list[int], conv: int, turn: int, now: float) -> Request:
        return Request(prompt, args.max_tokens, now, tag=f"conv{conv}/turn{turn}")

    def next_turn(req, out, now: float):
        answers[req.tag] = list(out.token_ids)
        conv, turn = (int(x) for x in req.tag.removeprefix("conv").split("/turn"))
        if turn + 1 >= args.turns:
            return []
        return [request(req.prompt_token_ids + list(out.token_ids) + messages[conv, turn + 1], conv, turn + 1, now)]

    first = [request(messages[c, 0], c, 0, 0.0) for c in range(args.conversations)]
    start = time.perf_counter()
    result = replay(llm, first, "real", follow_up=next_turn)
    wall = time.perf_counter() - start
    stats = llm.engine.stats()
    llm.close()  # tiers drained, the disk tier's files removed
    table = result.tables["workload_requests"]
    returning = [r.ttft_s for r in table.itertuples() if not r.tag.endswith("/turn0") and r.ttft_s == r.ttft_s]
    moved, moving = stats.get("tier_bytes_moved", 0), stats.get("tier_move_seconds", 0.0)
    return {"ttft_returning_median_s": statistics.median(returning) if returning else float("nan"),
            "tokens_per_s": stats["tokens_per_s"], "wall_s": wall,
            "prefix_hit_rate": stats["prefix_hit_rate_tokens"],
            "computed_prompt_tokens": stats["prompt_tokens"] - stats["prefix_hit_tokens"],
            "pages_restored": stats.get("tier_restored", 0), "pages_demoted": stats.get("tier_demoted", 0),
            "mb_moved": moved / 2**20, "copy_mb_per_s": moved / 2**20 / moving if moving else float("nan"),
            "preemptions": stats["preemptions"], "answers": answers}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from kvlab.models import load_model
    from kvlab.study.tasks.data import ByteTokenizer, corpus_tokens
    from kvlab.study.workloads.azure import DEFAULT_CORPUS

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    tokenizer = loaded.tokenizer or ByteTokenizer(loaded.model.config.vocab_size)  # random: models have none
    tokens = corpus_tokens(DEFAULT_CORPUS, None, tokenizer)
    names = ["recompute", *[v for v in args.variants.split(",") if v != "recompute"]]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(measure(loaded, tokens, name, args))
            last = runs[name][-1]
            print(f"round {r + 1}/{args.repeats} {name}: TTFT(returning) {last['ttft_returning_median_s']:.3f} s, "
                  f"{last['tokens_per_s']:.2f} tok/s, hit rate {last['prefix_hit_rate']:.3f}", flush=True)
    keys = [k for k in runs["recompute"][0] if k != "answers"]
    rows = [{"variant": n, **{k: statistics.median(x[k] for x in rs) for k in keys}} for n, rs in runs.items()]
    base = rows[0]["ttft_returning_median_s"]
    for row in rows:
        row["ttft_speedup_vs_recompute"] = base / row["ttft_returning_median_s"]
    reference = runs["recompute"][0]["answers"]
    identical = {n: all(x["answers"] == reference for x in rs) for n, rs in runs.items()}
    import sys

    command = " ".join(["python experiments/bench_kv_tiers.py", *(sys.argv[1:] if argv is None else argv)])
    results = {"command": command,
               "args": vars(args), "rows": rows, "answers_identical_to_recompute": identical}
    text = report(results, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    out.with_suffix(".md").write_text(text)
    print(text)
    return results


def report(results: dict, args) -> str:
    cols = list(results["rows"][0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in results["rows"]:
        lines.append("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    same = ", ".join(f"{n}: {'yes' if ok else 'NO'}" for n, ok in results["answers_identical_to_recompute"].items())
    return "\n".join([
        f"# KV tiers below the pool: {args.model}", "",
        f"{args.conversations} conversations x {args.turns} turns, {args.user_len}-token WikiText-2 user messages, "
        f"{args.max_tokens} greedy tokens per turn; prefix caching on a KV pool of {args.kv_memory}, block "
        f"{args.block_size}; tiers of {args.tier_memory}; medians of {args.repeats} runs per variant (fresh engine "
        f"each), {args.threads} torch thread(s)", "", *lines, "",
        f"Greedy answers identical to the recompute run's (every repeat): {same}", "",
        f"Command: `{results['command']}`", ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--variants", default="host,disk,host_arc,host_cost_aware",
                   help=f"comma-separated, beside recompute: {', '.join(VARIANTS)}")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-memory", default="48MiB")
    p.add_argument("--tier-memory", default="1GiB", help="each tier's budget")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "kv_tiers_smollm2"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()

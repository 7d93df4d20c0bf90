"""Multi-turn conversations over a pool too small for every conversation's history: recompute evicted prefixes
(prefix caching, no tier) or bring them back from a tier below the pool (EngineConfig.offload, kvlab/cache/tiers/).

Workload (kvlab.study.workloads.conversations, shared with experiments/bench_compressed_turns.py):
--conversations conversations of --turns turns; turn 0 is a --context-len-token WikiText-2 document (0: none)
and a --user-len-token message, each later turn the conversation so far (earlier prompts and this run's own
answers) plus a new --user-len-token message; --schedule concurrent (conversations side by side, a turn arriving
when the previous answer is done) or round_robin (one turn at a time, each conversation in turn: a user returns
after the others had theirs); --max-tokens greedy new tokens per turn, EOS ignored. Every variant runs prefix
caching (hash, LRU eviction) on the same --kv-memory pool:
- recompute: a history the prefix cache evicted is recomputed;
- host / disk: evicted pages go to a host-memory / disk tier (LRU placement) and are restored on a hit (disk
  reads ahead on the tier's worker thread; disk_sync reads when the request is scheduled);
- host_arc, host_cost_aware, disk_cost_aware: the other built-in placements (--variants picks which run).
Offloading changes only speed: the report checks every variant's answers equal the recompute run's. It gives the
median time to first token of returning turns (turn >= 1) and its ratio to the recompute run's, tok/s, the prefix
hit rate (tokens), prompt tokens computed, pages restored, read ahead (prefetched at add), recomputed by the cost
model, bytes moved and the copy rate the tiers achieved (bytes moved / time moving), medians over --repeats runs
(fresh engine each; variant order alternates between rounds).

    python experiments/bench_kv_tiers.py --model random:llama-tiny --conversations 3 --turns 3 --repeats 1 \
        --user-len 32 --max-tokens 8 --kv-memory 64KiB --block-size 4 --out /tmp/kv_tiers_smoke   # smoke (seconds)
    nice -n 10 .venv/bin/python experiments/bench_kv_tiers.py --kv-memory 48MiB --conversations 6 --turns 4 \
        --user-len 128 --max-tokens 16 --out experiments/results/kv_tiers_smollm2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

from kvlab.study.bench_io import key_table, uptime, write_results

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "recompute": {},
    "host": {"offload": "host"},
    "disk": {"offload": "disk"},
    "disk_sync": {"offload": "disk", "offload_args": {"async_reads": False}},
    "host_disk": {"offload": "host_disk"},
    "host_arc": {"offload": "host", "offload_placement": "arc"},
    "host_cost_aware": {"offload": "host", "offload_placement": "cost_aware"},
    "disk_cost_aware": {"offload": "disk", "offload_placement": "cost_aware"},
}


def measure(loaded, tokens: list[int], variant: str, args) -> dict:
    from kvlab import LLM
    from kvlab.study.workloads.conversations import Conversations
    from kvlab.study.workloads.replay import replay

    engine = dict(VARIANTS[variant])
    tier_args = {"memory": args.tier_memory, "disk_memory": args.tier_memory, **engine.pop("offload_args", {})}
    if variant == "host_disk":
        tier_args["memory"] = args.host_disk_memory
    llm = LLM(args.model, loaded=copy.deepcopy(loaded), block_size=args.block_size, kv_cache_memory=args.kv_memory,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True,
              offload_args=tier_args, **engine)
    work = Conversations(tokens, args.conversations, args.turns, args.user_len, args.max_tokens, args.context_len,
                         args.schedule, args.seed)  # the same text for every variant
    start = time.perf_counter()
    result = replay(llm, work.first(), "real", follow_up=work.follow_up)
    wall = time.perf_counter() - start
    stats = llm.engine.stats()
    llm.close()  # tiers drained, the disk tier's files removed
    returning = Conversations.returning_ttfts(result.tables["workload_requests"])
    moved, moving = stats.get("tier_bytes_moved", 0), stats.get("tier_move_seconds", 0.0)
    return {"ttft_returning_median_s": statistics.median(returning) if returning else float("nan"),
            "tokens_per_s": stats["tokens_per_s"], "wall_s": wall,
            "prefix_hit_rate": stats["prefix_hit_rate_tokens"],
            "computed_prompt_tokens": stats["prompt_tokens"] - stats["prefix_hit_tokens"],
            "pages_restored": stats.get("tier_restored", 0), "pages_demoted": stats.get("tier_demoted", 0),
            "prefetched": stats.get("tier_prefetched", 0), "recomputed": stats.get("tier_recomputed", 0),
            "mb_moved": moved / 2**20, "copy_mb_per_s": moved / 2**20 / moving if moving else float("nan"),
            "preemptions": stats["preemptions"], "answers": work.answers}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from kvlab.models import load_model
    from kvlab.study.tasks.data import ByteTokenizer, corpus_tokens
    from kvlab.study.workloads.azure import DEFAULT_CORPUS

    started, uptime_before = time.strftime("%Y-%m-%d %H:%M", time.gmtime()), uptime()
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
    results = {"command": command, "date": f"{started} - {time.strftime('%H:%M UTC', time.gmtime())}",
               "uptime_before": uptime_before, "uptime_after": uptime(),
               "args": vars(args), "rows": rows, "answers_identical_to_recompute": identical}
    write_results(args.out, results, report(results, args))
    return results



def report(results: dict, args) -> str:
    lines = [key_table(results["rows"])]
    same = ", ".join(f"{n}: {'yes' if ok else 'NO'}" for n, ok in results["answers_identical_to_recompute"].items())
    return "\n".join([
        f"# KV tiers below the pool: {args.model}", "",
        f"{args.conversations} conversations x {args.turns} turns ({args.schedule}), a {args.context_len}-token "
        f"WikiText-2 document in turn 0, {args.user_len}-token WikiText-2 user messages, {args.max_tokens} greedy "
        f"tokens per turn; prefix caching on a KV pool of {args.kv_memory}, block {args.block_size}; tiers of "
        f"{args.tier_memory} (host_disk: host {args.host_disk_memory}); medians of {args.repeats} runs per variant "
        f"(fresh engine each), {args.threads} torch thread(s)", "", *lines, "",
        f"Greedy answers identical to the recompute run's (every repeat): {same}", "",
        f"Command: `{results['command']}`, run {results['date']}.", "",
        f"`uptime` before: {results['uptime_before']}; after: {results['uptime_after']}", ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--variants", default="host,disk,host_arc,host_cost_aware",
                   help=f"comma-separated, beside recompute: {', '.join(VARIANTS)}")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-len", type=int, default=128)
    p.add_argument("--context-len", type=int, default=0, help="tokens of turn 0's shared-context document")
    p.add_argument("--schedule", default="concurrent", choices=["concurrent", "round_robin"])
    p.add_argument("--host-disk-memory", default="16MiB", help="the host tier's budget in the host_disk variant")
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

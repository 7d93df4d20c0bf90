"""Multi-turn conversations under a compressing policy: recompute-and-compress every turn, or reuse the compressed
history (EngineConfig.reuse_compressed, kvlab/cache/kept_turns.py).

Workload (kvlab.study.workloads.conversations, shared with experiments/bench_kv_tiers.py): --conversations
conversations side by side, --turns turns each; a turn's prompt is the conversation so far (earlier prompts and this run's own answers) plus a new
--user-len-token WikiText-2 user message, arriving when the previous answer is done; --max-tokens greedy new
tokens per turn, EOS ignored. Variants:
- nocache: each turn recomputes its whole prompt and the policy compresses it at the prompt's end;
- reuse: a turn continues from the previous turn's compressed cache (its kept slots and the policy's state) and
  computes only the previous answer's last token and the new user message, then is compressed as usual.
The reuse variant changes outputs by design (declared deviation "reusing compressed turns"); the report gives the
median time to first token of returning turns (turn >= 1), tok/s, prompt tokens computed, and agreement with the
no-cache run: per turn, the fraction of greedy tokens equal position by position, over the turns whose prompt is the
same in both runs (every turn 1; a later turn only if the earlier answers agreed), and how many such turns there
are. (The KL of the first generated token's distribution is not reported: the engine returns distributions only
for scoring requests.)

    python experiments/bench_compressed_turns.py --model random:llama-tiny --conversations 2 --turns 3 --repeats 1 \
        --user-len 32 --max-tokens 8 --out /tmp/compressed_turns_smoke               # smoke (seconds)
    # the lead's run, on a quiet machine (SmolLM2-135M, both policies):
    nice -n 10 python experiments/bench_compressed_turns.py --model smollm2-135m --policy snapkv:compression_ratio=0.5 \
        --out experiments/results/compressed_turns_smollm2_snapkv
    nice -n 10 python experiments/bench_compressed_turns.py --model smollm2-135m --policy h2o:compression_ratio=0.5 \
        --out experiments/results/compressed_turns_smollm2_h2o
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

from kvlab.study.bench_io import key_table, write_results

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"nocache": {}, "reuse": {"reuse_compressed": True}}


def parse_policy(text: str) -> tuple[str, dict]:
    """'snapkv:compression_ratio=0.5,window_size=8' -> ('snapkv', {'compression_ratio': 0.5, 'window_size': 8})."""
    name, _, rest = text.partition(":")
    args = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        args[key] = json.loads(value)
    return name, args


def measure(loaded, tokens: list[int], variant: str, args) -> dict:
    from kvlab import LLM
    from kvlab.study.workloads.conversations import Conversations
    from kvlab.study.workloads.replay import replay

    policy, policy_args = parse_policy(args.policy)
    llm = LLM(args.model, loaded=copy.deepcopy(loaded), block_size=args.block_size, kv_cache_memory=args.kv_memory,
              max_num_batched_tokens=args.max_num_batched_tokens, policy=policy, policy_args=policy_args,
              **VARIANTS[variant])
    work = Conversations(tokens, args.conversations, args.turns, args.user_len, args.max_tokens, seed=args.seed)
    answers, prompts = work.answers, work.prompts  # the same user messages for every variant
    first, next_turn = work.first(), work.follow_up
    start, cpu = time.perf_counter(), time.process_time()
    result = replay(llm, first, "real", follow_up=next_turn)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    stats = llm.engine.stats()
    table = result.tables["workload_requests"]  # one row per request (kvlab.study.workloads.replay)
    returning = Conversations.returning_ttfts(table)
    return {"tokens_per_s": stats["tokens_per_s"], "busy_s": stats["busy_s"], "wall_s": wall, "cpu_s": cpu,
            "ttft_returning_median_s": statistics.median(returning) if returning else float("nan"),
            "prompt_tokens": stats["prompt_tokens"], "reused_tokens": stats.get("turn_reuse_tokens", 0),
            "computed_prompt_tokens": stats["prompt_tokens"] - stats.get("turn_reuse_tokens", 0),
            "reuse_hits": stats.get("turn_reuse_hits", 0), "turn_evictions": stats.get("turn_evictions", 0),
            "kv_blocks_peak": stats["kv_blocks_peak"], "answers": answers, "prompts": prompts}


def agreement(run: dict, reference: dict) -> dict:
    """Per turn index: (mean token agreement, turns compared) over the turns whose prompt equals the reference's."""
    per_turn: dict[int, list[float]] = {}
    for tag, ref in reference["answers"].items():
        if run["prompts"].get(tag) != reference["prompts"][tag]:
            continue
        got = run["answers"][tag]
        per_turn.setdefault(int(tag.split("/turn")[1]), []).append(sum(a == b for a, b in zip(got, ref)) / len(ref))
    return {t: (statistics.mean(v), len(v)) for t, v in sorted(per_turn.items())}


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
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for r in range(args.repeats):
        for name in VARIANTS if r % 2 == 0 else list(VARIANTS)[::-1]:
            runs[name].append(measure(loaded, tokens, name, args))
            print(f"round {r + 1}/{args.repeats} {name}: {runs[name][-1]['tokens_per_s']:.2f} tok/s, "
                  f"{runs[name][-1]['reuse_hits']} reuse hits", flush=True)
    keys = ("ttft_returning_median_s", "tokens_per_s", "busy_s", "wall_s", "cpu_s", "prompt_tokens",
            "computed_prompt_tokens", "reused_tokens", "reuse_hits", "turn_evictions", "kv_blocks_peak")
    rows = [{"variant": n, **{k: statistics.median(x[k] for x in rs) for k in keys}} for n, rs in runs.items()]
    reference = runs["nocache"][0]
    agree = {n: agreement(rs[0], reference) for n, rs in runs.items()}
    results = {"command": " ".join(["python experiments/bench_compressed_turns.py", *(argv or [])]) if argv else None,
               "args": vars(args), "rows": rows, "agreement_with_nocache": agree}
    write_results(args.out, results, report(results, args))
    return results


def report(results: dict, args) -> str:
    lines = [key_table(results["rows"])]
    agree = [f"- {n}: " + ", ".join(f"turn {t}: {a:.3f} over {k}" for t, (a, k) in per.items())
             for n, per in results["agreement_with_nocache"].items()]
    return "\n".join([
        f"# Compressed multi-turn reuse: {args.model}, policy {args.policy}", "",
        f"{args.conversations} conversations x {args.turns} turns, {args.user_len}-token user messages, "
        f"{args.max_tokens} greedy tokens per turn; KV budget {args.kv_memory}, block {args.block_size}; medians of "
        f"{args.repeats} runs per variant (fresh engine each)", "", *lines, "",
        "Token agreement with the no-cache run (turns whose prompt is the same in both runs):", *agree, ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policy", default="snapkv:compression_ratio=0.5", help="name:key=value,... e.g. h2o:compression_ratio=0.5")
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
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "compressed_turns_smollm2"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()

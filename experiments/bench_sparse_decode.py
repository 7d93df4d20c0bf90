"""What sparse reading buys at decode: step time and greedy agreement of quest / rocketkv against the full cache.

One ~1,500-token WikiText-2 prompt, batch 1, greedy, --max-tokens new tokens (EOS ignored). Each variant
prefills the prompt (dense), then every decode step is timed on its own (`engine.step()`); the time
spent choosing pages (`SparseStep.plan`, every layer) is timed inside those steps. Variants run in
turn, --repeats rounds, medians over all decode steps of all rounds. Agreement: the share of the
new tokens equal to the full cache's at the same position, and the first position that differs.

    python experiments/bench_sparse_decode.py                     # a few minutes on 2 cores
    python experiments/bench_sparse_decode.py --model random:llama-tiny --prompt-len 300 --repeats 1 --out /tmp/sd
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shared_pool import make_prompts  # noqa: E402
from kvlab.study.bench_io import commit_line, load_average, log, metadata, table  # noqa: E402

COLUMNS = [("variant", "variant"), ("step_ms", "decode step ms (median)"), ("vs_full", "step time / full"),
           ("select_ms", "page selection ms per step"), ("read_share", "share of cached slots read"),
           ("slots_held", "KV slots held per layer after prefill"), ("agreement", "agreement with full"),
           ("first_diff", "first differing token")]


def variants(budgets: list[int]) -> list[tuple[str, str, dict]]:
    out = [("full", "full", {})]
    for b in budgets:
        out.append((f"quest {b}", "quest", {"budget": b}))
    for b in budgets:
        out.append((f"rocketkv {b}", "rocketkv", {"budget": b}))
    return out


def run_once(model, loaded, policy, policy_args, prompt, args) -> dict:
    from kvlab import LLM, SamplingParams
    from kvlab.policies.sparse_read import SparseStep

    llm = LLM(model, loaded=copy.deepcopy(loaded), policy=policy, policy_args=policy_args,
              kv_cache_memory=args.kv_memory, block_size=args.block_size, max_num_batched_tokens=512)
    engine = llm.engine
    spent = [0.0]
    original = SparseStep.plan

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return original(self, *a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    SparseStep.plan = timed
    try:
        engine.add_request(prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        seq = engine.scheduler.waiting[0]
        while seq.num_computed_tokens < len(prompt):
            engine.step()
        bm = engine.block_manager
        layers = sum(len(g.layers) for g in bm.groups)
        held = sum(len([b for b in bm.block_tables([seq], g)[0] if b >= 0]) * len(group.layers)
                   for g, group in enumerate(bm.groups))
        slots_held = held * bm.block_size / layers  # cache slots (tokens) per layer, in whole pages
        steps, select = [], []
        while engine.has_unfinished():
            spent[0] = 0.0
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
            select.append(spent[0])
    finally:
        SparseStep.plan = original
    stats = engine.stats()
    return {"tokens": seq.output_token_ids, "steps": steps, "select": select, "slots_held": slots_held,
            "read": stats.get("sparse_tokens_read", 0), "cached": stats.get("sparse_tokens_cached", 0)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from kvlab.models import load_model

    torch.set_num_threads(args.threads)
    meta = metadata(args)
    loaded = load_model(args.model)
    if loaded.tokenizer is not None:
        prompt = make_prompts(loaded.tokenizer, 1, args.prompt_len, args.prompt_len, args.seed)[0]
    else:  # a random model: random ids
        g = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(3, loaded.model.config.vocab_size, (args.prompt_len,), generator=g).tolist()
    runs: dict[str, list[dict]] = {}
    for r in range(args.repeats):
        for name, policy, pargs in variants(args.budgets):
            log(f"round {r + 1}/{args.repeats}: {name}")
            runs.setdefault(name, []).append(run_once(args.model, loaded, policy, pargs, prompt, args))
    full_tokens = runs["full"][0]["tokens"]
    full_ms = 1000 * statistics.median(t for run in runs["full"] for t in run["steps"][1:])
    rows = []
    for name, rs in runs.items():
        tokens = rs[0]["tokens"]
        same = [a == b for a, b in zip(tokens, full_tokens)]
        step_ms = 1000 * statistics.median(t for run in rs for t in run["steps"][1:])  # the first decode step warms up
        rows.append({
            "variant": name, "step_ms": step_ms, "vs_full": step_ms / full_ms,
            "select_ms": 1000 * statistics.median(t for run in rs for t in run["select"][1:]),
            "read_share": rs[0]["read"] / rs[0]["cached"] if rs[0]["cached"] else float("nan"),
            "slots_held": rs[0]["slots_held"], "agreement": sum(same) / len(same),
            "first_diff": same.index(False) if False in same else None,
            "deterministic": all(r["tokens"] == tokens for r in rs),
        })
    tok = loaded.tokenizer
    texts = {name: tok.decode(rs[0]["tokens"]) if tok is not None else str(rs[0]["tokens"]) for name, rs in runs.items()}
    tail = tok.decode(prompt[-40:]) if tok is not None else ""
    result = {"rows": rows, "prompt_tokens": len(prompt), "texts": texts, "prompt_tail": tail, "meta": meta}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(report(rows, len(prompt), meta, args, texts, tail))
    print(table(rows, COLUMNS))
    return result


def report(rows, prompt_tokens, meta, args, texts, tail) -> str:
    continuations = "\n".join(f"| {name} | {json.dumps(text)} |" for name, text in texts.items())
    return f"""# Sparse reading at decode: quest and rocketkv against the full cache ({args.model})

Command: `{meta['command']}` (commit {commit_line(meta)}; {meta['machine']}).

One WikiText-2 prompt of {prompt_tokens} tokens, batch 1, greedy, {args.max_tokens} new tokens (EOS ignored),
block size {args.block_size}, fp32 on CPU (torch reference path), {args.threads} threads, {args.repeats} rounds
(variants in turn within a round). Decode step time: median over every decode step but the first of
every round. Page selection: time inside `SparseStep.plan` (scores, top-k and the reduced plan, every
layer) per step. Share read: cache slots the reduced reads covered / slots a dense read covers
(rocketkv: after its stage-1 eviction). Agreement: share of the {args.max_tokens} new tokens equal to
the full cache's at the same position (greedy, so a first difference usually changes the rest).

**The machine was shared**: other agents' jobs ran on the same 2 cores during the measurement (load
average at the start: {meta['load_start']}, at the end: {load_average()}); times are noisy, ratios come from the same run.

{table(rows, COLUMNS)}

Budgets: quest reads `budget` tokens a step (budget / 16 pages, sink and newest included); rocketkv's
budget is the paper's token budget, of which the exact attention reads half (budget / 32 pages) and
stage 1 keeps n / c^r tokens of the prompt (c = n / budget, r = min(0.2 + 0.06 log2 c, 0.8)).
KV slots held per layer count whole pages (full and quest: every prompt token; rocketkv: its stage-1
kept set).

The prompt ends: {json.dumps(tail)}

| variant | greedy continuation |
|---|---|
{continuations}
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-len", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-memory", default="256MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="experiments/results/sparse_decode_smollm2")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()

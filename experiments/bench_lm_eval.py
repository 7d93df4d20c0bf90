"""The same lm-eval task set through the `kvlab` model and lm-eval's `hf` backend, same weights (fp32, full
cache), same run: per-task metrics side by side, the per-request parity figures and each backend's wall time.

    .venv/bin/python experiments/bench_lm_eval.py --model smollm2-135m \
        --limit kvlab_lambada_wikitext=40 kvlab_lambada_wikitext_gen=20 kvlab_wikitext2=2 kvlab_niah=6

Writes experiments/results/lm_eval_backends_<model>.md (the table and the command) and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from statistics import median

import torch

from kvlab.study.lm_eval.parity import compare, hf_model, kvlab_model, run_tasks, task_manager

DEFAULT_LIMITS = ["kvlab_lambada_wikitext=40", "kvlab_lambada_wikitext_gen=20", "kvlab_wikitext2=2", "kvlab_niah=6"]


def parse_limits(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        task, _, n = item.partition("=")
        out[task] = int(n)
    return out


def table(comparisons, kv, hf) -> list[str]:
    lines = ["| task | samples | metric | kvlab | hf | max abs. Δ log-lik. | is_greedy / generation mismatches |",
             "|---|---|---|---|---|---|---|"]
    for c in comparisons:
        mismatches = c.greedy_mismatches if c.greedy_mismatches is not None else c.generation_mismatches
        delta = "" if c.max_abs_loglik_diff is None else f"{c.max_abs_loglik_diff:.2e}"
        for i, (metric, (a, b)) in enumerate(c.metrics.items()):
            first = i == 0
            lines.append(f"| {c.task if first else ''} | {c.samples if first else ''} | {metric} | {a:.6g} | {b:.6g} "
                         f"| {delta if first else ''} | {'' if not first or mismatches is None else mismatches} |")
    return lines


def wall_table(walls: dict[str, list[float]]) -> list[str]:
    """Median wall time of each backend over the repeats (kvlab and hf alternating), each repeat's, and the ratio."""
    lines = ["| backend | median wall time (s) | repeats (s) |", "|---|---|---|"]
    lines += [f"| {b} | {median(w):.1f} | {', '.join(f'{x:.1f}' for x in w)} |" for b, w in walls.items()]
    return lines + ["", f"hf / kvlab median wall time: {median(walls['hf']) / median(walls['kvlab']):.2f}x"]


def warm_task_data(tasks: list[str], model: str) -> None:
    """Build every task's data once (lm-eval's task objects, then dropped): what the process caches on the way
    (the tokenizer by name, the haystack's tokens) is then paid by neither backend's clock, whichever runs first."""
    from lm_eval.tasks import get_task_dict

    get_task_dict(tasks, task_manager({"pretrained": model}))


def fmt_load(values) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--limit", nargs="+", default=DEFAULT_LIMITS, help="task=documents ...")
    parser.add_argument("--max-model-len", type=int, default=1025, help="kvlab's; hf's max_length is one less")
    parser.add_argument("--kv-batch-size", type=int, default=64, help="requests per LLM.score / generate call")
    parser.add_argument("--hf-batch-size", type=int, default=1, help="lm-eval hf backend's batch_size")
    parser.add_argument("--repeats", type=int, default=1, help="evaluations per backend, alternating (medians reported)")
    parser.add_argument("--tag", default="", help="appended to the output files' name (e.g. _speed)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = parser.parse_args(argv)
    limits = parse_limits(args.limit)
    kv_model = kvlab_model(args.model, args.max_model_len, args.kv_batch_size)  # both built before any clock starts
    hf_lm = hf_model(args.model, kv_model.max_length, args.hf_batch_size)
    warm_task_data(list(limits), args.model)  # one-off data building (tokenizer, haystack tokens) before any clock
    load = [os.getloadavg()]
    walls: dict[str, list[float]] = {"kvlab": [], "hf": []}
    for r in range(args.repeats):  # kvlab then hf, repeated: both see the same drift of a noisy machine
        kv_r = run_tasks(kv_model, "kvlab", list(limits), limits, {"pretrained": args.model})
        hf_r = run_tasks(hf_lm, "hf", list(limits), limits, {"pretrained": args.model})
        if r == 0:
            kv, hf = kv_r, hf_r
            kv.extra["stats"] = kv_model.llm.stats()
        walls["kvlab"].append(kv_r.wall_s)
        walls["hf"].append(hf_r.wall_s)
    load.append(os.getloadavg())
    comparisons = compare(kv, hf)
    command = " ".join([".venv/bin/python", "experiments/bench_lm_eval.py", *map(shlex.quote, sys.argv[1:])])
    lines = [f"# lm-eval through kvlab and hf: {args.model}", "", f"Command: `{command}`", "",
             f"fp32 weights, full cache; max_length {args.max_model_len - 1} for both; kvlab batch_size "
             f"{args.kv_batch_size}, hf batch_size {args.hf_batch_size}; both evaluations in one process, kvlab "
             "first; wall time of `lm_eval.simple_evaluate` (model loading and the one-off building of the tasks' "
             "data excluded: both done before the first clock).", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch threads {torch.get_num_threads()}; "
             f"load average (1/5/15 min) {fmt_load(load[0])} before, {fmt_load(load[1])} after.", "",
             *table(comparisons, kv, hf), "", *wall_table(walls), ""]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"lm_eval_backends_{args.model}{args.tag}"
    stem.with_suffix(".md").write_text("\n".join(lines))
    stem.with_suffix(".json").write_text(json.dumps(
        {"command": command, "limits": limits, "wall_s": walls, "torch_threads": torch.get_num_threads(),
         "load_average": {"before": load[0], "after": load[1]},
         "kvlab_stats": {k: v for k, v in kv.extra.get("stats", {}).items() if isinstance(v, (int, float))},
         "tasks": [asdict(c) for c in comparisons]}, indent=1, default=str))


if __name__ == "__main__":
    main()

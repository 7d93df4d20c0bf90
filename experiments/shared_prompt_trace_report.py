"""What sharing a system prompt buys on the Azure conversation trace, bookkeeping only: batch and modelled
throughput without sharing, with hashed pages and with the radix tree (conf/experiment/waste_trace.yaml).

    kvlab-run -m experiment=waste_trace name=shared_prompt_trace engine.block_size=16 workload.trace=conv \\
        workload.speedup=10 workload.max_model_len=3072 workload.system_prompt_tokens=500,2000
    kvlab-run -m experiment=waste_trace name=shared_prompt_trace engine.block_size=16 workload.trace=conv \\
        workload.speedup=10 workload.max_model_len=3072 workload.system_prompt_tokens=500,2000 \\
        engine.enable_prefix_caching=true engine.prefix_cache=hash,radix
    python experiments/shared_prompt_trace_report.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.study.experiment import read_record
from kvlab.study.loggers.local import write_report

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", default=str(ROOT / "multirun" / "shared_prompt_trace"))
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "shared_prompt_trace"))
    args = ap.parse_args()
    runs = []
    for record in sorted(Path(args.sweep).rglob("run.jsonl")):
        events = read_record(record)
        if events.get("finish", {}).get("status") != "finished":
            continue
        cfg = events["start"]["config"]
        m = {k.removeprefix("waste/"): v for k, v in events["metrics"]["metrics"].items() if k.startswith("waste/")}
        cache = cfg["engine"]["prefix_cache"] if cfg["engine"]["enable_prefix_caching"] else "none"
        runs.append((cfg["workload"]["system_prompt_tokens"], cache, m, cfg))
    if not runs:
        raise SystemExit(f"no finished runs under {args.sweep}")
    runs.sort(key=lambda r: (r[0], ["none", "hash", "radix"].index(r[1])))
    w, e = runs[0][3]["workload"], runs[0][3]["engine"]
    lines = ["# A shared system prompt on the Azure conversation trace: what page sharing buys (bookkeeping only)", "",
             "Commands: see the docstring of `experiments/shared_prompt_trace_report.py` (two `kvlab-run` sweeps, "
             "then the script).", "",
             f"The first {w['num_requests']} requests of the Azure {w['trace']} trace at 10x their arrival rate, each "
             f"with one shared system prompt before its own prompt; paged, block {e['block_size']}, a pool of "
             f"{w['kv_tokens']} token slots, max_model_len {w['max_model_len']} (own prompts cut to fit), "
             f"{e['max_num_batched_tokens']} tokens a step, prefix eviction {e['prefix_eviction']}. No model: the "
             "engine's scheduler, block manager, allocator and prefix cache on a simulated clock (a step costs "
             f"{w['step_s']} s + {w['token_s']} s per token computed: modelled, only ratios mean anything; "
             "deterministic, so the busy machine does not matter).", "",
             "| system prompt | sharing | max batch | mean batch | modelled tok/s | vs no sharing | prefix hit rate "
             "(tokens) | preemptions | pages peak / pool |", "|---|---|---|---|---|---|---|---|---|"]
    base = {s: m["sim_tokens_per_s"] for s, c, m, _ in runs if c == "none"}
    for s, c, m, _ in runs:
        ratio = f"{m['sim_tokens_per_s'] / base[s]:.2f}x" if s in base else "-"
        hit = f"{m['prefix_hit_rate_tokens']:.3f}" if "prefix_hit_rate_tokens" in m else "-"
        peak = f"{m['kv_blocks_peak']:.0f} / {w['kv_tokens'] // e['block_size']}" if "kv_blocks_peak" in m else "-"
        lines.append(f"| {s} | {c} | {m['max_concurrent_seqs']:.0f} | {m['mean_concurrent_seqs']:.1f} | "
                     f"{m['sim_tokens_per_s']:.0f} | {ratio} | {hit} | {m['preemptions']:.0f} | {peak} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(args.out, text, {"runs": [{"system_prompt_tokens": s, "sharing": c, "metrics": m}
                                           for s, c, m, _ in runs]})


if __name__ == "__main__":
    main()

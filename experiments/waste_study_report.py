"""Table of the real-model waste study (conf/experiment/waste_study.yaml): batch and throughput per allocator.

    kvlab-run -m experiment=waste_study
    kvlab-run -m experiment=waste_study engine=contiguous engine.allocator_args.reserve=max_model_len,request,pow2
    python experiments/waste_study_report.py [--sweep multirun/waste_study] [--out experiments/results/waste_study_smollm2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.study.experiment import read_record
from kvlab.study.loggers.local import write_report

ROOT = Path(__file__).resolve().parents[1]

COLUMNS = (("max_concurrent_seqs", "max batch", "{:.0f}"), ("mean_concurrent_seqs", "mean batch", "{:.2f}"),
           ("tokens_per_s", "tok/s (engine busy time)", "{:.2f}"), ("busy_s", "busy s", "{:.0f}"),
           ("preemptions", "preemptions", "{:.0f}"), ("waste_internal", "internal", "{:.3f}"),
           ("waste_reservation", "reservation", "{:.3f}"), ("waste_external", "external", "{:.3f}"),
           ("kv_blocks_total", "pool blocks", "{:.0f}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", default=str(ROOT / "multirun" / "waste_study"))
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "waste_study_smollm2"))
    args = ap.parse_args()
    rows = []
    for record in sorted(Path(args.sweep).rglob("run.jsonl")):
        events = read_record(record)
        if events.get("finish", {}).get("status") != "finished":
            continue
        cfg, metrics = events["start"]["config"], events["metrics"]["metrics"]
        engine = cfg["engine"]
        name = engine["allocator"] + (f" reserve={engine['allocator_args']['reserve']}"
                                      if engine["allocator"] == "contiguous" else "")
        rows.append((name, cfg, {k.removeprefix("workload/"): v for k, v in metrics.items()},
                     events["start"]["meta"]))
    if not rows:
        raise SystemExit(f"no finished runs under {args.sweep}")
    rows.sort(key=lambda r: (r[0] != "paged", r[0]))
    _, cfg, _, meta = rows[0]
    e, w = cfg["engine"], cfg["workload"]
    base = next((m["tokens_per_s"] for n, _, m, _ in rows if n == "contiguous reserve=max_model_len"), None)
    lines = ["# Batch and throughput per allocator at one KV budget (SmolLM2-135M, real model runs)", "",
             "Commands:", "```", "kvlab-run -m experiment=waste_study",
             "kvlab-run -m experiment=waste_study engine=contiguous "
             "engine.allocator_args.reserve=max_model_len,request,pow2",
             "python experiments/waste_study_report.py", "```", "",
             f"Model {cfg['model']['name']} ({cfg['model']['dtype']}, CPU); KV budget {e['kv_cache_memory']}, block "
             f"{e['block_size']}, max_model_len {e['max_model_len']}, {e['max_num_batched_tokens']} tokens a step; "
             f"the first {w['num_requests']} requests of the Azure {w['trace']} trace (lengths x{w['scale']}, prompts "
             f"<= {w['max_context']}, outputs <= {w['max_output']}), all queued at t=0, greedy, EOS ignored. "
             f"Commit {str(meta.get('git_commit'))[:7]}. The two cores were shared with other agents' jobs (load "
             "average 10-17 during these runs): tok/s is low and noisy; one run each, run one after another.", "",
             "Waste columns: fractions of the pool, mean over steps (`llm.stats()`, kvlab/metrics.py).", "",
             "| allocator | " + " | ".join(c[1] for c in COLUMNS) + " | tok/s vs reserve=max_model_len |",
             "|---|" + "---|" * (len(COLUMNS) + 1)]
    for name, _, m, _ in rows:
        ratio = f"{m['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {name} | " + " | ".join(fmt.format(m[k]) for k, _, fmt in COLUMNS) + f" | {ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(args.out, text, {"runs": [{"allocator": n, "metrics": m} for n, _, m, _ in rows]})


if __name__ == "__main__":
    main()

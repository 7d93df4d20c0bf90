"""The policy leaderboard from a sweep folder (conf/experiment/leaderboard.yaml): one row per (model, policy,
compression ratio), kvpress's columns (task scores) plus KV bytes held and tokens/s at batch 16.

    python experiments/leaderboard.py multirun/leaderboard --out experiments/results/leaderboard_smollm2

Reads every finished run under the folder (kvlab.analysis.load_runs); runs of different tasks of one cell
are merged into its row. Prints the Markdown table and writes it (with a JSON copy) to --out.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_throughput import table  # noqa: E402

METRICS = [  # (run column, table column, scale)
    ("ruler/score", "RULER", 1.0),
    ("agreement/greedy_match", "agreement: greedy match", 1.0),
    ("agreement/kl", "agreement: KL", 1.0),
    ("perplexity/ppl", "perplexity", 1.0),
    ("workload/kv_bytes_mean", "KV MiB held (mean over steps, batch 16)", 1 / 2**20),
    ("workload/tokens_per_s", "tok/s at batch 16", 1.0),
]
KEYS = ("model.name", "policy.name", "policy.compression_ratio")


def leaderboard(sweep: str | Path) -> list[dict]:
    from kvlab.analysis import load_runs

    runs = load_runs(sweep, include_failed=False)
    if runs.empty:
        raise SystemExit(f"no finished runs under {sweep}")
    rows: dict[tuple, dict] = {}
    for _, run in runs.iterrows():
        ratio = 0.0 if run["policy.name"] == "full" else run.get("policy.compression_ratio")
        key = (run["model.name"], run["policy.name"], ratio)
        row = rows.setdefault(key, {"model": key[0], "policy": key[1], "ratio": key[2]})
        for column, name, scale in METRICS:
            value = run.get(column)
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                row[name] = float(value) * scale
    return sorted(rows.values(), key=lambda r: (r["model"], r["ratio"] or 0.0, r["policy"]))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", help="the sweep folder (multirun/leaderboard)")
    p.add_argument("--out", default=None, help="write <out>.md and <out>.json")
    args = p.parse_args(argv)
    rows = leaderboard(args.sweep)
    columns = [("model", "model"), ("policy", "policy"), ("ratio", "compression ratio")]
    columns += [(name, name) for _, name, _ in METRICS if any(name in r for r in rows)]
    text = "\n".join([f"# Policy leaderboard ({args.sweep})", "",
                      f"Command: `python experiments/leaderboard.py {' '.join(argv or sys.argv[1:])}`", "",
                      table(rows, columns), ""])
    print(text)
    if args.out:
        from kvlab.loggers.local import write_report

        write_report(args.out, text, {"rows": rows})
    return rows


if __name__ == "__main__":
    main()

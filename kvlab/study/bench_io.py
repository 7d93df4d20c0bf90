"""What every benchmark script in experiments/ writes: its provenance, its tables, its results files, its log.

A benchmark (nano-vllm's bench.py shape: short, these helpers imported from the package) prints a markdown
report and writes it as `experiments/results/<name>.md` with the figures and the metadata in `<name>.json`:

    meta = metadata(args)                               # command, commit, versions, machine, load at start
    text = "\\n".join(["# Title", "", *provenance(meta), table(rows, [("key", "heading"), ...])])
    save(args.out, text, meta, rows)                    # print, then <out>.md and <out>.json
    log("cell done")                                    # a timestamped line on stderr
    rows = bench_main(parse_args, run, report, argv)    # a script's whole main: parse, threads, run, save
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout the scripts run from (kvlab installed editable from it)


def fmt(value) -> str:
    """A table cell: floats to 3 decimals below 10 and 1 above, NaN and None as '-'."""
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return "-" if value is None else str(value)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Markdown table of `rows`; columns are (key, heading)."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(k)) for k, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


def key_table(rows: list[dict]) -> str:
    """Markdown table of `rows` with the first row's keys as the headings, floats to 4 significant digits."""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()) + " |"
              for row in rows]
    return "\n".join(lines)


def metadata(args) -> dict:
    """The runner's run metadata (kvlab.study.experiment.run_meta: git state, package versions, host, start time)
    and what the report adds: the command, the machine, the load."""
    import torch

    from kvlab.study.experiment import run_meta

    meta = run_meta({"seed": args.seed, **vars(args)})
    return {
        **meta,
        "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
                   f"{platform.platform()}",
        "model": args.model,
        "load_start": load_average(),
        "args": vars(args).copy(),
    }


def commit_line(meta: dict) -> str:
    commit = (meta["git_commit"] or "?")[:7]
    return commit + (" (uncommitted changes present)" if meta["git_dirty"] else "")


def provenance(meta: dict, note: str = "timings are indicative only") -> list[str]:
    """A report's opening lines: the command that made it, the commit, the machine and its load."""
    return [f"Command: `{meta['command']}`  ",
            f"Commit: {commit_line(meta)}; machine: {meta['machine']}; load average at start {meta['load_start']}, "
            f"at end {load_average()} ({note}).", ""]


def save(out: str | Path, text: str, meta: dict, rows: list[dict]) -> None:
    """Print the report and write it as <out>.md, with <out>.json holding the figures and the metadata."""
    from kvlab.study.loggers.local import write_report

    print(text)
    write_report(out, text, {"meta": meta, "rows": rows})


def write_results(out: str | Path, results: dict, text: str) -> None:
    """Print the report and write it as <out>.md, with <out>.json holding `results` as they are."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    out.with_suffix(".md").write_text(text)
    print(text)


def uptime() -> str:
    """`uptime`'s line (the load the run shared the machine with)."""
    import subprocess

    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def bench_main(parse_args, run, report, argv=None) -> list[dict]:
    """A benchmark's whole `main`: its arguments, torch pinned to `args.threads` (before the metadata, which quotes
    it), the rows `run(args)` measures, and `report(rows, meta, args)` printed and saved at `args.out`.

        def main(argv=None):
            return bench_main(parse_args, run, report, argv)
    """
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    meta = metadata(args)
    rows = run(args)
    save(args.out, report(rows, meta, args), meta, rows)
    return rows

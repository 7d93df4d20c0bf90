"""Which built-in plugins meet: every pair across kinds (draft, policy, cache format, prefix index,
parallel samples, allocator) run through `kvlab.testing.check_combination` on the tiny random Llama.

Each cell is one of
    exact     every check ran and held (greedy output with a draft = the same cache without it, prefix hits and
              a schedule that preempts change nothing, nothing left behind)
    held      it runs under a deviation the capability table declares, and every check held anyway
    differed  it runs under a declared deviation, and a check that deviation excuses failed (named)
    refused   the capability table refuses it before the model loads (the reason in the list below)
    FAIL      a check failed: a bug, listed with its message

    python experiments/composition_matrix.py --out experiments/results/composition_matrix   # ~35 min, 2 cores
    python experiments/composition_matrix.py --default-mode --only draft,quant --out /tmp/matrix_default

In parts (`--only`: the pairs whose two kinds are both listed), then one table of them all (a pair in two parts
counted once, in the order of a whole run), each part's command, date and load average quoted:
    python experiments/composition_matrix.py --only draft,quant,prefix,samples,allocator --out parts/rest
    python experiments/composition_matrix.py --only policy,draft --out parts/policy_draft   # ... and so on
    python experiments/composition_matrix.py --merge parts/*.json --out experiments/results/composition_matrix
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import time
from datetime import datetime, timezone
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ADAKV_H2O = {"budget": 32, "scorer": "h2o", "scorer_args": {"recent": 8}}  # adakv over accumulated attention
KINDS = ("draft", "policy", "quant", "prefix", "samples", "allocator")
MARK = {"exact": "✔", "held": "≈", "differed": "≠", "refused": "✘", "FAIL": "FAIL"}


def options(default_mode: bool = False) -> dict[str, dict[str, dict]]:
    """kind -> option name -> the engine arguments it adds (plus `n` for samples). A cache format runs in the
    batch-invariant mode (`batch_invariant=True`, which makes rounding formats exact) unless `default_mode`."""
    from kvlab.registry import ALLOCATORS, QUANT_FORMATS, load_plugins
    from kvlab.testing.builtin_args import DRAFT_ARGS, POLICY_ARGS, SPARSE_ARGS

    load_plugins()
    return {
        "draft": {d: {"draft": d, "draft_args": a} for d, a in DRAFT_ARGS.items()},
        "policy": {**{p: {"policy": p, "policy_args": a} for p, a in {**POLICY_ARGS, **SPARSE_ARGS}.items()},
                   "adakv/h2o": {"policy": "adakv", "policy_args": ADAKV_H2O}},
        "quant": {q: {"quant": q, **({} if default_mode else {"batch_invariant": True})}
                  for q in QUANT_FORMATS.names() if q not in ("fp32", "auto")},
        "prefix": {**{i: {"enable_prefix_caching": True, "prefix_cache": i} for i in ("hash", "radix")},
                   **{f"{i}, copied": {"enable_prefix_caching": True, "prefix_cache": i, "prefix_keep_shared": False}
                      for i in ("hash", "radix")}},
        "samples": {"n=2": {"n": 2}},
        "allocator": {a: {"allocator": a} for a in ALLOCATORS.names() if a != "paged"},
    }


def cell(args: dict) -> tuple[str, str]:
    """(verdict, detail) of one configuration."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from kvlab.testing import check_combination

    torch.set_num_threads(1)
    try:
        got = check_combination(**args)
    except AssertionError as exc:
        return "FAIL", str(exc).splitlines()[0][:300]
    except Exception as exc:  # noqa: BLE001 - an error inside a run is a failed cell, reported, not a crash
        return "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    if got.startswith("refused: "):
        return "refused", got[len("refused: "):]
    if got.startswith("runs outside the contract: "):
        detail = got[len("runs outside the contract: "):]
        return ("held" if detail.endswith("; held") else "differed"), detail
    return got, ""


def pairs(opts: dict) -> list[tuple[str, str, str, str, dict]]:
    out = []
    for ka, kb in itertools.combinations(KINDS, 2):
        for a, b in itertools.product(opts[ka], opts[kb]):
            args = {**opts[ka][a], **opts[kb][b]}
            out.append((ka, a, kb, b, args))
    return out


def run_line(run: dict) -> str:
    """A run's command, pairs, minutes, date and load averages (1 / 5 / 15 min, at its start and end)."""
    load = "".join(f", load average {' / '.join(f'{x:.2f}' for x in run[k])} at the {k[5:]}"
                   for k in ("load_start", "load_end") if run.get(k))
    date = f", {run['date']}" if run.get("date") else ""
    return f"`{run['command']}` ({run['pairs']} pairs, {run['seconds'] / 60:.1f} min on 2 CPU cores{date}{load})"


def markdown(rows: list[dict], runs: list[dict], default_mode: bool = False) -> str:
    counts = {v: sum(r["verdict"] == v for r in rows) for v in MARK}
    command = (f"Command: {run_line(runs[0])}.\n" if len(runs) == 1 else
               f"Run in {len(runs)} parts ({len(rows)} pairs), merged with `--merge`:\n\n"
               + "\n".join(f"- {run_line(r)}" for r in runs) + "\n")
    lines = [f"# Composition matrix: every pair of built-in plugins across kinds (tiny random Llama)\n", command,
             "Each pair runs `kvlab.testing.check_combination` (experiments/composition_matrix.py). "
             "✔ exact: greedy output with a draft equals the same cache without it, prefix hits and a schedule "
             "that preempts change nothing, nothing left behind. ≈ runs under a deviation the capability table "
             "declares (`kvlab/engine/capabilities.py: DEVIATIONS`) and every check held anyway on these prompts; "
             "≠ the same, and a check the deviation excuses failed (which, below). ✘ refused "
             "before the model loads (`REFUSED`). FAIL: a check failed. "
             + ("Cache formats run in the default mode.\n" if default_mode else
                "Every pair with a cache format runs in the batch-invariant mode (`batch_invariant=True`), without "
                "which the rounding formats run under the declared deviation \"a rounding format under a changing "
                "schedule\" (`--default-mode`).\n"),
             "Totals: " + ", ".join(f"{MARK[v]} {v} {counts[v]}" if MARK[v] != v else f"{v} {counts[v]}"
                                    for v in MARK) + ".\n"]
    by_kinds: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by_kinds.setdefault((r["kind_a"], r["kind_b"]), []).append(r)
    for (ka, kb), group in by_kinds.items():
        cols = list(dict.fromkeys(r["b"] for r in group))
        lines.append(f"\n## {ka} x {kb}\n")
        lines.append(f"| {ka} \\ {kb} | " + " | ".join(cols) + " |")
        lines.append("|---" * (len(cols) + 1) + "|")
        for a in dict.fromkeys(r["a"] for r in group):
            marks = {r["b"]: MARK[r["verdict"]] for r in group if r["a"] == a}
            lines.append(f"| {a} | " + " | ".join(marks.get(c, "") for c in cols) + " |")
    reasons: dict[tuple[str, str], int] = {}
    for r in rows:
        if r["verdict"] != "exact":  # plugin names quoted in a message left out: one line per reason
            key = (r["verdict"], re.sub(r"'[^'\s]*'", "'…'", r["detail"]))
            reasons[key] = reasons.get(key, 0) + 1
    lines.append("\n## Why (each distinct reason once, with how many pairs)\n")
    for (verdict, detail), count in sorted(reasons.items()):
        lines.append(f"- {MARK[verdict]} ({count}) {detail}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="experiments/results/composition_matrix", help="writes <out>.md and <out>.json")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--only", default=None, help="kinds to pair, comma-separated (default: all)")
    p.add_argument("--default-mode", action="store_true",
                   help="cache formats in the default mode (not batch-invariant: rounding formats then deviate)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="write one table from the .json files of runs in parts (runs nothing)")
    args = p.parse_args(argv)
    opts = options(args.default_mode)
    order = {(t[0], t[1], t[2], t[3]): i for i, t in enumerate(pairs(opts))}
    if args.merge:
        rows, runs = merge([json.loads(Path(f).read_text()) for f in args.merge], order)
    else:
        rows, runs = run(opts, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"runs": runs, "rows": rows}, indent=1))
    text = markdown(rows, runs, args.default_mode)
    out.with_suffix(".md").write_text(text)
    print(text)
    failed = [r for r in rows if r["verdict"] == "FAIL"]
    for r in failed:
        print(f"FAIL {r['kind_a']}={r['a']} x {r['kind_b']}={r['b']}: {r['detail']}", file=sys.stderr)


def run(opts: dict, args) -> tuple[list[dict], list[dict]]:
    """Every pair (of the kinds in --only) -> (rows, [this run: command, pairs, seconds, date, load averages])."""
    todo = pairs(opts)
    if args.only:
        kinds = set(args.only.split(","))
        todo = [t for t in todo if {t[0], t[2]} <= kinds]
    date, load_start = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), os.getloadavg()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        verdicts = list(pool.map(cell, [t[4] for t in todo]))
    seconds = time.perf_counter() - t0
    rows = [{"kind_a": ka, "a": a, "kind_b": kb, "b": b, "verdict": v, "detail": d}
            for (ka, a, kb, b, _), (v, d) in zip(todo, verdicts)]
    command = ("python experiments/composition_matrix.py " + " ".join(sys.argv[1:])).strip()
    return rows, [{"command": command, "pairs": len(rows), "seconds": seconds, "date": date,
                   "load_start": load_start, "load_end": os.getloadavg()}]


def merge(parts: list[dict], order: dict) -> tuple[list[dict], list[dict]]:
    """The rows of runs in parts, each pair once, in the order of a whole run, and every part's run."""
    rows: dict[tuple, dict] = {}
    runs = []
    for part in parts:
        for r in part["rows"]:
            rows.setdefault((r["kind_a"], r["a"], r["kind_b"], r["b"]), r)
        runs += part.get("runs") or [{"command": part["command"], "pairs": len(part["rows"]),
                                      "seconds": part["seconds"]}]
    missing = [k for k in order if k not in rows]
    if missing:
        print(f"note: {len(missing)} pairs in no part, e.g. {missing[0]}", file=sys.stderr)
    return sorted(rows.values(), key=lambda r: order.get((r["kind_a"], r["a"], r["kind_b"], r["b"]), len(order))), runs


if __name__ == "__main__":
    main()

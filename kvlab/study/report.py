"""`kvlab-report <sweep folder>` (also `python -m kvlab.study.report`): a sweep's runs as a leaderboard.

    kvlab-report multirun/leaderboard                      # writes into the sweep folder
    kvlab-report multirun/leaderboard --out report/ --quality "top-1 match"
    kvlab-report experiments/results/runs/leaderboard_smollm2.tar.gz --out experiments/results/leaderboard_smollm2
                                                           # a committed study's archive of runs

Writes, into the sweep folder or `--out`:
    leaderboard.md         the table (kvlab.study.analysis.leaderboard) and the plots, with the command
    leaderboard.csv        the same table, machine-readable
    leaderboard_merged.csv a study of one sweep per task (experiments/leaderboard.sh): one row per
                           (model, method, ratio), each task's columns side by side (also first in the .md)
    pareto_<cost>_<score>.png  for such a study: each task's score against KV MiB held and tokens/s
    pareto_<cost>[_<n>].png  quality against KV MiB held and against tokens/s, Pareto front drawn
                           (one plot per dataset when the sweep has several)
    leaderboard.html       one self-contained page: the table and the plots inlined (base64), no
                           external URL, opens without network (generated: not committed under
                           experiments/results/, which .gitignore keeps to reviewable reports)
and logs the table as a W&B Table when W&B is on (the sweep's runs logged to W&B, or --wandb on).
A record it cannot read stops it, exit status 1, naming the file and the line
(kvlab.study.experiment.read_record): no start line, a line that is not a record event, a metric that
is not a number.
"""

from __future__ import annotations

import argparse
import base64
import html
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from kvlab.study.analysis import leaderboard, load_runs, markdown_table, merge_tasks, plot_pareto, score_columns
from kvlab.study.run_archive import is_archive, stem

log = logging.getLogger("kvlab")

PLOTS = (("KV MiB held (mean)", "kv_bytes"), ("tokens/s", "throughput"))  # (cost column, file stem)


@dataclass
class Report:
    """What `write_report` made: the table and the files."""

    board: pd.DataFrame
    quality: str | None
    merged: pd.DataFrame | None = None  # one row per (model, method, ratio): each task's sweep side by side
    files: dict[str, Path] = field(default_factory=dict)
    plots: list[tuple[str, Path]] = field(default_factory=list)  # (caption, png)


def choose_quality(board: pd.DataFrame, quality: str | None) -> str | None:
    """The quality column of the plots: `quality` if given (must exist), else the first score column."""
    scores = score_columns(board)
    if quality is None:
        return scores[0] if scores else None
    if quality not in board.columns:
        raise ValueError(f"--quality {quality!r} is not a leaderboard column; the sweep has: {', '.join(scores)}")
    return quality


def save_pareto(board: pd.DataFrame, quality: str, cost: str, caption: str, path: Path) -> tuple[str, Path] | None:
    """One Pareto plot (kvlab.study.analysis.plot_pareto) written to `path`; None when no row has both columns."""
    if board[[cost, quality]].dropna().empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_pareto(board, quality, cost)
    fig.axes[0].set_title(caption, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return caption, path


def make_plots(board: pd.DataFrame, quality: str, out: Path) -> list[tuple[str, Path]]:
    """Pareto plots (quality vs each cost in PLOTS), one per dataset; those without data are skipped."""
    plots = []
    datasets = list(dict.fromkeys(board["dataset"]))
    for cost, stem in PLOTS:
        if cost not in board.columns:
            continue
        for i, dataset in enumerate(datasets):
            path = out / (f"pareto_{stem}.png" if len(datasets) == 1 else f"pareto_{stem}_{i}.png")
            plots.append(save_pareto(board[board["dataset"] == dataset], quality, cost,
                                     f"{dataset}: {quality} vs {cost}", path))
    return [p for p in plots if p is not None]


def make_merged_plots(merged: pd.DataFrame, out: Path) -> list[tuple[str, Path]]:
    """Every task's score against each cost in PLOTS, from the merged table (one sweep per task)."""
    plots = []
    for cost, stem in PLOTS:
        for quality in score_columns(merged) if cost in merged.columns else []:
            slug = "".join(c if c.isalnum() else "_" for c in quality.lower()).strip("_")
            plots.append(save_pareto(merged, quality, cost, f"{quality} vs {cost}", out / f"pareto_{stem}_{slug}.png"))
    return [p for p in plots if p is not None]


def markdown(report: Report, sweep: Path, command: str) -> str:
    lines = [f"# Leaderboard: {sweep}", "", f"Command: `{command}`", "",
             f"{len(report.board)} rows from the finished runs under `{sweep}` (kvlab.study.analysis.leaderboard); "
             "`full` rows (ratio 0) are the reference. KV MiB and tokens held, tokens/s, TTFT and KV MiB freed "
             "come from the run's workload (empty when the run had none); KV is counted in bytes and tokens, "
             "not pages, whose size depends on the layer grouping (a compressing policy's pages hold one "
             "layer).", ""]
    if report.merged is not None:
        lines += [f"One row per policy and ratio, each task's sweep side by side ({len(report.merged)} rows; "
                  f"tasks: {report.merged['tasks'].iloc[0]}):", "",
                  markdown_table(report.merged.drop(columns="tasks")), "", "Every run, one row per task:", ""]
    lines += [markdown_table(report.board), ""]
    for caption, path in report.plots:
        lines += [f"![{caption}]({path.name})", ""]
    return "\n".join(lines)


def html_page(report: Report, sweep: Path, command: str) -> str:
    """One page, nothing fetched: the table as HTML, each PNG inlined as a data: URI."""
    tables = [t for t in (report.merged, report.board) if t is not None]
    table = "\n".join(t.to_html(index=False, na_rep="", float_format=lambda v: f"{v:.4g}", border=0,
                                 classes="leaderboard") for t in tables)
    images = "\n".join(
        f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}"><figcaption>{html.escape(caption)}</figcaption></figure>'
        for caption, path in report.plots)
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}"
             "th,td{border:1px solid #ccc;padding:3px 6px;text-align:right}th{background:#eee}"
             "figure{display:inline-block;margin:1em}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>kvlab leaderboard: "
            f"{html.escape(str(sweep))}</title><style>{style}</style></head><body>\n"
            f"<h1>Leaderboard: {html.escape(str(sweep))}</h1>\n<p>Command: <code>{html.escape(command)}</code></p>\n"
            f"{table}\n{images}\n</body></html>\n")


def write_report(sweep: str | Path, out: str | Path | None = None, quality: str | None = None,
                 command: str | None = None) -> Report:
    """Read the sweep, build the leaderboard and write the Markdown, CSV, PNGs and HTML into `out`."""
    sweep = Path(sweep)
    if not (sweep.is_dir() or is_archive(sweep)):
        raise FileNotFoundError(f"kvlab-report: sweep folder (or .tar.gz of runs) {sweep} does not exist")
    runs = load_runs(sweep)
    if runs.empty or not (runs["status"] == "finished").any():
        raise ValueError(f"kvlab-report: no finished run under {sweep} (a kvlab sweep writes run.jsonl per job)")
    board = leaderboard(runs)
    report = Report(board, choose_quality(board, quality))
    out = Path(out) if out is not None else (sweep.parent / stem(sweep) if is_archive(sweep) else sweep)
    out.mkdir(parents=True, exist_ok=True)
    command = command or f"kvlab-report {sweep}"
    report.merged = merge_tasks(board)
    if report.merged is not None:  # one sweep per task: plot each task's score against the costs
        report.plots = make_merged_plots(report.merged, out)
        report.files["merged_csv"] = out / "leaderboard_merged.csv"
        report.merged.to_csv(report.files["merged_csv"], index=False)
    if report.quality is not None:
        report.plots += make_plots(board, report.quality, out)
    report.files["csv"] = out / "leaderboard.csv"
    board.to_csv(report.files["csv"], index=False)
    report.files["md"] = out / "leaderboard.md"
    report.files["md"].write_text(markdown(report, sweep, command))
    report.files["html"] = out / "leaderboard.html"
    report.files["html"].write_text(html_page(report, sweep, command))
    return report


def wandb_target(runs: pd.DataFrame) -> dict | None:
    """The W&B project/entity/group the sweep's runs logged to, if they used the W&B logger."""
    if "logger._target_" not in runs.columns:
        return None
    used = runs[runs["logger._target_"].astype(str).str.endswith("WandbLogger")]
    if used.empty or (used.get("logger.mode") == "disabled").all():
        return None
    first = used.iloc[0]
    return {"project": _text(first.get("logger.project")) or "kvlab", "entity": _text(first.get("logger.entity")),
            "group": _text(first.get("logger.group")), "mode": _text(first.get("logger.mode")) or "offline"}


def _text(value) -> str | None:
    """A logger setting read back from the runs' table: the string, or None where it was unset. A study that
    mixes W&B runs with runs of another logger (a workload sweep with W&B beside lm-eval sweeps with
    logger=none) reads the unset `logger.entity` back as NaN, which W&B's settings refuse (not a string)."""
    return value if isinstance(value, str) and value else None


def log_wandb(report: Report, target: dict, out: Path) -> str:
    """Log the leaderboard as a W&B Table (and the plots as images) in a run of job type "report"."""
    import os

    import wandb

    mode = os.environ.get("WANDB_MODE") or target["mode"]
    run = wandb.init(project=target["project"], entity=target.get("entity"), group=target.get("group"),
                     job_type="report", name=f"report/{target.get('group') or out.name}", dir=str(out), mode=mode)
    try:
        run.log({"leaderboard": wandb.Table(dataframe=report.board)})
        for caption, path in report.plots:
            run.log({f"pareto/{path.stem}": wandb.Image(str(path), caption=caption)})
        return run.dir
    finally:
        run.finish()
        wandb.teardown()


def main(argv: list[str] | None = None) -> None:
    """The console script (its return value would be the exit status: nothing is returned)."""
    cli(argv)


def cli(argv: list[str] | None = None) -> Report:
    p = argparse.ArgumentParser(prog="kvlab-report", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", help="a sweep folder (multirun/<name>), any folder of kvlab runs, or a study's "
                                 ".tar.gz of runs (kvlab.study.run_archive)")
    p.add_argument("--out", default=None, help="output folder (default: the sweep folder; for an archive "
                                               "runs/<study>.tar.gz, runs/<study>/)")
    p.add_argument("--quality", default=None, help="leaderboard column on the plots' y axis "
                                                   "(default: the first score column)")
    p.add_argument("--wandb", choices=("auto", "on", "off"), default="auto",
                   help="log the table to W&B: auto = when the sweep's runs logged to W&B")
    args = p.parse_args(argv)
    command = "kvlab-report " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        report = write_report(args.sweep, args.out, args.quality, command)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    print(markdown_table(report.board))
    for path in report.files.values():
        print(f"wrote {path}")
    for _, path in report.plots:
        print(f"wrote {path}")
    target = wandb_target(load_runs(args.sweep)) if args.wandb == "auto" else (
        {"project": "kvlab", "entity": None, "group": Path(args.sweep).name, "mode": "offline"}
        if args.wandb == "on" else None)
    if target is not None:
        print(f"logged the leaderboard to W&B ({target['mode']}): {log_wandb(report, target, report.files['md'].parent)}")
    return report


if __name__ == "__main__":
    main()

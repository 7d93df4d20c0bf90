"""Read runs back as one DataFrame, and the standard plots.

    runs = load_runs("multirun/smoke")          # local sweep / run folders: their run.jsonl records
    runs = load_runs("my-entity/kvlab")         # a W&B project, through the W&B public API (online)
    cells = load_tables(runs, "niah_cells")     # a per-cell table of every run, with the run's columns
    board = leaderboard(runs)                   # kvlab-report's table: one row per (dataset, model, method, ratio)
    plot_pareto(board, "greedy match", "KV MiB held (mean)")   # quality vs cost, Pareto front drawn

One row per run: `run_dir`, `name`, `status` ("finished" / "failed"), `error`,
`source` ("local", "wandb"), the config flattened to dotted
columns (`engine.block_size`, `policy.name`, ...), the run's metadata as
`meta.*` (git commit, seed, versions), and its metrics as columns
(`agreement/kl`, `workload/tokens_per_s`, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from kvlab.study.experiment import read_record
from kvlab.study.loggers.local import RECORD
from kvlab.study.run_archive import is_archive, opened

FIRST = ["run_dir", "name", "status", "source"]


# -- loading -----------------------------------------------------------------------


def load_runs(source: str | Path, include_failed: bool = True) -> pd.DataFrame:
    """One row per run found under a local folder (every kvlab run writes its record, kvlab.study.loggers.local,
    whatever its W&B mode), in a study's archive of runs (`.tar.gz`, kvlab.study.run_archive), or in a W&B project ("entity/project") through the W&B public API when online."""
    path = Path(source).expanduser()
    if is_archive(path):  # a study's runs packed into one .tar.gz (kvlab.study.run_archive)
        with opened(path) as folder:
            rows = [{**local_row(p), "run_dir": f"{path}:{p.parent.relative_to(folder)}"}
                    for p in sorted(folder.rglob(RECORD))]
    elif path.exists():
        rows = [local_row(p) for p in sorted(path.rglob(RECORD))]
    elif "/" in str(source) and not str(source).startswith((".", "/", "~")):
        rows = wandb_api_rows(str(source))
    else:
        raise FileNotFoundError(f"load_runs: {source} is neither a folder nor a W&B project 'entity/project'")
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=FIRST)
    if not include_failed:
        df = df[df["status"] == "finished"]
    ordered = FIRST + sorted(c for c in df.columns if c not in FIRST)
    return df[ordered].reset_index(drop=True)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> dotted keys (`prefix` ends with "."); lists become tuples, so runs group by them."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    if not prefix:
        return {}
    return {prefix[:-1]: None if isinstance(node, dict) else tuple(node) if isinstance(node, list) else node}


def local_row(record: Path) -> dict:
    events = read_record(record)
    start, finish = events.get("start", {}), events.get("finish", {})
    metrics = dict(events["metrics"]["metrics"])
    metrics.update(finish.get("summary") or {})
    status = finish.get("status") or "running"  # no finish line: still running, or killed
    return {"run_dir": str(record.parent), "name": start.get("name"), "status": status,
            "error": finish.get("error"), "source": "local", **flatten(start.get("config") or {}),
            **flatten(start.get("meta") or {}, "meta."), **metrics}


def wandb_api_rows(project: str) -> list[dict]:
    import wandb

    rows = []
    for run in wandb.Api().runs(project):
        config = {k: v for k, v in run.config.items() if not k.startswith("_")}
        meta = config.pop("meta", {})
        summary = {k: v for k, v in run.summary_metrics.items() if not k.startswith(("_", "tables/", "figures/"))}
        status = summary.pop("status", None) or ("finished" if run.state == "finished" else run.state)
        rows.append({"run_dir": run.url, "name": run.name, "status": status, "error": summary.pop("error", None),
                     "source": "wandb", **flatten(config), **flatten(meta, "meta."), **_scalars(summary)})
    return rows


def _scalars(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool)) or v is None}


def load_tables(runs: pd.DataFrame, name: str, columns: Iterable[str] = ()) -> pd.DataFrame:
    """Table `name` (tables/<name>.parquet) of every local run in `runs`, with `run_dir` and `columns`
    of the run attached (e.g. columns=["policy.name", "policy.budget"])."""
    frames = []
    for _, run in runs.iterrows():
        path = Path(run["run_dir"]) / "tables" / f"{name}.parquet"
        if path.exists():
            frame = pd.read_parquet(path)
            for col in ["run_dir", *columns]:
                frame[col] = [run[col]] * len(frame)
            frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


# -- standard plots --------------------------------------------------------------------


def _axes(ax):
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        return fig, ax
    return ax.figure, ax


def _need(df: pd.DataFrame, *columns: str) -> pd.DataFrame:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise KeyError(f"runs have no column(s) {missing}; columns: {', '.join(map(str, df.columns))}")
    return df[df["status"] == "finished"] if "status" in df.columns else df


def plot_quality_vs_budget(runs: pd.DataFrame, metric: str = "agreement/kl", budget: str = "policy.budget",
                           policy: str = "policy.name", ax=None):
    """`metric` against the KV budget, one line per policy (mean over repeated runs)."""
    df = _need(runs, metric, budget, policy)
    fig, ax = _axes(ax)
    for name, group in df.groupby(policy):
        mean = group.groupby(budget)[metric].mean().sort_index()
        ax.plot(mean.index, mean.values, marker="o", label=str(name))
    ax.set_xlabel(budget)
    ax.set_ylabel(metric)
    ax.legend(title=policy)
    fig.tight_layout()
    return fig


def plot_throughput_vs_batch(runs: pd.DataFrame, metric: str = "workload/tokens_per_s",
                             batch: str = "workload/max_concurrent_seqs", hue: str = "engine.allocator", ax=None):
    """Throughput against batch size (reached or configured), one line per `hue`."""
    df = _need(runs, metric, batch, hue)
    fig, ax = _axes(ax)
    for name, group in df.groupby(hue):
        group = group.sort_values(batch)
        ax.plot(group[batch], group[metric], marker="o", label=str(name))
    ax.set_xlabel(batch)
    ax.set_ylabel(metric)
    ax.legend(title=hue)
    fig.tight_layout()
    return fig


WASTE = ("workload/waste_internal", "workload/waste_reservation", "workload/waste_external")


def plot_waste_breakdown(runs: pd.DataFrame, by: Iterable[str] = ("engine.allocator", "engine.block_size"),
                         parts: Iterable[str] = WASTE, ax=None):
    """Stacked bars of the KV waste fractions (internal, reservation, external) per configuration."""
    by, parts = list(by), list(parts)
    df = _need(runs, *by, *parts)
    table = df.groupby(by)[parts].mean()
    fig, ax = _axes(ax)
    bottom = None
    labels = [", ".join(map(str, k if isinstance(k, tuple) else (k,))) for k in table.index]
    for part in parts:
        ax.bar(labels, table[part].values, bottom=bottom, label=part.split("/")[-1])
        bottom = table[part].values if bottom is None else bottom + table[part].values
    ax.set_ylabel("fraction of KV slots")
    ax.set_xlabel(" / ".join(by))
    ax.legend()
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    return fig


# -- the leaderboard (kvlab-report and the notebook share these) ---------------------------------------

# (run column, leaderboard column, scale, better): kvpress's score columns, then what kvpress lacks
SCORES = (
    ("ruler/score", "RULER score", 1.0, "max"),
    ("niah/accuracy", "NIAH accuracy", 1.0, "max"),
    ("agreement/greedy_match", "greedy match", 1.0, "max"),
    ("agreement/top1_match", "top-1 match", 1.0, "max"),
    ("agreement/kl", "KL to full cache", 1.0, "min"),
    ("perplexity/ppl", "perplexity", 1.0, "min"),
)
# KV held and freed in bytes and tokens, never in pages: a page's size depends on the layer grouping (a
# compressing policy's pages hold one layer, or one KV head), so page counts do not compare across rows
# (kvlab.metrics, "KV held")
COSTS = (
    ("workload/kv_bytes_mean", "KV MiB held (mean)", 1 / 2**20, "min"),
    ("workload/kv_bytes_peak", "KV MiB held (peak)", 1 / 2**20, "min"),
    ("workload/kv_tokens_mean", "KV tokens held (mean)", 1.0, "min"),
    ("workload/tokens_per_s", "tokens/s", 1.0, "max"),
    ("workload/ttft_median_s", "TTFT median (s)", 1.0, "min"),
    ("workload/policy_bytes_freed", "KV MiB freed", 1 / 2**20, "max"),
)
KEYS = ("dataset", "model", "method", "compression ratio", "budget")
LM_EVAL_LOWER = ("perplexity", "bits_per_byte")  # lm-eval metrics (task=lm_eval) that improve downwards


def lm_eval_scores(columns) -> tuple:
    """SCORES-shaped entries for the lm-eval metrics runs logged (`lm_eval/<task>/<metric>`, kvlab.study.tasks.lm_eval),
    as leaderboard columns "lm-eval <task>/<metric>"."""
    return tuple((c, f"lm-eval {c[len('lm_eval/'):]}", 1.0, "min" if any(w in c for w in LM_EVAL_LOWER) else "max")
                 for c in columns if str(c).startswith("lm_eval/") and c != "lm_eval/wall_s")


def dataset_name(run: pd.Series) -> str:
    """The task a run was scored on: its class name, with its data source when it has one."""
    target = run.get("task._target_")
    if not isinstance(target, str):
        return "none"
    name = target.rsplit(".", 1)[-1].lower()
    for col in ("task.source", "task.corpus"):
        source = run.get(col)
        if isinstance(source, str) and source:
            return f"{name} ({source.split('/')[0]})"  # the data set's folder, not the file
    return name


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, (bool, str)):
        return None
    value = float(value)
    return None if value != value else value  # NaN: not measured


def leaderboard(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (dataset, model, method, compression ratio, budget) of the finished runs: kvpress's
    columns (score columns named by SCORES) plus KV MiB and tokens held, tokens/s, TTFT and KV MiB freed
    by the policy (COSTS);
    repeated runs of a cell (e.g. timing repeats with another `seed`) give their median. `full` rows have
    ratio 0 (the reference). Columns no run measured are left out; a cell a run did not measure is NaN."""
    df = _need(runs, "policy.name", "model.name")
    if df.empty:
        raise ValueError("leaderboard: no finished runs")
    rows, scores = [], SCORES + lm_eval_scores(df.columns)
    for _, run in df.iterrows():
        full = run["policy.name"] == "full"
        row = {"dataset": dataset_name(run), "model": run["model.name"], "method": run["policy.name"],
               "compression ratio": 0.0 if full else _number(run.get("policy.compression_ratio")),
               "budget": None if full else _number(run.get("policy.budget"))}
        for column, name, scale, _ in scores + COSTS:
            value = _number(run.get(column))
            row[name] = None if value is None else value * scale
        rows.append(row)
    table = pd.DataFrame(rows)
    keys = [k for k in KEYS if table[k].notna().any()]
    values = [name for _, name, _, _ in scores + COSTS if table[name].notna().any()]
    table[values] = table[values].astype(float)
    check_one_task_setting(table, task_settings(df), keys, values)
    board = table.groupby(keys, dropna=False, sort=False)[values].median().reset_index()
    board = board.sort_values([k for k in keys], na_position="first", kind="stable")
    return board.reset_index(drop=True)


def task_settings(runs: pd.DataFrame) -> list[str]:
    """Per run, its task's settings (every `task.*` column but the class: the lm-eval task list, the limit,
    the data's metadata, ...) as one string."""
    columns = sorted(c for c in runs.columns if str(c).startswith("task.") and c != "task._target_")
    return ["|".join(f"{c}={run[c]!r}" for c in columns) for _, run in runs.iterrows()]


def check_one_task_setting(table: pd.DataFrame, settings: list[str], keys: list[str], values: list[str]) -> None:
    """A cell's runs may repeat a measurement (timing repeats: their median is the cell), and runs of different
    task settings may fill different columns of it (lm-eval sweeps of different task lists, merged per policy
    and ratio), but one column measured under two task settings (e.g. kvlab_niah with 10 and with 100
    documents) has no single value: refused, naming the cell, rather than a median of two samples."""
    table = table.assign(_setting=settings)
    for cell, group in table.groupby(keys, dropna=False, sort=False):
        for name in values:
            measured = group.loc[group[name].notna(), "_setting"].unique()
            if len(measured) > 1:
                raise ValueError(
                    f"leaderboard: {name!r} of {dict(zip(keys, cell))} was measured by runs of different task "
                    f"settings ({' vs '.join(measured[:2])}); keep one of them in the sweep folder (move the "
                    f"other runs out) or report them apart")


def merge_tasks(board: pd.DataFrame) -> pd.DataFrame | None:
    """The leaderboard of a study made of one sweep per task (kvlab's leaderboard experiment: agreement,
    perplexity, RULER and a workload-only sweep) as one row per (model, method, ratio, budget), each
    task's columns side by side, kvpress-style; None when there is one dataset or when two datasets
    measured the same column of a cell (they would not merge)."""
    if "dataset" not in board.columns or board["dataset"].nunique() < 2:
        return None
    keys = [k for k in KEYS if k != "dataset" and k in board.columns]
    values = [c for c in board.columns if c not in KEYS]
    counts = board.groupby(keys, dropna=False, sort=False)[values].count()
    if (counts > 1).any().any():
        return None
    merged = board.groupby(keys, dropna=False, sort=False)[values].first().reset_index()
    merged.insert(0, "tasks", ", ".join(dict.fromkeys(board["dataset"])))
    return merged.sort_values(keys, na_position="first", kind="stable").reset_index(drop=True)


def score_columns(board: pd.DataFrame) -> list[str]:
    """The quality columns present in a leaderboard, in SCORES order."""
    return [name for _, name, _, _ in SCORES if name in board.columns] + \
        [c for c in board.columns if str(c).startswith("lm-eval ")]


def better(column: str) -> str:
    """"max" or "min": which way a leaderboard column improves."""
    for _, name, _, way in SCORES + COSTS:
        if name == column:
            return way
    if str(column).startswith("lm-eval "):
        return "min" if any(w in column for w in LM_EVAL_LOWER) else "max"
    raise KeyError(f"{column!r} is not a leaderboard column")


def pareto_front(df: pd.DataFrame, x: str, y: str, x_better: str = "min", y_better: str = "max") -> pd.Series:
    """True for the rows no other row beats on both `x` and `y` (ties kept); rows missing either are False."""
    sx = 1.0 if x_better == "min" else -1.0
    sy = 1.0 if y_better == "min" else -1.0
    ok = df[x].notna() & df[y].notna()
    xs, ys = (df[x] * sx).where(ok), (df[y] * sy).where(ok)
    front = []
    for i in df.index:
        if not ok[i]:
            front.append(False)
            continue
        dominated = ((xs <= xs[i]) & (ys <= ys[i]) & ((xs < xs[i]) | (ys < ys[i]))).any()
        front.append(not dominated)
    return pd.Series(front, index=df.index)


def plot_pareto(board: pd.DataFrame, quality: str, cost: str, ax=None):
    """`quality` against `cost` (leaderboard columns), one marker per method, the Pareto front drawn."""
    missing = [c for c in (quality, cost) if c not in board.columns]
    if missing:
        raise KeyError(f"leaderboard has no column(s) {missing}; columns: {', '.join(board.columns)}")
    fig, ax = _axes(ax)
    markers = "osD^v<>Pp*hX"  # matplotlib's colour cycle has 10 colours: a marker each keeps 12+ methods apart
    for i, (method, group) in enumerate(board.groupby("method", sort=True)):
        ax.scatter(group[cost], group[quality], label=str(method), s=28, marker=markers[i % len(markers)])
    front = board[pareto_front(board, cost, quality, better(cost), better(quality))].sort_values(cost)
    ax.plot(front[cost], front[quality], color="black", lw=1, ls="--", label="Pareto front")
    ax.set_xlabel(cost)
    ax.set_ylabel(quality)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def markdown_table(df: pd.DataFrame, digits: int = 4) -> str:
    """A GitHub Markdown table; floats to `digits` significant digits, missing cells empty."""
    def cell(value: Any) -> str:
        if value is None or (isinstance(value, float) and value != value):
            return ""
        if isinstance(value, float):
            return f"{value:.{digits}g}"
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def largest_ratio_kept(runs: pd.DataFrame, quality: str, keep: float, reference: float,
                       higher_is_better: bool = True, policy: str = "policy.name",
                       ratio: str = "policy.compression_ratio") -> pd.DataFrame:
    """Per policy, the largest compression ratio among the finished runs whose `quality` keeps `keep` of
    `reference` (the budget search's answer, conf/experiment/budget_search.yaml), with that run's quality
    and how many runs were tried; `ratio kept` is NaN for a policy none of whose runs kept it."""
    df = _need(runs, quality, policy, ratio)
    target = reference * keep if higher_is_better else reference / keep
    rows = []
    for name, group in df.groupby(policy, sort=True):
        ok = group[group[quality] >= target] if higher_is_better else group[group[quality] <= target]
        best = ok.loc[ok[ratio].idxmax()] if not ok.empty else None
        rows.append({"method": name, "ratio kept": None if best is None else float(best[ratio]),
                     quality: None if best is None else float(best[quality]), "runs": len(group),
                     "target": target})
    return pd.DataFrame(rows)

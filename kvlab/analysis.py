"""Read runs back as one DataFrame, and the standard plots.

    runs = load_runs("multirun/smoke")          # local sweep / run folders: their run.jsonl records
    runs = load_runs("my-entity/kvlab")         # a W&B project, through the W&B public API (online)
    cells = load_tables(runs, "niah_cells")     # a per-cell table of every run, with the run's columns

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

from kvlab.experiment import read_record
from kvlab.loggers.local import RECORD

FIRST = ["run_dir", "name", "status", "source"]


# -- loading -----------------------------------------------------------------------


def load_runs(source: str | Path, include_failed: bool = True) -> pd.DataFrame:
    """One row per run found under a local folder (every kvlab run writes its record, kvlab.loggers.local,
    whatever its W&B mode), or in a W&B project ("entity/project") through the W&B public API when online."""
    path = Path(source).expanduser()
    if path.exists():
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

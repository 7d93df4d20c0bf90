"""Read runs back as one DataFrame, and the standard plots.

    runs = load_runs("multirun/smoke")          # local sweep / run folders (run.jsonl records,
                                                # or bare offline W&B run folders)
    runs = load_runs("my-entity/kvlab")         # the W&B API (online)
    cells = load_tables(runs, "niah_cells")     # a per-cell table of every run, with the run's columns

One row per run: `run_dir`, `name`, `status` ("finished" / "failed"), `error`,
`source` ("local", "wandb-offline", "wandb"), the config flattened to dotted
columns (`engine.block_size`, `policy.name`, ...), the run's metadata as
`meta.*` (git commit, seed, versions), and its metrics as columns
(`agreement/kl`, `workload/tokens_per_s`, ...).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from kvlab.experiment import read_record
from kvlab.loggers.local import RECORD

FIRST = ["run_dir", "name", "status", "source"]


# -- loading -----------------------------------------------------------------------


def load_runs(source: str | Path, include_failed: bool = True) -> pd.DataFrame:
    """One row per run found under a local folder, or in a W&B project ("entity/project") when online."""
    path = Path(source).expanduser()
    if path.exists():
        rows = [local_row(p) for p in sorted(path.rglob(RECORD))]
        recorded = {Path(r["run_dir"]) for r in rows}
        for wandb_file in sorted(path.rglob("offline-run-*/run-*.wandb")):
            run_dir = wandb_file.parent.parent.parent  # <run dir>/wandb/offline-run-*/run-*.wandb
            if run_dir not in recorded:
                rows.append(wandb_offline_row(wandb_file))
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
        summary = {k: v for k, v in run.summary._json_dict.items() if not k.startswith(("_", "tables/", "figures/"))}
        status = summary.pop("status", None) or ("finished" if run.state == "finished" else run.state)
        rows.append({"run_dir": run.url, "name": run.name, "status": status, "error": summary.pop("error", None),
                     "source": "wandb", **flatten(config), **flatten(meta, "meta."), **_scalars(summary)})
    return rows


def _scalars(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool)) or v is None}


# -- offline W&B run files ----------------------------------------------------------


def wandb_offline_row(path: Path) -> dict:
    """A row from an offline run's `run-*.wandb` file (config, summary and exit records)."""
    config: dict = {}
    summary: dict = {}
    name, exit_code = None, None
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name = record.run.display_name
            _apply_updates(config, record.run.config.update)
        elif kind == "config":
            _apply_updates(config, record.config.update)
        elif kind == "summary":
            _apply_updates(summary, record.summary.update)
        elif kind == "exit":
            exit_code = record.exit.exit_code
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    meta = config.pop("meta", {})
    summary = {k: v for k, v in summary.items() if not k.startswith(("_", "tables/", "figures/"))}
    status = summary.pop("status", None) or ("finished" if exit_code == 0 else "failed" if exit_code else "running")
    return {"run_dir": str(path.parent.parent.parent), "name": name, "status": status,
            "error": summary.pop("error", None), "source": "wandb-offline", **flatten(config),
            **flatten(meta, "meta."), **_scalars(summary)}


def _apply_updates(target: dict, updates) -> None:
    for item in updates:
        key = "/".join(item.nested_key) if item.nested_key else item.key
        target[key] = json.loads(item.value_json)


def wandb_records(path: Path) -> Iterable[Any]:
    """The protobuf records of a `.wandb` file (a LevelDB-style log: 7-byte file header, then
    32 KiB blocks of chunks, each chunk `crc32:u32 length:u16 type:u8` + data; type 1 full,
    2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too short for a header: skip to the next block
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        pending += chunk
        if kind in (1, 4):
            record = pb.Record()
            try:
                record.ParseFromString(pending)
            except Exception:
                record = None
            pending = b""
            if record is not None:
                yield record


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

"""Run one experiment from a composed config: check it, build the LLM, run the task and workload, log.

    run_experiment(cfg, run_dir)   # cfg: a composed kvlab config (DictConfig or dict)

1. `kvlab.study.config.validate` checks the config against its schema;
2. in a sweep, a job whose finished record (same config hash) already exists is skipped;
   otherwise `kvlab.study.preflight.check_before_load` checks what the model's shape (read without its
   weights) and the data folder decide (no model is loaded before both checks pass); a config error
   is a ConfigError, recorded as a failed run, also when the engine refuses its options as it is built;
3. the local record (kvlab.study.loggers.local) and W&B (if configured) are opened, with the
   resolved config and the run's metadata (git commit, seed, package versions);
4. the LLM is built, the task then the workload run, their metrics / tables / figures are logged;
5. the loggers are always finished ("finished" or "failed"), and a results table is printed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

from kvlab.schema import import_target
from kvlab.study.config import ConfigError, engine_options, validate
from kvlab.study.loggers import LocalLogger, Loggers
from kvlab.study.loggers.local import RECORD
from kvlab.study.preflight import check_before_load, one_line
from kvlab.study.tasks.base import Result, RunContext
from kvlab.study.tasks.data import REPO_ROOT, resolve_data_dir

log = logging.getLogger("kvlab")

PACKAGES = ("kvlab", "torch", "transformers", "triton", "hydra-core", "omegaconf", "datasets", "wandb",
            "numpy", "pandas", "pyarrow")
NOT_HASHED = ("logger", "progress", "skip_existing", "fail_fast", "study", "sweep_progress_s")  # do not change what a run computes


def config_hash(config: dict) -> str:
    """Hash of what determines a run's results (the resolved config less logging options)."""
    key = {k: v for k, v in config.items() if k not in NOT_HASHED}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def git_state(root: Path = REPO_ROOT) -> dict:
    """Commit and dirtiness of the kvlab checkout; None for both in an installed (non-editable) package."""
    if not (root / ".git").exists():  # a package under site-packages: not its own checkout's state
        return {"git_commit": None, "git_dirty": None}

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD")
    return {"git_commit": commit or None, "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))
            if commit else None}


def run_meta(config: dict) -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {**git_state(), "seed": config.get("seed"), "config_hash": config_hash(config), "versions": versions,
            "python": platform.python_version(), "host": platform.node(), "pid": os.getpid(), "argv": list(sys.argv),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def llm_kwargs(config: dict) -> dict:
    """Keyword arguments of kvlab.LLM from a validated config: every EngineConfig field, from its section."""
    return engine_options(config)


def reference_kwargs(kwargs: dict) -> dict:
    """The full-cache reference: same model and engine, policy full, model-dtype cache, no draft."""
    return {**kwargs, "policy": "full", "policy_args": {}, "quant": "auto", "quant_args": {},
            "draft": None, "draft_args": {}}


def find_finished(sweep_dir: Path, digest: str) -> Path | None:
    """A run folder under `sweep_dir` whose record finished with config hash `digest` (a record that
    cannot be read is not a finished run: warned about, and the job runs again)."""
    for record in sorted(Path(sweep_dir).rglob(RECORD)):
        try:
            events = read_record(record)
        except RecordError as exc:
            log.warning("not a finished run (its record is broken): %s", exc)
            continue
        start, finish = events.get("start", {}), events.get("finish", {})
        if finish.get("status") == "finished" and start.get("meta", {}).get("config_hash") == digest:
            return record.parent
    return None


RECORD_EVENTS = ("start", "metrics", "table", "figure", "finish")  # what kvlab.study.loggers.local writes


class RecordError(ValueError):
    """A run.jsonl that is not a run's record; the message names the file and the line."""


def read_record(path: Path) -> dict[str, dict]:
    """{event: last record of that event} of a run.jsonl (metrics events merged).

    Raises RecordError naming the file and line of the first line that is not one of RECORD_EVENTS
    as a JSON object, a first event other than `start` (with its config), or a metric or summary
    value that is not a number (None stands for NaN). A last line without its newline that does not
    parse was cut by a crash: it is left out, with a warning."""
    events: dict[str, dict] = {}
    metrics: dict = {}
    with open(path) as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        event = _record_event(path, number, line, cut=number == len(lines) and not line.endswith("\n"))
        if event is None:
            continue
        if not events and event["event"] != "start":
            raise RecordError(f"{path}:{number}: the record does not begin with its start line (got a "
                              f"{event['event']!r} event); it is not a complete kvlab run record")
        if event["event"] == "metrics":
            metrics.update(event.get("metrics") or {})
        events[event["event"]] = event
    if not events:
        raise RecordError(f"{path}: empty record (no start line)")
    events["metrics"] = {"metrics": metrics}
    return events


def _record_event(path: Path, number: int, line: str, cut: bool) -> dict | None:
    """One line of a record, checked (RecordError naming `path`:`number`); None for a line cut by a crash."""
    where = f"{path}:{number}"
    try:
        event = json.loads(line)
    except json.JSONDecodeError as exc:
        if cut:
            log.warning("%s: left out a last line cut short (a crash while writing?): %s", where, exc)
            return None
        raise RecordError(f"{where}: not a JSON line ({exc.msg}): {line.strip()[:80]!r}") from None
    if not isinstance(event, dict) or event.get("event") not in RECORD_EVENTS:
        got = event.get("event") if isinstance(event, dict) else type(event).__name__
        raise RecordError(f"{where}: not a record event (got {got!r}; expected one of {', '.join(RECORD_EVENTS)})")
    if event["event"] == "start" and not isinstance(event.get("config"), dict):
        raise RecordError(f"{where}: the start line has no config mapping")
    for key in ("metrics", "summary"):
        if key in event:
            _check_numbers(where, key, event[key])
    return event


def _check_numbers(where: str, key: str, values: Any) -> None:
    if values is None:
        return
    if not isinstance(values, dict):
        raise RecordError(f"{where}: {key} must be a mapping of names to numbers, got {type(values).__name__}")
    for name, value in values.items():
        if value is not None and not isinstance(value, (int, float)):  # bool is an int
            raise RecordError(f"{where}: {key} {name!r} is {value!r}, not a number")


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_llm(kwargs: dict):
    """kvlab.LLM(**kwargs); what the engine refuses while it is built (a ValueError or TypeError: options
    that do not go together, a pool or format that does not fit the model) is a ConfigError."""
    from kvlab import LLM

    try:
        return LLM(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(one_line(exc)) from exc


def run_experiment(cfg: Any, run_dir: str | Path, sweep_dir: str | Path | None = None,
                   job_name: str | None = None) -> dict | None:
    """Run one experiment; returns its summary metrics (None when skipped). Raises on failure (after logging it)."""
    run_dir = Path(run_dir)
    try:
        config = validate(cfg)
        digest = config_hash(config)
        done = find_finished(Path(sweep_dir), digest) if config["skip_existing"] and sweep_dir is not None else None
        if done is not None:
            log.info("skipped %s: a finished run with the same config (%s) is in %s", job_name, digest, done)
            return None
        check_before_load(config)
    except ConfigError as exc:
        record_config_error(cfg, run_dir, job_name, exc)
        raise
    name = f"{config['name']}/{job_name}" if job_name else config["name"]
    loggers = Loggers([LocalLogger()] + ([import_target(config["logger"]["_target_"], "logger._target_")(
        **{k: v for k, v in config["logger"].items() if k != "_target_"})] if config["logger"] else []))
    loggers.start(run_dir, name, config, run_meta(config))
    summary: dict[str, float] = {}
    try:
        summary = execute(config, loggers)
    except BaseException as exc:
        loggers.finish("failed", summary, error="".join(traceback.format_exception(exc)))
        raise
    loggers.finish("finished", summary)
    print_results(name, summary)
    return summary


def execute(config: dict, loggers: Loggers) -> dict:
    """Build the LLM, run the task and the workload, log what they return; the summary metrics."""
    seed_everything(config["seed"])
    t0 = time.perf_counter()
    kwargs = llm_kwargs(config)
    llm = build_llm(kwargs)
    summary: dict[str, float] = {"run/load_s": time.perf_counter() - t0}
    reference_llm: list = []

    def reference():
        if not reference_llm:
            same = reference_kwargs(kwargs) == kwargs
            reference_llm.append(llm if same else build_llm(reference_kwargs(kwargs)))
        return reference_llm[0]

    ctx = RunContext(resolve_data_dir(config["data_dir"]), config["seed"], config["progress"], reference,
                     reference_key=json.dumps(reference_kwargs(kwargs), sort_keys=True, default=repr))
    for section in ("task", "workload"):
        node = config[section]
        if node is None:
            continue
        params = {k: v for k, v in node.items() if k != "_target_"}
        t = time.perf_counter()
        result: Result = import_target(node["_target_"], f"{section}._target_")(**params).run(llm, ctx)
        result.metrics[f"run/{section}_s"] = time.perf_counter() - t
        log_result(loggers, result)
        summary.update(result.metrics)
    summary["run/elapsed_s"] = time.perf_counter() - t0
    loggers.log_metrics({"run/elapsed_s": summary["run/elapsed_s"], "run/load_s": summary["run/load_s"]})
    return summary


def log_result(loggers: Loggers, result: Result) -> None:
    loggers.log_metrics(result.metrics)
    for name, table in result.tables.items():
        loggers.log_table(name, table)
    for name, figure in result.figures.items():
        import matplotlib.pyplot as plt

        loggers.log_figure(name, figure)
        plt.close(figure)


def record_config_error(cfg: Any, run_dir: Path, job_name: str | None, exc: Exception) -> None:
    """A config that fails validation still leaves a (failed) local record."""
    from omegaconf import DictConfig, OmegaConf

    raw = cfg
    if isinstance(cfg, DictConfig):
        try:
            raw = OmegaConf.to_container(cfg, resolve=True)
        except Exception:
            raw = OmegaConf.to_container(cfg, resolve=False)
    local = LocalLogger()
    try:
        local.start(run_dir, job_name or str(raw.get("name", "run")), raw, {"config_hash": None})
        local.finish("failed", {}, error=f"config error: {exc}")
    except Exception as log_exc:  # never hide the config error behind a logging one
        log.warning("could not write the failed record in %s: %s", run_dir, log_exc)


def print_results(name: str, summary: dict) -> None:
    """The run's metrics as a two-column table on stdout."""
    rows = [(k, v) for k, v in summary.items() if isinstance(v, (int, float))]
    width = max((len(k) for k, _ in rows), default=10)
    lines = [f"== {name} ==", f"{'metric':<{width}}  value", f"{'-' * width}  {'-' * 12}"]
    for key, value in rows:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<{width}}  {text}")
    print("\n".join(lines), flush=True)

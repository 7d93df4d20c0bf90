"""`kvlab-run` / `python -m kvlab`: the Hydra entry point.

    kvlab-run                                            # the default experiment (conf/config.yaml)
    kvlab-run policy=full task=niah model=smollm2-135m   # choose group options
    kvlab-run -m engine.allocator=paged,contiguous engine.block_size=8,16 model=random-llama-tiny task=agreement
    kvlab-run -m experiment=smoke                        # a named study (conf/experiment/)
    kvlab-run -m hydra/launcher=parallel ...             # the same sweep, jobs in parallel (joblib)

Registered plugins become group options first (kvlab.study.conf_plugins). A single run
exits non-zero when it fails. In a sweep a failed job is recorded as failed and
the sweep goes on; at its end a summary lists the jobs finished / failed /
skipped, and the exit status is 1 if any failed (kvlab.study.sweep_report).
fail_fast=true stops the sweep at the first failure. A config error (a value the
schema, kvlab.study.preflight or the engine refuses) is one line, `config error: <path>:
<problem>`, exit status 1, no traceback (the run's record keeps it); every check
that does not need the weights runs before any model loads.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from kvlab.study.conf_plugins import CONF_DIR, register_plugin_configs
from kvlab.study.config import ConfigError, validate
from kvlab.study.experiment import config_hash, find_finished, read_record, run_experiment
from kvlab.study.launchers import register_launchers
from kvlab.study.loggers.local import RECORD
from kvlab.study.preflight import one_line
from kvlab.study.study import Outcome, make_study
from kvlab.study.sweep_report import SweepStopped, error_line, sweep_has_failed

log = logging.getLogger("kvlab")


def task(cfg: DictConfig) -> dict | None:
    """One Hydra job."""
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        return sweep_job(cfg, hc)
    try:
        return run_experiment(cfg, hc.runtime.output_dir, None, hc.job.override_dirname or "run")
    except ConfigError as exc:  # one line, no traceback (the run's record keeps it)
        log.error("config error: %s", one_line(exc))
        sys.exit(f"config error: {one_line(exc)}")


def sweep_job(cfg: DictConfig, hc) -> Outcome:
    """One job of a sweep; never raises: returns its outcome (status, error, and in a study the objective
    values, kvlab.study.study) for SweepReport and the sweeper."""
    job_name = hc.job.override_dirname or f"job{hc.job.num}"
    if cfg.get("fail_fast", False) and sweep_has_failed(hc.sweep.dir):
        log.warning("job %s not run: an earlier job of this sweep failed and fail_fast is set", job_name)
        return Outcome("not run")
    try:
        summary = run_experiment(cfg, hc.runtime.output_dir, hc.sweep.dir, job_name)
        values = study_values(cfg, hc, summary) if cfg.get("study") else None
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return Outcome("failed", f"config error: {error_line(str(exc))}")
    except Exception as exc:
        log.exception("job %s failed; it is recorded as failed in %s", job_name, hc.runtime.output_dir)
        return Outcome("failed", error_line(exc))
    return Outcome("skipped" if summary is None else "finished", None, values)


def study_values(cfg: DictConfig, hc, summary: dict | None) -> list[float]:
    """The study's objective values of this job: from its metrics, or (skipped) from the finished run it matched."""
    config = validate(cfg)
    if summary is None:
        done = find_finished(Path(hc.sweep.dir), config_hash(config))
        summary = read_record(done / RECORD)["metrics"]["metrics"] if done is not None else {}
    return make_study(config["study"]).values(config, summary)


def main(argv: list[str] | None = None) -> None:
    """The console script; `argv` (default: sys.argv[1:]) is its command line, e.g. ["policy=snapkv"]."""
    register_plugin_configs()
    register_launchers()
    saved = sys.argv
    if argv is not None:
        sys.argv = [saved[0] if saved else "kvlab-run", *argv]
    try:
        hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(task)()
    except SweepStopped as stop:  # fail_fast in a sweep run in this process (basic launcher)
        stop.report.finish(stopped=True)
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()

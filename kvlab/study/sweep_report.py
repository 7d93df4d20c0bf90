"""A sweep's outcome: every job's status in a ledger, a summary at the end, a failing exit status.

Hydra's `hydra.main` returns nothing for a multirun and kvlab's sweep jobs do not
raise (a failed job is recorded and the sweep goes on), so without this a sweep
with failed jobs would exit 0. `SweepReport` is a Hydra callback (configured in
conf/config.yaml under `hydra.callbacks`):

    on_multirun_start   empties the ledger <sweep dir>/sweep_jobs.jsonl
    on_job_end          appends the job's outcome (finished | failed | skipped | not run) to it;
                        it runs where the job ran (the sweep's process for the basic launcher,
                        a worker process for joblib), hence a file, not memory
    on_multirun_end     prints the summary, one line per failure, and exits 1 if any job failed

    sweep multirun/study: 3 jobs: 1 finished, 1 failed, 1 skipped
      failed task.prompt_length=600: ValueError: prompt 0: prompt of 600 tokens does not fit ...

fail_fast=true: with the basic launcher (jobs one after the other in the sweep's
process) the first failure stops the sweep: on_job_end raises `SweepStopped`,
which no Hydra layer catches, and `kvlab.__main__.main` prints the summary and
exits 1. With joblib (jobs in worker processes) a job cannot stop its siblings
without joblib killing the workers mid-run, so the jobs already running finish,
and every job that starts after a failure is in the ledger returns at once as
"not run" (kvlab.__main__.sweep_job checks `sweep_has_failed` first).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from kvlab.study.sweep_checks import check_sweep
from kvlab.study.sweep_ledger import STATUSES, ledger_path, read_ledger

def sweep_has_failed(sweep_dir: str | Path) -> bool:
    return any(row.get("status") == "failed" for row in read_ledger(sweep_dir))


def error_line(exc: BaseException | str, limit: int = 400) -> str:
    """One line for the summary: `Type: message`, newlines folded, long messages cut."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def job_outcome(job_return: JobReturn) -> dict[str, Any]:
    """{"status", "error"} of a finished Hydra job (the task returns such a dict; a raised error is a failure)."""
    if job_return.status == JobStatus.FAILED:
        return {"status": "failed", "error": error_line(job_return._return_value)}
    value = job_return._return_value  # kvlab.study.study.Outcome (kvlab.__main__.sweep_job) or a dict like it
    if hasattr(value, "get") and value.get("status") in STATUSES:
        return {"status": value.get("status"), "error": value.get("error")}
    return {"status": "finished", "error": None}


class SweepStopped(BaseException):
    """fail_fast: a job failed and the sweep must not run another one.

    A BaseException so that Hydra's job runner, its callback dispatch and its error
    reporter (which all catch Exception) let it through to `kvlab.__main__.main`.
    """

    def __init__(self, report: "SweepReport"):
        super().__init__("a job failed and fail_fast is set: sweep stopped")
        self.report = report


class SweepReport(Callback):
    """Records each sweep job's outcome and reports the sweep at its end (see the module docstring)."""

    def __init__(self) -> None:
        self.sweep_dir: Path | None = None  # set in the sweep's process; pickled to joblib workers with it
        self.pid: int | None = None
        self.progress = None  # kvlab.study.sweep_progress.SweepProgress, in the sweep's process, launchers but basic

    def __getstate__(self) -> dict:  # sent to workers (joblib, Ray, submitit) without the progress thread
        return {**self.__dict__, "progress": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_sweep(config)  # a launcher or study that cannot run: SweepRefused, before any job starts
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
        self.pid = os.getpid()
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        ledger_path(self.sweep_dir).write_text("")
        interval = float(config.get("sweep_progress_s") or 0)
        launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "")
        if interval > 0 and not launcher.endswith("BasicLauncher"):
            from kvlab.study.sweep_progress import SweepProgress

            self.progress = SweepProgress(self.sweep_dir, interval).start()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if self.sweep_dir is None:  # a single run: nothing to report
            return
        job = config.hydra.job
        row = {"num": int(job.num), "job": str(job.override_dirname or f"#{job.num}"),
               "dir": str(config.hydra.runtime.output_dir), **job_outcome(job_return)}
        with open(ledger_path(self.sweep_dir), "a") as f:  # one short line per write: safe across workers
            f.write(json.dumps(row) + "\n")
        if row["status"] == "failed" and config.get("fail_fast", False) and os.getpid() == self.pid:
            raise SweepStopped(self)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.finish()

    def finish(self, stopped: bool = False) -> None:
        """Print the summary; exit with status 1 if a job failed."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        rows = read_ledger(self.sweep_dir)
        print(summary(self.sweep_dir, rows, stopped), flush=True)
        failed = sum(row["status"] == "failed" for row in rows)
        if failed:
            raise SystemExit(f"sweep failed: {failed} of {len(rows)} jobs failed (see {self.sweep_dir})")


def summary(sweep_dir: Path, rows: list[dict], stopped: bool = False) -> str:
    counts = {status: sum(row["status"] == status for row in rows) for status in STATUSES}
    head = (f"sweep {sweep_dir}: {len(rows)} jobs: {counts['finished']} finished, {counts['failed']} failed, "
            f"{counts['skipped']} skipped")
    if counts["not run"]:
        head += f", {counts['not run']} not run (fail_fast)"
    lines = [head] + [f"  failed {row['job']}: {row['error']}" for row in rows if row["status"] == "failed"]
    if stopped:
        lines.append("  sweep stopped at the first failure (fail_fast=true); later jobs did not run")
    return "\n".join(lines)

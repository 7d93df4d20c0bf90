"""hydra-ray-launcher's RayLauncher with a sweep's bookkeeping: no finished job lost when a worker dies.

The upstream launcher submits one Ray task per job and collects them with `[ray.get(r) for r in runs]`:
one worker that dies (killed, out of memory, node lost) raises there, the sweep aborts, and the
outcomes of the jobs that did finish never reach the sweeper. `KvlabRayLauncher` submits the jobs
the same way (upstream's `start_ray` and `launch_job_on_ray`), then collects each job as it ends
(`ray.wait`); a job whose task raised a Ray error (its worker died) is

  - recorded as failed: a `finish` line (status failed, the Ray error) appended to its run record
    if it started one, and a row in the sweep's ledger (kvlab.study.sweep_report), whose end-of-sweep
    summary then lists it and exits 1;
  - returned to the sweeper as a completed job whose outcome is failed (kvlab's sweep jobs never
    raise: Hydra's basic sweeper re-raises any failed JobReturn).

A rerun of the same command skips the finished jobs (same config hash, kvlab.study.experiment) and
runs the failed one again. Set `ray.remote.max_retries` above 0 to let Ray retry a dead worker's job
itself instead (conf/hydra/launcher/ray_cluster.yaml keeps 0: a retried job restarts from scratch).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict

try:
    from hydra_plugins.hydra_ray_launcher.ray_launcher import RayLauncher
except ImportError:  # hydra-ray-launcher not installed (kvlab's `sweeps` extra): no launcher, and no warning
    RayLauncher = None  # from Hydra's plugin scan

log = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 78643200  # upstream's default for a local start (75 MiB): kvlab jobs pass no large objects


class KvlabRayLauncher(RayLauncher or object):
    """RayLauncher that records a dead worker's job as failed and keeps every finished job's outcome."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import ray

        from hydra_plugins.hydra_ray_launcher._launcher_util import launch_job_on_ray, start_ray

        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Ray launcher (kvlab) is launching {len(job_overrides)} jobs, sweep output dir: {sweep_dir}")
        with open_dict(self.ray_cfg):
            self.ray_cfg.init.setdefault("object_store_memory", OBJECT_STORE_BYTES)
        start_ray(self.ray_cfg.init)

        pending = {}
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = f"job_id_for_{idx}"
                sweep_config.hydra.job.num = idx
            ref = launch_job_on_ray(self.hydra_context, self.ray_cfg.remote, sweep_config, self.task_function,
                                    Singleton.get_state())
            pending[ref] = (idx - initial_job_idx, list(overrides), sweep_config)

        returns: list[JobReturn | None] = [None] * len(job_overrides)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                slot, overrides, sweep_config = pending.pop(ref)
                try:
                    returns[slot] = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    returns[slot] = self.record_dead_job(sweep_config, overrides, exc)
        return returns

    def record_dead_job(self, sweep_config: DictConfig, overrides: list[str], exc: BaseException) -> JobReturn:
        """A job whose Ray task failed (its worker died): failed in its run record and the sweep ledger."""
        from kvlab.study.sweep_ledger import ledger_path
        from kvlab.study.sweep_report import error_line

        error = error_line(f"Ray worker died: {type(exc).__name__}: {exc}")
        job_dir = job_output_dir(sweep_config)
        log.error("job #%s (%s) failed: %s", sweep_config.hydra.job.num, job_dir, error)
        mark_record_failed(job_dir, error)
        row = {"num": int(sweep_config.hydra.job.num), "dir": str(job_dir), "status": "failed", "error": error,
               "job": str(sweep_config.hydra.job.override_dirname or f"#{sweep_config.hydra.job.num}")}
        with open(ledger_path(self.config.hydra.sweep.dir), "a") as f:
            f.write(json.dumps(row) + "\n")
        ret = JobReturn(overrides=overrides, cfg=sweep_config, hydra_cfg=None, working_dir=str(job_dir),
                        task_name=str(sweep_config.hydra.job.name), status=JobStatus.COMPLETED)
        ret.return_value = {"status": "failed", "error": error}
        return ret


def job_output_dir(sweep_config: DictConfig) -> Path:
    """Where Hydra's run_job puts the job: hydra.sweep.dir / hydra.sweep.subdir (resolved here)."""
    return Path(str(sweep_config.hydra.sweep.dir)) / str(OmegaConf.select(sweep_config, "hydra.sweep.subdir"))


def mark_record_failed(job_dir: Path, error: str) -> None:
    """Append a failed `finish` line to the job's run record if it started one and did not finish it."""
    from kvlab.study.loggers.local import RECORD
    from kvlab.study.sweep_progress import has_finish

    record = job_dir / RECORD
    if record.exists() and not has_finish(record):
        data = record.read_bytes()
        if not data.endswith(b"\n"):  # a line the dead worker left half written: dropped, the record stays strict
            record.write_bytes(data[: data.rfind(b"\n") + 1])
        with open(record, "a") as f:
            f.write(json.dumps({"event": "finish", "time": time.time(), "status": "failed", "summary": {},
                                "error": error}) + "\n")

"""`kvlab-run` / `python -m kvlab`: the Hydra entry point.

    kvlab-run                                            # the default experiment (conf/config.yaml)
    kvlab-run policy=full task=niah model=smollm2-135m   # choose group options
    kvlab-run -m engine.allocator=paged,contiguous engine.block_size=8,16 model=random-llama-tiny task=agreement
    kvlab-run -m experiment=smoke                        # a named study (conf/experiment/)
    kvlab-run -m hydra/launcher=parallel ...             # the same sweep, jobs in parallel (joblib)

Registered plugins become group options first (kvlab.conf_plugins). In a sweep a
failed job is recorded as failed and the sweep goes on (fail_fast=true stops it);
a single run exits non-zero. A config error is reported with its path, before any
model loads.
"""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from kvlab.conf_plugins import CONF_DIR, register_plugin_configs
from kvlab.config import ConfigError
from kvlab.experiment import run_experiment

log = logging.getLogger("kvlab")


def task(cfg: DictConfig) -> dict | None:
    """One Hydra job."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    job_name = hc.job.override_dirname or ("run" if not multirun else f"job{hc.job.num}")
    try:
        return run_experiment(cfg, hc.runtime.output_dir, hc.sweep.dir if multirun else None, job_name)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        if multirun and not cfg.get("fail_fast", False):
            return None
        sys.exit(f"config error: {exc}")
    except Exception:
        if not multirun or cfg.get("fail_fast", False):
            raise
        log.exception("job %s failed; it is recorded as failed in %s and the sweep goes on",
                      job_name, hc.runtime.output_dir)
        return None


def main() -> None:
    register_plugin_configs()
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(task)()


if __name__ == "__main__":
    main()

"""Weights & Biases logging, offline unless configured, never fatal.

`mode: online` first checks that the server (WANDB_BASE_URL, else
api.wandb.ai) answers; if it does not, or `wandb.init` fails, the run is logged
offline with a warning (`wandb sync <dir>` uploads it later). Offline runs land
in `<run output folder>/wandb/offline-run-*`. The run is always finished, so one
crashed job does not break the next job of a multirun.
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlparse

from kvlab.study.loggers.base import RunLogger

DEFAULT_SERVER = "https://api.wandb.ai"


def server_reachable(url: str, timeout_s: float) -> bool:
    """Can a TCP connection be opened to the host of `url`?"""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass
class WandbLogger(RunLogger):
    project: str = "kvlab"                                   # W&B project
    entity: str | None = None                                # team or user
    mode: Literal["offline", "online", "disabled"] = "offline"
    group: str | None = None                                 # groups a study's runs
    tags: list[str] = field(default_factory=list)            # run tags
    init_timeout_s: float = 30.0                             # online: seconds before falling back

    def __post_init__(self) -> None:
        self.run = None

    def start(self, run_dir, name, config, meta):
        import wandb

        if self.mode == "disabled":
            return
        kwargs = dict(project=self.project, entity=self.entity, group=self.group, tags=list(self.tags),
                      name=name, dir=str(run_dir), config={**config, "meta": meta}, reinit="finish_previous")
        mode = os.environ.get("WANDB_MODE", self.mode) or self.mode
        if mode == "online":
            server = os.environ.get("WANDB_BASE_URL", DEFAULT_SERVER)
            if not server_reachable(server, min(self.init_timeout_s, 5.0)):
                warnings.warn(f"W&B server {server} is unreachable; logging this run offline in {run_dir}/wandb "
                              f"(upload later with `wandb sync`)", RuntimeWarning, stacklevel=2)
                mode = "offline"
        try:
            self.run = wandb.init(mode=mode, settings=wandb.Settings(init_timeout=self.init_timeout_s), **kwargs)
        except Exception as exc:
            if mode == "offline":
                raise
            warnings.warn(f"W&B init failed online ({type(exc).__name__}: {exc}); logging this run offline",
                          RuntimeWarning, stacklevel=2)
            self.run = wandb.init(mode="offline", **kwargs)

    def log_metrics(self, metrics, step=None):
        if self.run is not None:
            self.run.log(dict(metrics), step=step)

    def log_table(self, name, table):
        import wandb

        if self.run is not None:
            self.run.log({f"tables/{name}": wandb.Table(dataframe=table.astype(
                {c: str for c in table.columns if table[c].dtype == object}))})

    def log_figure(self, name, figure):
        import wandb

        if self.run is not None:
            self.run.log({f"figures/{name}": wandb.Image(figure)})

    def finish(self, status, summary, error=None):
        if self.run is None:
            return
        try:
            self.run.summary.update({k: v for k, v in summary.items() if v is not None})
            self.run.summary["status"] = status
            if error:
                self.run.summary["error"] = error[-2000:]
        finally:
            import wandb

            self.run.finish(exit_code=0 if status != "failed" else 1)
            self.run = None
            wandb.teardown()  # flush the run file now: offline data is written asynchronously

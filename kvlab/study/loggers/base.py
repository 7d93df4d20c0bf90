"""The run-logger interface: one run's config, metrics, tables and figures.

A run is `start` -> (`log_metrics` | `log_table` | `log_figure`)* -> `finish`;
`finish` is always called, with status "finished", "failed" or "skipped".
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any


class RunLogger(ABC):
    @abstractmethod
    def start(self, run_dir: Path, name: str, config: dict, meta: dict) -> None:
        """Open the run; `config` is the resolved config, `meta` the git commit, versions, seed..."""

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...

    @abstractmethod
    def log_table(self, name: str, table: Any) -> None:
        """`table` is a pandas DataFrame."""

    @abstractmethod
    def log_figure(self, name: str, figure: Any) -> None:
        """`figure` is a matplotlib Figure."""

    @abstractmethod
    def finish(self, status: str, summary: dict, error: str | None = None) -> None: ...


class Loggers(RunLogger):
    """Fans out to several loggers; a logger that raises is warned about and dropped, never fatal."""

    def __init__(self, loggers: list[RunLogger]):
        self.loggers = list(loggers)

    def _each(self, method: str, *args, **kwargs) -> None:
        for logger in list(self.loggers):
            try:
                getattr(logger, method)(*args, **kwargs)
            except Exception as exc:  # logging must never kill the run
                warnings.warn(f"{type(logger).__name__}.{method} failed ({type(exc).__name__}: {exc}); "
                              f"this logger is disabled for the rest of the run", RuntimeWarning, stacklevel=3)
                self.loggers.remove(logger)
                if method != "finish":
                    try:
                        logger.finish("failed", {}, error=f"logger error: {exc}")
                    except Exception:
                        pass

    def start(self, run_dir, name, config, meta):
        self._each("start", run_dir, name, config, meta)

    def log_metrics(self, metrics, step=None):
        self._each("log_metrics", metrics, step)

    def log_table(self, name, table):
        self._each("log_table", name, table)

    def log_figure(self, name, figure):
        self._each("log_figure", name, figure)

    def finish(self, status, summary, error=None):
        self._each("finish", status, summary, error)

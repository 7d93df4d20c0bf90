"""Run loggers: a local record (always) and Weights & Biases (conf/logger/wandb.yaml)."""

from kvlab.study.loggers.base import Loggers, RunLogger
from kvlab.study.loggers.local import LocalLogger

__all__ = ["LocalLogger", "Loggers", "RunLogger"]

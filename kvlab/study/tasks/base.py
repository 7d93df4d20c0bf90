"""What a quality task or a workload is: `run(llm, ctx) -> Result`.

Tasks (kvlab.study.tasks) and workloads (kvlab.study.workloads) are dataclasses of their
parameters, built by Hydra from `_target_` in conf/task/ and conf/workload/.
Building one is cheap (no data is read); `run` reads its data, drives the LLM
and returns scalar metrics (named `<task>/<metric>`), tables of per-cell
results and figures. The experiment runner logs all three.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar


@dataclass
class RunContext:
    """What a task may need besides the LLM under test."""

    data_dir: Path                                      # shared data folder (kvlab.study.tasks.data)
    seed: int = 0                                       # seeds data sampling
    progress: bool = False                              # show progress bars
    reference: Callable[[], Any] | None = None          # builds (once) the full-cache reference LLM
    reference_key: str | None = None                    # identifies the reference's settings: a task may reuse
                                                        # what the reference computed in an earlier run of a sweep


@dataclass
class Result:
    """Scalar metrics, tables (pandas DataFrames) and figures (matplotlib) of one task or workload."""

    metrics: dict[str, float] = field(default_factory=dict)
    tables: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)

    def update(self, other: "Result") -> "Result":
        self.metrics.update(other.metrics)
        self.tables.update(other.tables)
        self.figures.update(other.figures)
        return self


class Task(ABC):
    """Base of tasks and workloads; subclasses are dataclasses whose `__post_init__` checks values."""

    # the metric names `run` returns, as fnmatch patterns ("perplexity/ppl@*"); None: not declared.
    # A study's objectives are checked against them before any job starts (kvlab.study.study)
    METRICS: ClassVar[tuple[str, ...] | None] = None

    @abstractmethod
    def run(self, llm: Any, ctx: RunContext) -> Result:
        """Drive `llm` (a kvlab.LLM) and return metrics, tables and figures."""


def check_positive(obj: Any, *names: str) -> None:
    """Raise ValueError naming the first of `names` that is not a positive number (or list of them)."""
    for name in names:
        value = getattr(obj, name)
        values = value if isinstance(value, (list, tuple)) else [value]
        if not values or any(not isinstance(v, (int, float)) or v <= 0 for v in values):
            raise ValueError(f"{type(obj).__name__}.{name} must be positive, got {value!r}")

"""What a sweep job returns to a searching sweeper (hydra-optuna-sweeper): the study's objective values.

A config's `study` section (null outside searches; conf/experiment/budget_search.yaml,
conf/experiment/pareto_study.yaml) names the metrics each job returns, in the order of
`hydra.sweeper.direction`:

    study:
      objectives: [agreement/top1_match, workload/kv_bytes_mean]   # a multi-objective study
      quality: null          # the budget search's quality metric (see ratio_kept)
      keep: 0.9              # fraction of the full cache's quality to keep
      reference: 1.0         # the full cache's value of `quality`
      higher_is_better: true # direction of `quality` (false for perplexity)

`study/ratio_kept` is one more objective a job can return: the run's compression ratio when its
quality keeps `keep` of the reference, else minus the relative shortfall (< 0). Maximising it finds
the largest ratio (the smallest budget) that keeps the quality: every ratio that keeps it scores
higher than any that does not, and among those that do not the closer one scores higher.

`check_objectives` runs before any job starts (kvlab.study.sweep_checks): an objective must be a metric
the configured task or workload produces (their `METRICS` patterns), `run/...`, or study/ratio_kept.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

RATIO_KEPT = "study/ratio_kept"
RUN_METRICS = ("run/load_s", "run/task_s", "run/workload_s", "run/elapsed_s")


@dataclass
class Study:
    """The objectives of a searching sweep (see the module docstring)."""

    objectives: list[str] = field(default_factory=list)  # metrics returned, in hydra.sweeper.direction order
    quality: str | None = None                            # study/ratio_kept: the quality metric
    keep: float = 0.9                                     # study/ratio_kept: fraction of `reference` to keep
    reference: float | None = None                        # study/ratio_kept: the full cache's `quality`
    higher_is_better: bool = True                         # direction of `quality`

    def __post_init__(self) -> None:
        if isinstance(self.objectives, str):
            self.objectives = [self.objectives]
        self.objectives = list(self.objectives)
        if not self.objectives:
            raise ValueError("study.objectives: name at least one metric the jobs return to the sweeper")
        if RATIO_KEPT in self.objectives:
            if self.quality is None or self.reference is None:
                raise ValueError(f"study: {RATIO_KEPT} needs study.quality (a metric) and study.reference "
                                 "(the full cache's value of it)")
            if not 0 < self.keep <= 1:
                raise ValueError(f"study.keep must be in (0, 1], got {self.keep}")

    def metrics_needed(self) -> list[str]:
        names = [m for m in self.objectives if m != RATIO_KEPT]
        if RATIO_KEPT in self.objectives and self.quality not in names:
            names.append(self.quality)
        return names

    def ratio_kept(self, quality: float, ratio: float) -> float:
        """The ratio if `quality` keeps `keep` of the reference, else -(relative shortfall)."""
        ref = self.reference
        target = ref * self.keep if self.higher_is_better else ref / self.keep
        shortfall = (target - quality) if self.higher_is_better else (quality - target)
        return float(ratio) if shortfall <= 0 else -shortfall / abs(target)

    def values(self, config: dict, metrics: dict) -> list[float]:
        """The objective values of a finished run (its validated config and its metrics)."""
        missing = [m for m in self.metrics_needed() if metrics.get(m) is None]
        if missing:
            raise KeyError(f"study: the run produced no {missing}; it has {', '.join(sorted(metrics))}")
        out = []
        for name in self.objectives:
            if name == RATIO_KEPT:
                policy = config.get("policy") or {}
                ratio = 0.0 if policy.get("name") == "full" else policy.get("compression_ratio")
                if ratio is None:
                    raise KeyError(f"study: {RATIO_KEPT} needs policy.compression_ratio in the searched config")
                out.append(self.ratio_kept(float(metrics[self.quality]), ratio))
            else:
                out.append(float(metrics[name]))
        return out


class Outcome:
    """A sweep job's return value: its status for kvlab.study.sweep_report, and, in a study, its objective
    values for the sweeper (float(outcome) for one objective, list(outcome) for several; a failed or
    not-run job has no values, so the sweeper records the trial as failed)."""

    def __init__(self, status: str, error: str | None = None, values: list[float] | None = None):
        self.status, self.error, self.values = status, error, values

    def __float__(self) -> float:
        if not self.values:
            raise TypeError(f"job {self.status}: no objective value ({self.error})")
        return float(self.values[0])

    def __iter__(self):
        if not self.values:
            raise TypeError(f"job {self.status}: no objective values ({self.error})")
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values or ())

    def get(self, key: str, default: Any = None) -> Any:  # reads like the {"status", "error"} dict it replaces
        return {"status": self.status, "error": self.error}.get(key, default)

    def __repr__(self) -> str:
        return f"Outcome({self.status!r}, error={self.error!r}, values={self.values!r})"


def produced(section: dict | None) -> tuple[str, ...] | None:
    """The metric-name patterns a task / workload section declares (its class's METRICS), None if undeclared."""
    if not section or not section.get("_target_"):
        return ()
    from kvlab.schema import import_target

    return getattr(import_target(section["_target_"], "_target_"), "METRICS", None)


def check_objectives(config: dict) -> None:
    """Raise ValueError if an objective (or the quality metric) is a metric no configured task produces."""
    study = make_study(config.get("study"))
    if study is None:
        return
    sections = {name: produced(config.get(name)) for name in ("task", "workload")}
    for metric in study.metrics_needed():
        if metric in RUN_METRICS:
            continue
        if any(patterns is None for patterns in sections.values()):  # a third-party task without METRICS
            continue
        if not any(fnmatch.fnmatchcase(metric, p) for patterns in sections.values() for p in patterns):
            known = sorted({p for patterns in sections.values() for p in patterns} | set(RUN_METRICS) | {RATIO_KEPT})
            task = (config.get("task") or {}).get("_target_")
            workload = (config.get("workload") or {}).get("_target_")
            raise ValueError(f"study objective {metric!r} is not a metric of task {task} or workload {workload}; "
                             f"they produce: {', '.join(known)}")


def make_study(node: Any) -> Study | None:
    if node is None:
        return None
    if isinstance(node, Study):
        return node
    if not isinstance(node, dict):
        raise ValueError(f"study: expected a mapping (objectives, quality, keep, reference), got {node!r}")
    unknown = set(node) - set(Study.__dataclass_fields__)
    if unknown:
        raise ValueError(f"study.{sorted(unknown)[0]}: unknown key; known: {', '.join(Study.__dataclass_fields__)}")
    return Study(**node)

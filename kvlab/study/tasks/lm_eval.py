"""lm-evaluation-harness tasks on the run's engine (`task=lm_eval`): every metric lm-eval reports, logged.

The run's `kvlab.LLM` (its policy, format, draft, block size, budget) is wrapped as lm-eval's `kvlab` model
(kvlab.study.lm_eval.KvlabLM) and `lm_eval.simple_evaluate` runs `tasks`; each metric of each task becomes
`lm_eval/<task>/<metric>` (`lm_eval/<task>/<metric>/<filter>` when the task filters its outputs), beside a
table of every metric (stderr included) and one of every sample's per-request results. Tasks are found in
kvlab's offline task folder (kvlab.study.lm_eval.TASKS_DIR), in `include_path` and, with `include_defaults`, among
lm-eval's own tasks (their hub data needs a network or a local copy: README, "lm-evaluation-harness").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvlab.study.tasks.base import Result, RunContext, Task, check_positive


@dataclass
class LmEval(Task):
    METRICS: ClassVar[tuple[str, ...]] = ("lm_eval/*",)

    tasks: list[str] = field(default_factory=lambda: ["kvlab_lambada_wikitext"])  # lm-eval task / group names
    num_fewshot: int | None = None         # few-shot examples (None: each task's default)
    limit: float | None = None             # documents per task: a count (>= 1) or a fraction (< 1); None: all
    include_path: str | None = None        # another folder of task YAMLs (kvlab's offline tasks are always found)
    include_defaults: bool = False         # also index lm-eval's own tasks (hub data: a network or a local copy)
    batch_size: int = 64                   # requests per LLM.score / LLM.generate call
    apply_chat_template: bool = False      # format prompts with the tokenizer's chat template
    bootstrap_iters: int = 0               # lm-eval's bootstrap for the stderr of non-mean metrics (0: skipped)
    metadata: dict[str, Any] = field(default_factory=dict)  # extra task metadata (e.g. {tokenizer: ...})

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str):
            self.tasks = [self.tasks]
        if not self.tasks or not all(isinstance(t, str) and t for t in self.tasks):
            raise ValueError(f"LmEval.tasks must be a non-empty list of task names, got {self.tasks!r}")
        check_positive(self, "batch_size")
        if self.limit is not None:
            check_positive(self, "limit")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"LmEval.num_fewshot must be >= 0 or None, got {self.num_fewshot!r}")

    def run(self, llm, ctx: RunContext) -> Result:
        import lm_eval
        from lm_eval.tasks import TaskManager

        import kvlab.study.lm_eval

        paths = [str(kvlab.study.lm_eval.TASKS_DIR)] + ([self.include_path] if self.include_path else [])
        metadata = {"pretrained": llm.config.model, "data_dir": str(ctx.data_dir), **self.metadata}
        manager = TaskManager(include_path=paths, include_defaults=self.include_defaults, metadata=metadata)
        model = kvlab.study.lm_eval.KvlabLM(llm=llm, batch_size=self.batch_size)
        limit = int(self.limit) if self.limit is not None and self.limit >= 1 else self.limit
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model=model, tasks=list(self.tasks), num_fewshot=self.num_fewshot,
                                      limit=limit, task_manager=manager, log_samples=True,
                                      apply_chat_template=self.apply_chat_template,
                                      bootstrap_iters=self.bootstrap_iters, verbosity="WARNING")
        metrics = {"lm_eval/wall_s": time.perf_counter() - t0, **flat_metrics(out["results"])}
        return Result(metrics, {"lm_eval_results": results_table(out["results"]),
                                "lm_eval_samples": samples_table(out.get("samples") or {})})


def metric_name(task: str, key: str) -> str | None:
    """lm-eval's "acc,none" of `task` -> "lm_eval/<task>/acc" ("…/<metric>/<filter>" for a named filter);
    None for stderr entries and the alias."""
    metric, _, filt = key.partition(",")
    if not filt or metric.endswith("_stderr") or metric == "alias":
        return None
    return f"lm_eval/{task}/{metric}" + ("" if filt == "none" else f"/{filt}")


def flat_metrics(results: dict[str, dict]) -> dict[str, float]:
    out = {}
    for task, values in results.items():
        for key, value in values.items():
            name = metric_name(task, key)
            if name is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[name] = float(value)
    return out


def results_table(results: dict[str, dict]):
    """One row per (task, metric, filter): value and stderr."""
    import pandas as pd

    rows = []
    for task, values in results.items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if filt and not metric.endswith("_stderr"):
                stderr = values.get(f"{metric}_stderr,{filt}")
                rows.append({"task": task, "metric": metric, "filter": filt, "value": value,
                             "stderr": stderr if isinstance(stderr, (int, float)) else None})
    return pd.DataFrame(rows, columns=["task", "metric", "filter", "value", "stderr"])


def samples_table(samples: dict[str, list[dict]]):
    """One row per (task, document, filter): the target, the filtered response and the per-sample metrics."""
    import pandas as pd

    rows = []
    for task, docs in samples.items():
        for s in docs:
            row = {"task": task, "doc_id": s.get("doc_id"), "filter": s.get("filter"),
                   "target": str(s.get("target")), "response": str(s.get("filtered_resps"))[:500]}
            for metric in s.get("metrics", []):
                value = s.get(metric)
                row[metric] = value[0] if isinstance(value, (list, tuple)) and value else value
            rows.append(row)
    return pd.DataFrame(rows)

"""The same lm-eval tasks through the `kvlab` model and lm-eval's own `hf` backend, on the same weights.

    kv, hf = evaluate_both("smollm2-135m", ["kvlab_lambada_wikitext"], limit=8, max_model_len=1025)
    compare(kv, hf)   # per task: worst |delta log-likelihood|, is_greedy / accuracy / generation mismatches, ...

Both backends get the same tokenizer, `max_length` (kvlab: max_model_len - 1) and fp32 weights, loaded
twice (the engine installs its paged attention on its own copy). Used by tests/study/test_lm_eval_parity.py
and experiments/bench_lm_eval.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Evaluation:
    """One backend's lm-eval run: the results, the per-sample logs and the wall time of simple_evaluate."""

    backend: str
    results: dict[str, dict]
    samples: dict[str, list[dict]]
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def task_manager(metadata: dict, include_path: str | None = None):
    from lm_eval.tasks import TaskManager

    import kvlab.study.lm_eval

    paths = [str(kvlab.study.lm_eval.TASKS_DIR)] + ([include_path] if include_path else [])
    return TaskManager(include_path=paths, include_defaults=False, metadata=metadata)


Limit = int | dict[str, int] | None  # documents per task: one count for all, or a count per task


def run_tasks(model, backend: str, tasks: list[str], limit: Limit, metadata: dict,
              include_path: str | None = None) -> Evaluation:
    """simple_evaluate on `tasks`, the first `limit` documents of each (a dict: per task)."""
    import lm_eval

    manager = task_manager(metadata, include_path)
    docs = {"samples": {t: list(range(limit[t])) for t in tasks}} if isinstance(limit, dict) else {"limit": limit}
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=manager, log_samples=True,
                                  bootstrap_iters=0, verbosity="WARNING", **docs)
    return Evaluation(backend, out["results"], out["samples"], time.perf_counter() - t0)


def kvlab_model(name: str, max_model_len: int, batch_size: int = 64, **engine_args):
    from kvlab.study.lm_eval import KvlabLM

    return KvlabLM(pretrained=name, max_model_len=max_model_len, dtype="float32", batch_size=batch_size,
                   **engine_args)


def hf_model(name: str, max_length: int, batch_size: int = 1):
    """lm-eval's HFLM over the same weights, loaded by kvlab (packaged GGUF -> fp32), on the CPU."""
    from lm_eval.models.huggingface import HFLM

    from kvlab.models import load_model

    loaded = load_model(name)
    return HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, max_length=max_length,
                batch_size=batch_size, device="cpu")


def evaluate_both(name: str, tasks: list[str], limit: Limit, max_model_len: int = 1025,
                  kv_batch_size: int = 64, hf_batch_size: int = 1, **engine_args) -> tuple[Evaluation, Evaluation]:
    """kvlab then hf on the same tasks and limit (the engine built before either clock starts)."""
    kv_model = kvlab_model(name, max_model_len, kv_batch_size, **engine_args)
    hf = hf_model(name, kv_model.max_length, hf_batch_size)
    metadata = {"pretrained": name}
    kv = run_tasks(kv_model, "kvlab", tasks, limit, metadata)
    kv.extra["stats"] = kv_model.llm.stats()
    return kv, run_tasks(hf, "hf", tasks, limit, metadata)


# -- comparison ------------------------------------------------------------------------------------

def responses(ev: Evaluation, task: str) -> dict[tuple, list]:
    """{(doc_id, filter): the per-request raw responses} of a task (each request's first repeat)."""
    return {(s["doc_id"], s.get("filter")): [r[0] for r in s["resps"]] for s in ev.samples[task]}


def filtered(ev: Evaluation, task: str) -> dict[tuple, Any]:
    return {(s["doc_id"], s.get("filter")): s["filtered_resps"] for s in ev.samples[task]}


@dataclass
class TaskComparison:
    task: str
    samples: int
    max_abs_loglik_diff: float | None = None   # loglikelihood / rolling: worst per-request difference
    greedy_mismatches: int | None = None       # loglikelihood: is_greedy differs
    max_rel_ppl_diff: float | None = None      # rolling: worst relative difference of a perplexity metric
    generation_mismatches: int | None = None   # generate_until: filtered outputs that differ
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)  # metric: (kvlab, hf)


def compare(kv: Evaluation, hf: Evaluation) -> list[TaskComparison]:
    out = []
    for task in kv.samples:
        a, b = responses(kv, task), responses(hf, task)
        if a.keys() != b.keys():
            raise ValueError(f"{task}: the backends logged different samples")
        c = TaskComparison(task, len(a))
        first = next(iter(a.values()))[0]
        if isinstance(first, (list, tuple)):  # loglikelihood: (logprob, is_greedy) per request
            pairs = [(x, y) for k in a for x, y in zip(a[k], b[k])]
            c.max_abs_loglik_diff = max(abs(float(x[0]) - float(y[0])) for x, y in pairs)
            c.greedy_mismatches = sum(bool(x[1]) != bool(y[1]) for x, y in pairs)
        elif isinstance(first, (int, float)):  # rolling: one log-likelihood per document
            c.max_abs_loglik_diff = max(abs(float(a[k][0]) - float(b[k][0])) for k in a)
        else:  # generate_until
            fa, fb = filtered(kv, task), filtered(hf, task)
            c.generation_mismatches = sum(fa[k] != fb[k] for k in fa)
        for key, value in kv.results[task].items():
            if "," in key and "_stderr" not in key and isinstance(value, (int, float)):
                c.metrics[key] = (float(value), float(hf.results[task][key]))
        ppl = [abs(x - y) / abs(y) for k, (x, y) in c.metrics.items() if "perplexity" in k and y and math.isfinite(y)]
        if ppl:
            c.max_rel_ppl_diff = max(ppl)
        out.append(c)
    return out

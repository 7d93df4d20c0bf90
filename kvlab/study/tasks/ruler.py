"""RULER: synthetic long-context tasks (Hsieh et al. 2024, arXiv:2404.06654), at CPU-sized lengths.

Subtasks under RULER's own names and settings (its synthetic.yaml): needle in a haystack
(niah_single_1..3, niah_multikey_1..3, niah_multivalue, niah_multiquery), variable tracking
(vt: the variables a value reaches along a chain of assignments) and common-word
extraction (cwe: the 10 most frequent words of a numbered list). Samples come from RULER's
generators in the `nvidia-long-context-eval` package (see kvlab.study.tasks.ruler_data for how they
are run, fitted to short lengths and cached). A `length` counts the prompt and the
generated tokens, as RULER's max_seq_length does.

Each prompt is answered greedily and scored as RULER's evaluation does
(long_context_eval/eval): the prediction is stripped, control characters become newlines,
and scored by the metric RULER's eval/synthetic/constants.py names for the subtask's task:
`string_match_all` (the share of the expected outputs found in it, case-insensitively) for
niah, vt and cwe; `string_match_part` (any one found) only for qa, which is not offered here.
Metrics, in [0, 1]: `ruler/<subtask>@<length>`, `ruler/score@<length>` and `ruler/score`, the
mean over all (subtask, length) cells.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

from kvlab.study.tasks.base import Result, RunContext, Task, check_positive
from kvlab.study.tasks.data import ByteTokenizer, encode, get_tokenizer
from kvlab.study.tasks.perplexity import check_fits
from kvlab.study.tasks.progress import progress_bar

SUBTASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
            "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe")
DEFAULT_SUBTASKS = ("niah_single_1", "niah_multikey_1", "niah_multivalue", "vt", "cwe")


@dataclass
class Ruler(Task):
    METRICS: ClassVar[tuple[str, ...]] = ("ruler/score", "ruler/*@*")

    subtasks: list[str] = field(default_factory=lambda: list(DEFAULT_SUBTASKS))  # RULER's subtask names
    lengths: list[int] = field(default_factory=lambda: [1024, 2048])  # prompt + generated tokens
    num_samples: int = 4                    # samples per (subtask, length)
    max_new_tokens: int | None = None       # None: RULER's per subtask (niah 128, vt 30, cwe 120)
    model_template: str = "base"            # RULER's prompt wrapper (data/template.py): base, instruction, meta-chat, ...
    seed: int | None = None                 # generators' random seed; None: the run's seed
    cache_dir: str | None = None            # generated samples; None: $KVLAB_CACHE/ruler or ~/.cache/kvlab/ruler
    batch_size: int = 8                     # prompts per llm.generate call

    def __post_init__(self) -> None:
        check_positive(self, "lengths", "num_samples", "batch_size")
        if self.max_new_tokens is not None:
            check_positive(self, "max_new_tokens")
        bad = [s for s in self.subtasks if s not in SUBTASKS]
        if bad or not self.subtasks:
            raise ValueError(f"Ruler.subtasks: unknown {bad or 'empty list'}; choose from {list(SUBTASKS)}")

    def tokens_to_generate(self) -> dict[str, int]:
        from kvlab.study.tasks.ruler_data import subtask_config

        return {s: self.max_new_tokens or subtask_config(s)["tokens_to_generate"] for s in self.subtasks}

    def samples(self, tokenizer, seed: int) -> list[dict]:
        """Rows of subtask, task (RULER's family), length, index, input, outputs, prompt_token_ids, max_new_tokens (cached on disk)."""
        from kvlab.study.tasks.ruler_data import cached_samples, default_cache_dir

        if isinstance(tokenizer, ByteTokenizer):
            raise ValueError("ruler: RULER's generators need the model's tokenizer; random:<shape> models have none")
        from kvlab.study.tasks.ruler_data import subtask_config

        tokens = self.tokens_to_generate()
        family = {s: subtask_config(s)["task"] for s in self.subtasks}
        cache = Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()
        cells = cached_samples(self.subtasks, self.lengths, self.num_samples, tokens, seed, tokenizer, cache,
                               self.model_template)
        return [{"subtask": name, "task": family[name], "length": length, "index": row["index"], "input": row["input"],
                 "outputs": row["outputs"], "prompt_token_ids": encode(tokenizer, row["input"]),
                 "max_new_tokens": tokens[name]}
                for (name, length), rows in cells.items() for row in rows]

    def run(self, llm, ctx: RunContext) -> Result:
        import pandas as pd

        from kvlab import SamplingParams

        check_fits(llm, max(self.lengths), "ruler length")
        tokenizer = get_tokenizer(llm)
        rows = self.samples(tokenizer, ctx.seed if self.seed is None else self.seed)
        predictions: dict[int, str] = {}
        with progress_bar(ctx.progress, total=len(rows), desc="ruler") as bar:
            for new in sorted({r["max_new_tokens"] for r in rows}):
                todo = [i for i, r in enumerate(rows) if r["max_new_tokens"] == new]
                params = SamplingParams(max_tokens=new, temperature=0.0)
                for start in range(0, len(todo), self.batch_size):
                    batch = todo[start:start + self.batch_size]
                    outs = llm.generate([rows[i]["prompt_token_ids"] for i in batch], params)
                    for i, out in zip(batch, outs):
                        predictions[i] = tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
                    bar.update(len(batch))
        table = pd.DataFrame([{"subtask": r["subtask"], "length": r["length"], "index": r["index"],
                               "prompt_tokens": len(r["prompt_token_ids"]), "expected": " | ".join(r["outputs"]),
                               "output": predictions[i], "score": score(predictions[i], r["outputs"], r["task"])}
                              for i, r in enumerate(rows)])
        cells = table.groupby(["subtask", "length"], as_index=False, sort=False)["score"].mean()
        metrics = {f"ruler/{s}@{n}": float(v) for s, n, v in cells.itertuples(index=False)}
        for n, v in cells.groupby("length")["score"].mean().items():
            metrics[f"ruler/score@{n}"] = float(v)
        metrics["ruler/score"] = float(cells["score"].mean())
        return Result(metrics, {"ruler_cells": cells, "ruler_samples": table})


def postprocess(prediction: str | None) -> str:
    """RULER's postprocess_pred (eval/evaluate.py): stripped, control characters as newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", (prediction or "").strip()).strip()


def score(prediction: str, outputs: list[str], task: str = "niah") -> float:
    """One sample's score in [0, 1] by RULER's metric for `task` (niah, variable_tracking, ...: string_match_all)."""
    from long_context_eval.eval.synthetic.constants import TASKS

    return TASKS[task]["metric_fn_per_sample"]([postprocess(prediction)], [outputs])[0] / 100

"""Perplexity with the cache policy active (WikiText-2 test by default).

Each window of `context_length + continuation_length` tokens is split: the
context is prefilled (and compressed by the policy, as in serving), then the
continuation is scored teacher-forced through `llm.score`; perplexity is
exp(mean negative log-likelihood of the continuation tokens). With the `full`
policy this is ordinary sliding-window perplexity with a fixed context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from kvlab.study.tasks.base import Result, RunContext, Task, check_positive
from kvlab.study.tasks.data import corpus_tokens, evenly_spaced_windows, get_tokenizer
from kvlab.study.tasks.progress import progress_bar


@dataclass
class Perplexity(Task):
    METRICS: ClassVar[tuple[str, ...]] = ("perplexity/ppl", "perplexity/ppl@*", "perplexity/nll@*")

    source: str = "wikitext-2-raw/wiki.test.raw"                     # text file, folder or hub:<name>
    context_lengths: list[int] = field(default_factory=lambda: [256])  # tokens prefilled before scoring
    continuation_length: int = 64                                     # tokens scored per window
    num_windows: int = 8                                              # windows per context length
    batch_size: int = 8                                               # windows per llm.score call

    def __post_init__(self) -> None:
        check_positive(self, "context_lengths", "continuation_length", "num_windows", "batch_size")

    def run(self, llm, ctx: RunContext) -> Result:
        import datasets
        import pandas as pd

        tokens = corpus_tokens(self.source, ctx.data_dir, get_tokenizer(llm))
        rows = []
        for length in self.context_lengths:
            check_fits(llm, length + self.continuation_length, f"context_length {length} + continuation")
            windows = evenly_spaced_windows(tokens, length + self.continuation_length, self.num_windows)
            ds = datasets.Dataset.from_dict({"context": [w[:length] for w in windows],
                                             "continuation": [w[length:] for w in windows]})
            nll, count = 0.0, 0
            with progress_bar(ctx.progress, total=len(ds), desc=f"perplexity@{length}") as bar:
                for batch in ds.iter(batch_size=self.batch_size):
                    for out in llm.score(batch["context"], batch["continuation"]):
                        nll -= sum(out.logprobs)
                        count += len(out.logprobs)
                    bar.update(len(batch["context"]))
            rows.append({"context_length": length, "windows": len(ds), "tokens": count,
                         "nll": nll / count, "perplexity": math.exp(nll / count)})
        table = pd.DataFrame(rows)
        metrics = {}
        for row in rows:
            metrics[f"perplexity/ppl@{row['context_length']}"] = row["perplexity"]
            metrics[f"perplexity/nll@{row['context_length']}"] = row["nll"]
        metrics["perplexity/ppl"] = math.exp(sum(r["nll"] * r["tokens"] for r in rows) / sum(r["tokens"] for r in rows))
        return Result(metrics, {"perplexity": table}, figures=plot_by_length(table) if len(rows) > 1 else {})


def check_fits(llm, num_tokens: int, what: str) -> None:
    """Raise ValueError if `num_tokens` exceed the model's positions."""
    limit = getattr(llm.model_config, "max_position_embeddings", None)
    if limit is not None and num_tokens > limit:
        raise ValueError(f"{what} = {num_tokens} tokens exceeds the model's {limit} positions")


def plot_by_length(table) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot(table["context_length"], table["perplexity"], marker="o")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    fig.tight_layout()
    return {"perplexity_vs_context": fig}

"""Replay of the Azure LLM inference trace 2023 (Patel et al., "Splitwise", ISCA 2024).

The trace gives, per request, an arrival time and the prompt and output lengths
(`TIMESTAMP,ContextTokens,GeneratedTokens`) but no text. `load_azure_trace`
scales the lengths to the model (`scale`, then clipped to `max_context` and
`max_output`) and cuts each prompt from a real text (WikiText-2 by default) at a
seeded offset, so attention sees language, not noise.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, Literal

from kvlab.study.tasks.base import Result, RunContext, Task, check_positive
from kvlab.study.tasks.data import corpus_tokens, data_path, get_tokenizer
from kvlab.study.workloads.replay import Request, replay, replay_metrics

TRACES = {"conv": "azure-llm-trace-2023/AzureLLMInferenceTrace_conv.csv",
          "code": "azure-llm-trace-2023/AzureLLMInferenceTrace_code.csv"}
DEFAULT_CORPUS = "wikitext-2-raw/wiki.test.raw"


def read_trace(kind_or_path: str, data_dir: str | Path | None = None) -> list[tuple[float, int, int]]:
    """(arrival seconds after the first request, context tokens, generated tokens) per row."""
    path = data_path(TRACES.get(kind_or_path, kind_or_path), data_dir)
    rows = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            ts = datetime.fromisoformat(row["TIMESTAMP"][:26])  # microseconds: 7-digit fractions are cut
            rows.append((ts.timestamp(), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    t0 = rows[0][0] if rows else 0.0
    return [(t - t0, c, g) for t, c, g in rows]


def load_azure_trace(kind_or_path: str, num_requests: int, tokenizer: Any, max_context: int = 1024,
                     max_output: int = 256, scale: float = 1.0, corpus_path: str | None = None, seed: int = 0,
                     start: int = 0, data_dir: str | Path | None = None) -> list[Request]:
    """`num_requests` trace rows from row `start`, as Requests with real token ids.

    kind_or_path: "conv", "code" or a CSV path; tokenizer: anything with `encode(text)`;
    lengths are multiplied by `scale`, then clipped to [1, max_context] / [1, max_output];
    arrival_s is relative to the first returned request.
    """
    rows = read_trace(kind_or_path, data_dir)[start:start + num_requests]
    if len(rows) < num_requests:
        raise ValueError(f"trace {kind_or_path!r} has only {len(rows)} rows from row {start}, asked for {num_requests}")
    corpus = corpus_tokens(corpus_path or DEFAULT_CORPUS, data_dir, tokenizer)
    rng = random.Random(seed)
    t0 = rows[0][0] if rows else 0.0
    requests = []
    for i, (t, context, generated) in enumerate(rows):
        n = min(max(1, round(context * scale)), max_context, len(corpus))
        offset = rng.randrange(0, len(corpus) - n + 1)
        requests.append(Request(prompt_token_ids=corpus[offset:offset + n],
                                max_tokens=min(max(1, round(generated * scale)), max_output),
                                arrival_s=t - t0, tag=f"{kind_or_path}#{start + i}"))
    return requests


@dataclass
class AzureReplay(Task):
    METRICS: ClassVar[tuple[str, ...]] = replay_metrics()

    trace: str = "conv"                       # conv | code | CSV path
    num_requests: int = 16                    # requests from row `start`
    start: int = 0                            # first trace row
    scale: float = 0.25                       # length scale
    max_context: int = 512                    # prompt length cap (after scaling)
    max_output: int = 64                      # output length cap (after scaling)
    arrival: Literal["asap", "real"] = "asap" # all at t=0, or the trace's arrival times
    speedup: float = 1.0                      # real arrivals: inter-arrival times / speedup
    corpus: str = DEFAULT_CORPUS              # prompt text
    seed: int = 0                             # prompt offsets in the corpus

    def __post_init__(self) -> None:
        check_positive(self, "num_requests", "scale", "max_context", "max_output", "speedup")
        if self.arrival not in ("asap", "real"):
            raise ValueError(f"AzureReplay.arrival must be 'asap' or 'real', got {self.arrival!r}")

    def run(self, llm, ctx: RunContext) -> Result:
        limit = getattr(llm.model_config, "max_position_embeddings", None) or self.max_context + self.max_output
        requests = load_azure_trace(self.trace, self.num_requests, get_tokenizer(llm),
                                    max_context=min(self.max_context, limit - self.max_output),
                                    max_output=self.max_output, scale=self.scale, corpus_path=self.corpus,
                                    seed=self.seed, start=self.start, data_dir=ctx.data_dir)
        return replay(llm, requests, self.arrival, self.speedup, progress=ctx.progress)

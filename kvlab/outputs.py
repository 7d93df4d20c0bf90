"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens
    text: str | None  # detokenised generation (None without a tokenizer)
    finish_reason: str  # "stop" (EOS / stop token), "length" (max_tokens / context)
    ttft_s: float | None  # arrival -> first generated token
    tpot_s: float | None  # mean time per output token after the first
    num_preemptions: int = 0
    group_id: int | None = None  # parallel sampling (n > 1): the request id of the prompt's first sample
    sample_index: int = 0  # which of the prompt's n samples this is


@dataclass
class ScoreOutput:
    request_id: int
    logprobs: list[float]  # log p(continuation[i] | context, continuation[:i])
    dists: torch.Tensor | None = None  # with return_dists: [len(continuation), vocab] log-probs
    num_preemptions: int = 0

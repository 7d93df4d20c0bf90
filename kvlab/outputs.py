"""What the engine hands back for each request, in vLLM's shape.

    out = llm.generate([prompt], SamplingParams(n=2))[0]   # one RequestOutput per prompt
    out.outputs[1].text, out.outputs[1].finish_reason      # one CompletionOutput per sample
    out.text, out.token_ids                                # outputs[0]'s (n = 1 code reads these)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's CompletionOutput, plus its own latency and preemptions)."""

    index: int  # which of the prompt's n samples this is
    text: str | None  # detokenised generation (None without a tokenizer); cut at a matched stop string
    token_ids: list[int]  # generated tokens (with a stop string: up to the token that completed it)
    finish_reason: str  # "stop" (EOS, a stop token or a stop string), "length" (max_tokens / context)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS, length)
    tpot_s: float | None = None  # mean time per output token after the first
    num_preemptions: int = 0  # times this sample was preempted (its KV recomputed)


@dataclass
class RequestOutput:
    """One prompt's result: its n completions in `outputs` (by index).

    `engine.step()` hands back one RequestOutput per finished sample (`outputs` holds that sample,
    `request_id` is its own id and `group_id` the prompt's); `LLM.generate` returns one per prompt
    with all its samples. `text`, `token_ids`, `finish_reason`, `stop_reason`, `tpot_s` and
    `sample_index` read `outputs[0]`; `num_preemptions` counts every sample's.
    """

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    ttft_s: float | None = None  # arrival -> first generated token (shared by the samples: they fork at it)
    group_id: int | None = None  # parallel sampling (n > 1): the request id of the prompt (its first sample)

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def tpot_s(self) -> float | None:
        return self.outputs[0].tpot_s

    @property
    def sample_index(self) -> int:
        return self.outputs[0].index

    @property
    def num_preemptions(self) -> int:
        return sum(o.num_preemptions for o in self.outputs)


def merge_samples(request_id: int, samples: list[RequestOutput]) -> RequestOutput:
    """The per-sample outputs of one prompt (engine level) as one RequestOutput, completions by index."""
    completions = sorted((c for s in samples for c in s.outputs), key=lambda c: c.index)
    ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
    return RequestOutput(request_id, samples[0].prompt_token_ids, completions, min(ttfts) if ttfts else None,
                         request_id)


@dataclass
class ScoreOutput:
    request_id: int
    logprobs: list[float]  # log p(continuation[i] | context, continuation[:i])
    dists: torch.Tensor | None = None  # with return_dists: [len(continuation), vocab] log-probs
    num_preemptions: int = 0

"""How a request samples and when it stops (vLLM's SamplingParams)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    """Sampling and stopping for one request.

    temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters; a seed
    makes a sampled request reproducible whatever else is in the batch.
    """

    max_tokens: int = 16  # new tokens at most
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens (0 = all)
    top_p: float = 1.0  # keep the smallest set with probability >= top_p
    seed: int | None = None  # per-request generator seed
    stop_token_ids: tuple[int, ...] = ()  # finish when one of these is generated
    ignore_eos: bool = False  # keep going past the model's EOS token

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

"""How a request samples and when it stops (vLLM's SamplingParams)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

MAX_SEED = 2**63  # seeds are integers in [0, 2**63): torch generators take 64-bit seeds


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Sampling and stopping for one request.

    temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters; a seed
    makes a sampled request reproducible whatever else is in the batch. Every
    field is checked here, so a bad value fails when the params are built,
    never inside an engine step.
    """

    max_tokens: int = 16  # new tokens at most
    temperature: float = 0.0  # 0 = greedy; any finite positive value samples
    top_k: int = 0  # keep the k most likely tokens (0 = all)
    top_p: float = 1.0  # keep the smallest set with probability >= top_p
    seed: int | None = None  # per-request generator seed, an integer in [0, 2**63)
    stop_token_ids: tuple[int, ...] = ()  # finish when one of these is generated
    ignore_eos: bool = False  # keep going past the model's EOS token
    n: int = 1  # samples of the prompt (parallel sampling: n sequences sharing the prompt's pages)
    cache_salt: str | bytes | None = None  # prefix caching: only requests with the same salt share pages

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number (0 = greedy), got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer (0 disables it), got {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1 (samples per prompt), got {self.n!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, (str, bytes)):
            raise TypeError(f"cache_salt must be None, a str or bytes, got {type(self.cache_salt).__name__}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        ids = tuple(self.stop_token_ids)
        bad = [t for t in ids if not _is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be integers >= 0, got {bad[0]!r}")
        self.max_tokens, self.top_k, self.n = int(self.max_tokens), int(self.top_k), int(self.n)
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.seed = None if self.seed is None else int(self.seed)
        self.stop_token_ids = tuple(int(t) for t in ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_sample(self, index: int) -> "SamplingParams":
        """The params of sample `index` of an n > 1 request: n = 1 and, under a seed s, the seed
        (s + index) mod 2**63. So `SamplingParams(n=k, seed=s)` samples exactly as k separate
        requests with seeds s, s + 1, ..., s + k - 1 (without a seed each sample gets its own
        engine-assigned stream)."""
        if not 0 <= index < self.n:
            raise ValueError(f"sample index {index} out of range for n={self.n}")
        return replace(self, n=1, seed=None if self.seed is None else (self.seed + index) % MAX_SEED)

"""How a request samples and when it stops (vLLM's SamplingParams)."""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, replace

MAX_SEED = 2**63  # seeds are integers in [0, 2**63): torch generators take 64-bit seeds


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping for one request.

    temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters; a seed
    makes a sampled request reproducible whatever else is in the batch. Every
    field is checked here, so a bad value fails when the params are built,
    never inside an engine step; the params are frozen (`dataclasses.replace(p,
    max_tokens=8)` makes a changed copy, checked again).

    Stop strings (vLLM's `stop`) are matched on the detokenised output, across
    token boundaries: the text is cut before the stop string (or after it with
    include_stop_str_in_output), the tokens keep the one that completed it, and
    the output's finish_reason is "stop" with stop_reason the string. They need
    a model with a tokenizer.
    """

    max_tokens: int = 16  # new tokens at most
    temperature: float = 0.0  # 0 = greedy; any finite positive value samples
    top_k: int = 0  # keep the k most likely tokens (0 = all)
    top_p: float = 1.0  # keep the smallest set with probability >= top_p
    seed: int | None = None  # per-request generator seed, an integer in [0, 2**63)
    stop_token_ids: tuple[int, ...] = ()  # finish when one of these is generated (stop_reason: the id)
    ignore_eos: bool = False  # keep going past the model's EOS token
    n: int = 1  # samples of the prompt (parallel sampling: n sequences sharing the prompt's pages)
    cache_salt: str | bytes | None = None  # prefix caching: only requests with the same salt share pages
    stop: tuple[str, ...] = ()  # finish when the output text contains one of these (a str or a list of them)
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_stops()
        if self.cache_salt is not None and not isinstance(self.cache_salt, (str, bytes)):
            raise TypeError(f"cache_salt must be None, a str or bytes, got {type(self.cache_salt).__name__}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self._set(max_tokens=int(self.max_tokens), top_k=int(self.top_k), n=int(self.n),
                  temperature=float(self.temperature), top_p=float(self.top_p),
                  seed=None if self.seed is None else int(self.seed))

    def _check_numbers(self) -> None:
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

    def _check_stops(self) -> None:
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        ids = tuple(self.stop_token_ids)
        bad = [t for t in ids if not _is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be integers >= 0, got {bad[0]!r}")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if isinstance(stop, bytes) or not hasattr(stop, "__iter__"):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        stop = tuple(stop)
        bad = [s for s in stop if not isinstance(s, str) or not s]
        if bad:
            raise ValueError(f"stop strings must be non-empty strings, got {bad[0]!r}")
        self._set(stop_token_ids=tuple(int(t) for t in ids), stop=stop)

    def _set(self, **values) -> None:
        """Store normalised values in the frozen instance (construction only)."""
        for name, value in values.items():
            object.__setattr__(self, name, value)

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


def as_sampling_params(value) -> SamplingParams:
    """`value` if it is SamplingParams, else a TypeError that says what it is instead."""
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, Mapping):
        raise TypeError(f"sampling params must be SamplingParams, got a {type(value).__name__} "
                        f"{reprlib.repr(dict(value))}: build them with SamplingParams(**params)")
    raise TypeError(f"sampling params must be SamplingParams, got {type(value).__name__}")

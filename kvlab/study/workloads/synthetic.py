"""Synthetic serving workloads: shared prefixes, multi-turn conversations.

Token ids are cut from a real text (WikiText-2 by default) at seeded offsets.
  SharedPrefix: each request = one of `num_prefixes` shared prefixes + a unique suffix
                (system prompts, few-shot examples): what prefix caching saves.
  MultiTurn:    each turn's prompt = the conversation so far (earlier prompts and answers)
                + a new user message; a turn arrives when the previous answer is done.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from kvlab.study.tasks.base import Result, RunContext, Task, check_positive
from kvlab.study.tasks.data import corpus_tokens, get_tokenizer
from kvlab.study.workloads.azure import DEFAULT_CORPUS
from kvlab.study.workloads.replay import Request, replay, replay_metrics


def _cutter(llm, corpus: str, data_dir, seed: int):
    tokens = corpus_tokens(corpus, data_dir, get_tokenizer(llm))
    rng = random.Random(seed)

    def cut(n: int) -> list[int]:
        offset = rng.randrange(0, len(tokens) - n + 1)
        return tokens[offset:offset + n]

    return cut, rng


@dataclass
class SharedPrefix(Task):
    METRICS: ClassVar[tuple[str, ...]] = replay_metrics()

    num_prefixes: int = 2          # distinct shared prefixes
    prefix_length: int = 192       # tokens per prefix
    suffix_length: int = 32        # unique tokens per request
    num_requests: int = 16         # requests (round-robin over prefixes)
    max_tokens: int = 32           # output tokens per request
    arrival_rate: float = 0.0      # Poisson requests/s; 0: all at t=0
    corpus: str = DEFAULT_CORPUS   # text
    seed: int = 0                  # offsets and arrivals

    def __post_init__(self) -> None:
        check_positive(self, "num_prefixes", "prefix_length", "suffix_length", "num_requests", "max_tokens")
        if self.arrival_rate < 0:
            raise ValueError(f"SharedPrefix.arrival_rate must be >= 0, got {self.arrival_rate}")

    def requests(self, llm, ctx: RunContext) -> list[Request]:
        cut, rng = _cutter(llm, self.corpus, ctx.data_dir, self.seed)
        prefixes = [cut(self.prefix_length) for _ in range(self.num_prefixes)]
        t, out = 0.0, []
        for i in range(self.num_requests):
            if self.arrival_rate > 0 and i:
                t += rng.expovariate(self.arrival_rate)
            out.append(Request(prefixes[i % self.num_prefixes] + cut(self.suffix_length), self.max_tokens, t,
                               tag=f"prefix{i % self.num_prefixes}/req{i}"))
        return out

    def run(self, llm, ctx: RunContext) -> Result:
        return replay(llm, self.requests(llm, ctx), "real", progress=ctx.progress)


@dataclass
class MultiTurn(Task):
    METRICS: ClassVar[tuple[str, ...]] = replay_metrics()

    num_conversations: int = 4     # conversations side by side
    turns: int = 3                 # turns per conversation
    user_length: int = 48          # tokens per user message
    max_tokens: int = 32           # output tokens per turn
    think_time_s: float = 0.0      # pause before the next user message
    corpus: str = DEFAULT_CORPUS   # text
    seed: int = 0                  # offsets

    def __post_init__(self) -> None:
        check_positive(self, "num_conversations", "turns", "user_length", "max_tokens")
        if self.think_time_s < 0:
            raise ValueError(f"MultiTurn.think_time_s must be >= 0, got {self.think_time_s}")

    def run(self, llm, ctx: RunContext) -> Result:
        cut, _ = _cutter(llm, self.corpus, ctx.data_dir, self.seed)
        first = [Request(cut(self.user_length), self.max_tokens, 0.0, tag=f"conv{c}/turn0")
                 for c in range(self.num_conversations)]

        def next_turn(req: Request, out, now: float) -> list[Request]:
            conv, turn = req.tag.split("/turn")
            if int(turn) + 1 >= self.turns:
                return []
            history = req.prompt_token_ids + list(out.token_ids)
            return [Request(history + cut(self.user_length), self.max_tokens, now + self.think_time_s,
                            tag=f"{conv}/turn{int(turn) + 1}")]

        return replay(llm, first, "real", follow_up=next_turn, progress=ctx.progress)

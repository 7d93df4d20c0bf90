"""Multi-turn conversations over real text, as replay requests (kvlab.study.workloads.replay).

`conversations` conversations of `turns` turns each. Turn 0's prompt is an optional shared-context document of
`context_len` tokens (SCBench-style shared-context multi-turn: a long document, then short questions about it)
followed by a `user_len`-token user message; turn t's prompt is the conversation so far (earlier prompts and the
run's own answers) plus a new `user_len`-token message. Messages and documents are cuts of a token corpus (e.g.
WikiText-2), drawn from `seed`, so every variant of a benchmark sees the same text. Each turn asks for
`max_tokens` greedy tokens (the replay ignores EOS).

    schedule="concurrent"   every conversation's first turn arrives at once; a turn arrives when the previous
                            turn of its conversation is answered (conversations side by side)
    schedule="round_robin"  one turn at a time: conversation 0's turn 0, conversation 1's turn 0, ..., then every
                            conversation's turn 1, ... (a user returns after the others had their turn: with a
                            pool holding a fraction of the histories, a returning history has been evicted)

    work = Conversations(tokens, conversations=4, turns=3, user_len=64, max_tokens=8)
    result = replay(llm, work.first(), "real", follow_up=work.follow_up)
    work.returning_ttfts(result.tables["workload_requests"])   # TTFT of turns >= 1
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from kvlab.study.workloads.replay import Request


def tag(conv: int, turn: int) -> str:
    return f"conv{conv}/turn{turn}"


def parse_tag(text: str) -> tuple[int, int]:
    conv, turn = text.removeprefix("conv").split("/turn")
    return int(conv), int(turn)


@dataclass
class Conversations:
    tokens: list[int]  # the corpus messages and documents are cut from
    conversations: int
    turns: int
    user_len: int
    max_tokens: int
    context_len: int = 0  # tokens of turn 0's shared-context document (0: none)
    schedule: Literal["concurrent", "round_robin"] = "concurrent"
    seed: int = 0
    answers: dict = field(default_factory=dict, init=False)  # tag -> greedy answer token ids
    prompts: dict = field(default_factory=dict, init=False)  # tag -> prompt token ids
    history: dict = field(default_factory=dict, init=False)  # conversation -> its tokens so far

    def __post_init__(self) -> None:
        if self.schedule not in ("concurrent", "round_robin"):
            raise ValueError(f"schedule must be 'concurrent' or 'round_robin', got {self.schedule!r}")
        need = max(self.user_len, self.context_len)
        if need > len(self.tokens):
            raise ValueError(f"the corpus has {len(self.tokens)} tokens, fewer than a cut of {need}")
        rng = random.Random(self.seed)
        self.messages = {(c, t): self._cut(rng, self.user_len) for c in range(self.conversations)
                         for t in range(self.turns)}
        self.documents = {c: self._cut(rng, self.context_len) if self.context_len else []
                          for c in range(self.conversations)}

    def _cut(self, rng: random.Random, n: int) -> list[int]:
        offset = rng.randrange(0, len(self.tokens) - n + 1)
        return self.tokens[offset:offset + n]

    def request(self, conv: int, turn: int, now: float) -> Request:
        """Conversation `conv`'s turn `turn`: its history so far and the turn's message."""
        before = self.history.get(conv, self.documents[conv])
        prompt = list(before) + self.messages[conv, turn]
        self.prompts[tag(conv, turn)] = prompt
        return Request(prompt, self.max_tokens, now, tag=tag(conv, turn))

    def first(self) -> list[Request]:
        """The requests that start the replay."""
        if self.schedule == "concurrent":
            return [self.request(c, 0, 0.0) for c in range(self.conversations)]
        return [self.request(0, 0, 0.0)]

    def follow_up(self, req: Request, out, now: float) -> list[Request]:
        """`replay`'s callback: keep the answer, then the next turn (of this conversation, or the next in turn)."""
        self.answers[req.tag] = list(out.token_ids)
        conv, turn = parse_tag(req.tag)
        self.history[conv] = list(req.prompt_token_ids) + list(out.token_ids)
        if self.schedule == "concurrent":
            return [self.request(conv, turn + 1, now)] if turn + 1 < self.turns else []
        conv, turn = (conv + 1, turn) if conv + 1 < self.conversations else (0, turn + 1)
        return [self.request(conv, turn, now)] if turn < self.turns else []

    @staticmethod
    def returning_ttfts(table) -> list[float]:
        """TTFT (s) of every returning turn (turn >= 1) in a replay's request table."""
        return [r.ttft_s for r in table.itertuples() if parse_tag(r.tag)[1] >= 1 and r.ttft_s == r.ttft_s]

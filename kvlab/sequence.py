"""A request's tokens and progress through the engine. Torch-free."""

from __future__ import annotations

from enum import Enum, auto

from kvlab.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Prompt plus generated tokens; `num_computed_tokens` of them have KV in the cache.

    A scoring request (`score_from` set) carries its continuation in `token_ids`
    from the start: the engine prefills up to `score_from`, then computes the rest
    teacher-forced and records the log-probability of every continuation token.
    """

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, max_len: int,
                 arrival_time: float, score_from: int | None = None):
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids) if score_from is None else score_from
        self.params = params
        self.max_len = max_len  # prompt + max new tokens, capped by the model's context
        self.score_from = score_from
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.logprobs: list[float] = []  # scoring: log p of each continuation token
        self.dists: list = []  # scoring with return_dists: one log-prob vector per continuation token
        # speculative decoding: tokens drafted after the last one, computed this step in tentative
        # slots; never part of token_ids until verified (kvlab/speculation/speculator.py)
        self.draft_token_ids: list[int] = []
        self.draft_parents: list[int] = []  # a token tree: parent index of each draft (-1: the last token); [] a chain
        self.stop_strings = None  # stop strings: the matcher on the detokenised output (kvlab/stop_strings.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV the request needs: all of them, except a scoring request's last token
        (its log-probability comes from the token before; nothing reads its own KV)."""
        return len(self.token_ids) - 1 if self.score_from is not None else len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens_to_compute - self.num_computed_tokens

    @property
    def num_scored_tokens(self) -> int:
        """Continuation tokens whose log-probability is recorded (kept across preemptions)."""
        return len(self.logprobs)

    @property
    def is_fully_scored(self) -> bool:
        return self.score_from is not None and len(self.logprobs) == len(self.token_ids) - self.score_from

    @property
    def ttft(self) -> float | None:
        """Arrival -> first generated token (seconds), once there is one."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (seconds), once finished with two or more."""
        n = self.num_output_tokens
        if self.finish_time is None or self.first_token_time is None or n < 2 or self.is_scoring:
            return None
        return (self.finish_time - self.first_token_time) / (n - 1)

    @property
    def is_scoring(self) -> bool:
        return self.score_from is not None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def chunk_limit(self) -> int:
        """Tokens that may be computed in one step: a scoring request stops its chunk at `score_from`
        so that the cache policy sees the whole context before the continuation is scored."""
        if self.score_from is not None and self.num_computed_tokens < self.score_from:
            return self.score_from - self.num_computed_tokens
        return self.num_uncomputed_tokens + len(self.draft_token_ids)

    def tree_slots(self, num_new_tokens: int) -> int:
        """Of `num_new_tokens` computed this step, the tentative slots of a token tree (0 for a chain draft):
        a residual window counts only the committed tokens before them, so they stay in full-precision rows
        until verification moves the accepted path into place (kvlab.cache.paged_kv.PagedKV.move_path)."""
        return max(num_new_tokens - self.num_uncomputed_tokens, 0) if self.draft_parents else 0

    def keep_draft_tokens(self, num_new_tokens: int) -> None:
        """The step computes `num_new_tokens`: keep only the draft tokens that fit after the uncomputed ones."""
        del self.draft_token_ids[max(num_new_tokens - self.num_uncomputed_tokens, 0):]
        del self.draft_parents[len(self.draft_token_ids):]  # a preorder prefix of a tree is a tree

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"{self.status.name})")

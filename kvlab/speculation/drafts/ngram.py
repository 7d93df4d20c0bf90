"""Prompt-lookup drafting: no model, the continuation of an earlier match of the last n tokens.

Based on prompt lookup decoding (Saxena 2023) as used for n-gram speculation in vLLM and Hugging
Face `prompt_lookup_num_tokens`: for n from `max_ngram` down to `min_ngram`, find the most recent
earlier occurrence of the sequence's last n tokens and propose the tokens that followed it. Strong
on repetition-heavy tasks (editing, summarising, code), free to run; drafts are point masses.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.speculation.drafts.base import DraftModel, Proposal
from kvlab.registry import DRAFTS


def lookup(tokens: list[int], length: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to `length` tokens that followed the most recent earlier occurrence of the longest suffix
    of `tokens` of n in [min_ngram, max_ngram] tokens that occurred before; [] if none did."""
    total = len(tokens)
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        suffix = tokens[total - n:]
        for start in range(total - n - 1, -1, -1):  # most recent first, never the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + length]
    return []


@DRAFTS.register("ngram")
@dataclass
class NgramDraft(DraftModel):
    """Prompt lookup: the tokens that followed the last match of the sequence's final n-gram."""

    min_ngram: int = 1  # shortest suffix looked up
    max_ngram: int = 3  # longest suffix looked up (tried first)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.min_ngram, int) or self.min_ngram < 1:
            raise ValueError(f"draft ngram: min_ngram must be an integer >= 1, got {self.min_ngram!r}")
        if not isinstance(self.max_ngram, int) or self.max_ngram < self.min_ngram:
            raise ValueError(f"draft ngram: max_ngram must be an integer >= min_ngram ({self.min_ngram}), "
                             f"got {self.max_ngram!r}")

    def propose(self, seqs, lengths, generators) -> list[Proposal]:
        return [Proposal(lookup(s.token_ids, n, self.min_ngram, self.max_ngram)) for s, n in zip(seqs, lengths)]

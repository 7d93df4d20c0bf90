"""The draft-model interface for speculative decoding (Leviathan et al. 2023, arXiv:2211.17192).

A draft proposes up to `num_tokens` next tokens for each running sequence (a
chain today; token trees as in SpecInfer, arXiv:2305.09781, are not supported); the
target verifies them in one forward pass. No draft ships yet: the engine
rejects `draft=` until verification lands.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvlab.registry import DRAFTS


@dataclass
class DraftModel(ABC):
    """Base class of draft plugins; subclasses are dataclasses of their parameters."""

    @abstractmethod
    def propose(self, token_ids: list[list[int]], num_tokens: int) -> list[list[int]]:
        """For each sequence's tokens so far, up to `num_tokens` proposed continuations."""


DRAFTS.base = DraftModel

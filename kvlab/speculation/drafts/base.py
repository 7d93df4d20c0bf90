"""The draft-model interface for speculative decoding (Leviathan et al. 2023, arXiv:2211.17192).

Each engine step a draft proposes a chain of up to `num_tokens` next tokens for every running
decoding sequence (`propose`); the target verifies them in one forward pass (kvlab/speculation/speculator.py,
kvlab/speculation/verifier.py). A draft that knows the distribution it drew each token from returns it
(`Proposal.probs`, needed for lossless rejection sampling with a sampled draft); one that does not
(n-gram lookup) is treated as a point mass on its token. A tree draft (SpecInfer, arXiv:2305.09781;
kvlab/speculation/drafts/tree.py) also returns each token's parent (`Proposal.parents`).

Every chain draft has the same length options (kvlab/speculation/draft_length.py): `num_tokens` (the
starting and, without `adaptive`, the fixed draft length), `adaptive` (per sequence, from its
acceptance history, between 1 and `max_num_tokens`) by `length_rule` (`step`: +1 after a fully
accepted chain, -1 after a rejection; `heuristic`: +2 / -1, Hugging Face's schedule), and, for a
draft with a model, `confidence_threshold` (stop a chain after a token whose distribution's top
probability is below it; None: never).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvlab.registry import DRAFTS
from kvlab.speculation.draft_length import check_threshold, length_rule

if TYPE_CHECKING:
    import torch

    from kvlab.sequence import Sequence


@dataclass
class Proposal:
    tokens: list[int]  # drafted continuation, at most the length asked for
    probs: "torch.Tensor | None" = None  # [len(tokens), V] distribution each token was drawn from; None: point masses
    parents: list[int] | None = None  # token tree (preorder): parent index of each token, -1 the last committed one


@dataclass
class DraftModel(ABC):
    """Base class of draft plugins; subclasses are dataclasses of their parameters."""

    # capabilities (kvlab/engine/capabilities.py): the accepted tokens' KV is moved into place slot by slot
    # (a token tree's accepted path), which packed pages do not support
    moves_kv_slots: ClassVar[bool] = False
    # the draft draws its tokens from a distribution, so it can stop a chain when its confidence falls
    stops_on_confidence: ClassVar[bool] = False

    num_tokens: int = 4  # tokens drafted per step (the starting length when adaptive)
    adaptive: bool = False  # grow by one on a fully accepted chain, shrink by one on a rejection
    max_num_tokens: int = 8  # longest chain when adaptive
    length_rule: str = "step"  # how adaptive lengths move: step (+1 / -1) or heuristic (+2 / -1; Hugging Face's)
    confidence_threshold: float | None = None  # drafts with a model: stop after a token whose top probability is below

    def __post_init__(self) -> None:
        name = getattr(type(self), "registry_name", type(self).__name__)
        for key in ("num_tokens", "max_num_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"draft {name}: {key} must be an integer >= 1, got {value!r}")
        self.rule = length_rule(self.length_rule, name)
        check_threshold(name, self.confidence_threshold)
        if self.confidence_threshold is not None and not self.stops_on_confidence:
            raise ValueError(f"draft {name}: confidence_threshold needs a draft that draws from a model's distribution "
                             f"(model, layerskip, slem, tli, self_compressed); {name} has none")
        if self.adaptive and self.max_num_tokens < self.num_tokens:
            raise ValueError(f"draft {name}: max_num_tokens ({self.max_num_tokens}) must be >= num_tokens "
                             f"({self.num_tokens}) when adaptive")

    def setup(self, engine) -> None:
        """Check the draft against the target engine (vocabulary, device) and build what it needs;
        raise a clear error before any request runs."""

    def scratch_pages(self, block_size: int, packed: bool = False) -> int:
        """Pages per layer group the draft writes in the target's pool tensors beside the block manager's pages
        (`KVCache.scratch_pages`, made at build; 0: none): a draft that reads the target's own cache (`packed`:
        whether the target's format packs its pages)."""
        return 0

    def reserved_bytes(self, groups, block_size: int, num_kv_heads: int, head_dim: int, dtype: "torch.dtype",
                       packed: bool) -> int:
        """Bytes the draft keeps on the device that the engine takes from `kv_cache_memory` before sizing its
        pool (a self-speculating draft's copy of its view; 0: none)."""
        return 0

    def query_rows(self, seq: "Sequence", num_new_tokens: int) -> int:
        """Trailing rows of this step's chunk of `seq` whose target queries the draft reads (0: none)."""
        return 0

    def prompt_query_tail(self) -> int:
        """Trailing prompt tokens whose target queries the draft may read after the prefill: a prefix hit stops
        before them, so this request computes (and `observe`s) them itself (0: none)."""
        return 0

    def observe(self, seq: "Sequence", positions: list[int], queries: dict) -> None:
        """The target's queries (layer -> [len(positions), Hq, D]) of `seq`'s committed tokens at `positions`,
        as `query_rows` asked: a verify step's kept rows only."""

    def stats(self) -> dict:
        """Figures of the draft's own for `llm.stats()` (e.g. the bytes of a view it keeps)."""
        return {}

    def reset_stats(self) -> None:
        """Zero the figures `stats` counts (the engine's reset_stats)."""

    def forget(self, seq_id: int) -> None:
        """Sequence `seq_id` finished or was aborted: drop whatever the draft keeps for it."""

    def num_tracked(self) -> int:
        """Sequences the draft keeps state for (0 for a stateless draft; a leak test reads it)."""
        return 0

    @abstractmethod
    def propose(self, seqs: list["Sequence"], lengths: list[int],
                generators: list["torch.Generator | None"]) -> list[Proposal]:
        """For each sequence (its committed `token_ids`), a chain of at most `lengths[i]` tokens.

        Sampled requests (`seq.params`) that draw their tokens use `generators[i]` and return the
        distribution they drew from, with the request's temperature / top-k / top-p applied. `seqs`
        are all the sequences drafted for this step: per-sequence state of any other may be dropped.
        """


DRAFTS.base = DraftModel

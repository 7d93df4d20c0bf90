"""Token-level intersection (TLI): the draft restricted to the tokens both vocabularies share.

Based on Timor et al., ICML 2025 (arXiv:2502.05202), Algorithm 4; Hugging Face's universal
speculative decoding (`AssistantToTargetTranslator`) is the same idea. The shared vocabulary is
the draft tokens whose text is also a target token's text. The draft model's logits are
restricted to it (every other token at -inf) before the request's temperature / top-k / top-p, so
the draft draws only shared tokens; each drafted token is proposed as the target token of the
same text, with the distribution it was drawn from carried over to the target's ids (zero on
every target token outside the intersection). Standard speculative rejection sampling then
verifies it (kvlab/speculation/verifier.py): lossless under sampling, exact match under greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.speculation.drafts.base import Proposal
from kvlab.speculation.drafts.cross_vocab import CrossVocabDraft
from kvlab.registry import DRAFTS


def shared_index(target_of: dict, draft_vocab: int, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (draft ids [S], target ids [S]) of the shared vocabulary, inside both models' vocabularies."""
    pairs = sorted((d, t) for d, t in target_of.items() if d < draft_vocab and t < target_vocab)
    return torch.tensor([d for d, _ in pairs], dtype=torch.long), torch.tensor([t for _, t in pairs], dtype=torch.long)


def to_target(q: torch.Tensor, draft_ids: torch.Tensor, target_ids: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """q [..., V_draft], zero outside the shared draft ids -> [..., V_target], the same mass on the
    target token of the same text."""
    out = q.new_zeros(*q.shape[:-1], target_vocab)  # [..., V_target]
    out[..., target_ids] = q[..., draft_ids]
    return out


@DRAFTS.register("tli")
@dataclass
class TLIDraft(CrossVocabDraft):
    """The draft's distribution over the shared vocabulary, verified by rejection sampling."""

    def _check_vocabulary(self, loaded, engine) -> None:
        super()._check_vocabulary(loaded, engine)
        self._draft_ids, self._target_ids = shared_index(self._bridge.target_of, self._draft_vocab,
                                                         self._target_vocab)
        self._shared = torch.zeros(self._draft_vocab, dtype=torch.bool)  # [V_draft]
        self._shared[self._draft_ids] = True

    def propose(self, seqs, lengths, generators) -> list[Proposal]:
        drafted, probs = self._draft_chains(seqs, lengths, generators, self._shared)
        target_of = self._bridge.target_of
        out = []
        for tokens, p in zip(drafted, probs):
            q = to_target(torch.stack(p).cpu(), self._draft_ids, self._target_ids, self._target_vocab) if p else None
            out.append(Proposal([target_of[d] for d in tokens], q))
        return out

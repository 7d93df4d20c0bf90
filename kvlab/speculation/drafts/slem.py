"""String-level exact match (SLEM): a draft with another tokenizer, its text re-tokenised.

Based on Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms
for Heterogeneous Vocabularies", ICML 2025 (arXiv:2502.05202), Algorithm 2; Hugging Face's
universal assisted generation (`assistant_tokenizer`) is the same idea. The draft model drafts
`num_tokens` tokens in its own vocabulary (greedy: its argmax; sampled: a draw with the request's
temperature / top-k / top-p, restricted to tokens that stand for text), their text (cut at the
last whole UTF-8 character) is encoded with the target's tokenizer, and the first `num_tokens`
target tokens are proposed as point masses. Verification is then an exact match with the
target's greedy token, and under sampling the point-mass rule (accept with probability p(x),
else draw from p without x), which is lossless for any proposal.

The re-tokenised text starts at the boundary after the last committed token (the target decodes
from there, whatever a canonical tokenisation of the whole text would do), and its last token
may be a piece of a longer word: both only cost acceptance, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.speculation.drafts.base import Proposal
from kvlab.speculation.drafts.cross_vocab import CrossVocabDraft
from kvlab.speculation.drafts.vocabulary import complete_utf8
from kvlab.registry import DRAFTS


@DRAFTS.register("slem")
@dataclass
class SLEMDraft(CrossVocabDraft):
    """Draft text in any vocabulary, re-tokenised for the target, verified by exact match."""

    def propose(self, seqs, lengths, generators) -> list[Proposal]:
        drafted, _ = self._draft_chains(seqs, lengths, generators, self._has_text)
        out = []
        for tokens, n in zip(drafted, lengths):
            text, _ = complete_utf8(self._bridge.draft.text_bytes(tokens))
            out.append(Proposal(self._bridge.target.encode(text)[:n] if text else []))
        return out

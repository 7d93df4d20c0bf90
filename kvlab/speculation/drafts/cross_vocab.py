"""What the heterogeneous-vocabulary drafts share: a draft model with its own tokenizer.

Base of `slem` and `tli` (Timor et al., ICML 2025, arXiv:2502.05202). The draft model runs on its
own paged pool exactly as the `model` draft does (kvlab/speculation/drafts/model.py); what changes is what it
conditions on and what it proposes. Each step the request's committed target tokens are
translated into the draft's vocabulary (`Bridge.to_draft`: token by token, incrementally per
request; the shadow sequence is then rolled back to the longest prefix it shares with that
translation), and the subclass turns the draft's tokens into target tokens.

Tokenizers: the draft model's own and the target engine's, or -- for models without one
(`random:<shape>`), or to override -- a toy named in `tokenizer` / `target_tokenizer`
(`toy-a`, `toy-b`, `toy-p`; kvlab/speculation/drafts/vocabulary.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.speculation.drafts.model import ModelDraft
from kvlab.speculation.drafts.vocabulary import Bridge, load_vocabulary
from kvlab.sequence import Sequence


@dataclass
class CrossVocabDraft(ModelDraft):
    """A draft model whose tokenizer may differ from the target's."""

    tokenizer: str | None = None  # the draft's tokenizer: None = the draft model's own, or a toy name
    target_tokenizer: str | None = None  # the target's: None = the engine's, or a toy name
    _bridge: Bridge | None = field(default=None, init=False, repr=False)

    def _check_vocabulary(self, loaded, engine) -> None:
        name = self.registry_name
        draft = self.tokenizer if self.tokenizer is not None else loaded.tokenizer
        target = self.target_tokenizer if self.target_tokenizer is not None else engine.tokenizer
        for what, tok, option in (("draft model " + repr(self.model), draft, "tokenizer"),
                                  ("target " + repr(engine.config.model), target, "target_tokenizer")):
            if tok is None:
                raise ValueError(f"draft {name}: the {what} has no tokenizer, and draft {name} compares tokens by "
                                 f"their text; name one in draft_args {option!r} (e.g. a toy: toy-a, toy-b, toy-p)")
        self._bridge = Bridge(load_vocabulary(draft, self.model), load_vocabulary(target, engine.config.model))
        self._target_vocab = engine.model_config.vocab_size
        self._draft_vocab = loaded.model.config.vocab_size
        for what, vocab, size in (("draft", self._bridge.draft, self._draft_vocab),
                                  ("target", self._bridge.target, self._target_vocab)):
            top = max((i for i, b in enumerate(vocab.token_bytes) if b is not None), default=-1)
            if top >= size:
                raise ValueError(f"draft {name}: the {what} tokenizer has token id {top}, beyond the {what} model's "
                                 f"vocabulary of {size}")
        if not self._bridge.target_of:
            raise ValueError(f"draft {name}: the draft and target tokenizers share no token text")
        allowed = torch.zeros(self._draft_vocab, dtype=torch.bool)  # [V_draft] tokens that stand for text
        allowed[[i for i, b in enumerate(self._bridge.draft.token_bytes) if b is not None]] = True
        self._has_text = allowed

    def _context(self, seq: Sequence) -> list[int]:
        return self._bridge.to_draft(seq.token_ids, seq.seq_id)

    def _shadow_len(self, seq: Sequence, ids: list[int]) -> int:
        return self._max_model_len  # the draft may need more tokens than the target for the same text

    def forget(self, seq_id: int) -> None:
        super().forget(seq_id)
        if self._bridge is not None:
            self._bridge.forget(seq_id)

    def num_tracked(self) -> int:
        return super().num_tracked() + (self._bridge.num_tracked() if self._bridge is not None else 0)

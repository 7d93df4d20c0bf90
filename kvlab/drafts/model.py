"""A separate, smaller model drafting for the target (Leviathan et al. 2023, arXiv:2211.17192;
Chen et al. 2023, arXiv:2302.01318).

The draft shares the target's tokenizer (a different vocabulary is an error: that needs the
heterogeneous-vocabulary drafts `slem` / `tli` of Timor et al. 2025, arXiv:2502.05202, not built
yet). It runs a plain Hugging Face forward with its own per-sequence `DynamicCache` outside the
paged pool -- the simplest correct form. After verification the cache is re-synced: it is cropped
to the longest common prefix of the tokens it holds and the sequence's committed tokens (rejected
drafts drop out), and the missing tokens are fed before drafting again. Greedy requests draft the
draft model's argmax (a point mass); sampled requests draw from its distribution with the
request's temperature / top-k / top-p and generator, and return that distribution as q.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.drafts.base import DraftModel, Proposal
from kvlab.registry import DRAFTS
from kvlab.sampler import probabilities


@DRAFTS.register("model")
@dataclass
class ModelDraft(DraftModel):
    """A small model with the target's tokenizer, run through Hugging Face with its own cache."""

    model: str = "smollm2-135m"  # packaged name, local folder, .gguf file or random:<shape> (kvlab.models)
    seed: int = 0  # weights seed of a random:<shape> draft (the target's seed gives the target's weights)
    _model: torch.nn.Module | None = field(default=None, init=False, repr=False)
    _states: dict = field(default_factory=dict, init=False, repr=False)  # seq_id -> (DynamicCache, cached token ids)

    def setup(self, engine) -> None:
        from kvlab.models import load_model

        loaded = load_model(self.model, dtype=getattr(torch, engine.config.dtype), seed=self.seed)
        check_same_vocabulary(self.model, loaded, engine.config.model, engine.model_config, engine.tokenizer)
        self._model = loaded.model.to(engine.config.device).eval()
        self._states = {}

    @torch.inference_mode()
    def propose(self, seqs, lengths, generators) -> list[Proposal]:
        if self._model is None:
            raise RuntimeError("draft 'model' was not set up: the engine calls setup(engine) first")
        live = {s.seq_id for s in seqs}
        for seq_id in [k for k in self._states if k not in live]:
            del self._states[seq_id]
        return [self._propose_one(s, n, g) for s, n, g in zip(seqs, lengths, generators)]

    def _propose_one(self, seq, length: int, generator) -> Proposal:
        from transformers import DynamicCache

        tokens = seq.token_ids
        cache, cached = self._states.get(seq.seq_id, (None, []))
        keep = common_prefix(cached, tokens, len(tokens) - 1)  # feed at least the last token
        if cache is None or keep == 0 or (keep < len(cached) and not cache.is_croppable):
            cache, keep = DynamicCache(config=self._model.config), 0
        elif keep < len(cached):
            cache.crop(keep - len(cached))  # drop the rejected drafts (a negative count: tokens to remove)
        device = next(self._model.parameters()).device
        feed = tokens[keep:]
        drafted, probs = [], []
        for i in range(length):
            ids = torch.tensor([feed], device=device)
            pos = torch.arange(len(tokens) + i - len(feed), len(tokens) + i, device=device)[None]
            logits = self._model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True,
                                 logits_to_keep=1).logits[0, -1:].float()  # [1, V]
            q = probabilities(logits, [seq.params])[0]  # [V]
            if seq.params.greedy:
                token = int(q.argmax())
            else:
                token = int(torch.multinomial(q, 1, generator=generator))
                probs.append(q)
            drafted.append(token)
            feed = [token]
        # the cache holds every token fed: the committed ones and all drafts but the last
        self._states[seq.seq_id] = (cache, list(tokens) + drafted[:-1])
        return Proposal(drafted, torch.stack(probs) if probs else None)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of `a` and `b`, at most `limit`."""
    n = 0
    for x, y in zip(a, b):
        if x != y or n >= limit:
            break
        n += 1
    return n


def check_same_vocabulary(draft_name: str, loaded, target_name: str, target_config, target_tokenizer) -> None:
    """A `model` draft must tokenise exactly as the target does; say which draft to use otherwise."""
    draft_vocab, target_vocab = loaded.model.config.vocab_size, target_config.vocab_size
    problem = None
    if draft_vocab != target_vocab:
        problem = f"its vocabulary has {draft_vocab} tokens, the target's {target_vocab}"
    elif (loaded.tokenizer is None) != (target_tokenizer is None):
        problem = "one of the two has a tokenizer and the other has none"
    elif loaded.tokenizer is not None and loaded.tokenizer.get_vocab() != target_tokenizer.get_vocab():
        problem = "its tokenizer maps tokens to ids differently"
    if problem:
        raise ValueError(
            f"draft 'model': {draft_name!r} cannot draft for {target_name!r}: {problem}. The 'model' draft "
            f"needs the target's tokenizer; a draft with a different vocabulary needs the heterogeneous-"
            f"vocabulary drafts 'slem' or 'tli' (Timor et al. 2025, arXiv:2502.05202), which kvlab does not "
            f"have yet")

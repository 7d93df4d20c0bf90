"""A separate, smaller model drafting for the target (Leviathan et al. 2023, arXiv:2211.17192;
Chen et al. 2023, arXiv:2302.01318).

The draft shares the target's tokenizer (a different vocabulary is an error: that needs the
heterogeneous-vocabulary drafts `slem` / `tli` of Timor et al. 2025, arXiv:2502.05202, which
reuse this machinery through the hooks `_check_vocabulary`, `_context` and `_shadow_len`). It runs inside kvlab's own machinery, batched: a second page pool (`KVCache` +
`BlockManager` + `ModelRunner`, the draft model on the kvlab_paged attention) holds one shadow
sequence per drafted request. Each step every shadow is re-synced -- its table rolled back to the
longest common prefix of the tokens it holds and the request's committed tokens (rejected drafts
drop out, their pages go back to the draft's pool) -- then one packed forward computes every
sequence's missing tokens and drafts the first token, and k - 1 more packed forwards draft the
rest. A shadow whose pages do not fit the draft pool drafts nothing that step (nothing is
preempted for a draft). Greedy requests draft the draft model's argmax (a point mass); sampled
requests draw from its distribution with the request's temperature / top-k / top-p and
generator, and return that distribution as q.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlab.speculation.draft_length import confident
from kvlab.speculation.drafts.base import DraftModel, Proposal
from kvlab.registry import DRAFTS
from kvlab.sampler import draw, probabilities
from kvlab.sequence import Sequence


@DRAFTS.register("model")
@dataclass
class ModelDraft(DraftModel):
    """A small model with the target's tokenizer, batched on its own paged KV pool."""

    stops_on_confidence: ClassVar[bool] = True  # confidence_threshold: a chain stops when the draft is unsure
    model: str = "smollm2-135m"  # packaged name, local folder, .gguf file or random:<shape> (kvlab.models)
    seed: int = 0  # weights seed of a random:<shape> draft (the target's seed gives the target's weights)
    _pool: object = field(default=None, init=False, repr=False)  # kvlab.engine.build.PrivatePool
    _shadows: dict = field(default_factory=dict, init=False, repr=False)  # target seq_id -> shadow Sequence

    def setup(self, engine) -> None:
        # the model and its pool come from the engine (`engine.private_pools`): a plugin imports neither
        pools = engine.private_pools
        self._pool = pools.pool(self._draft_model(engine), self._extra_tokens())
        self._shadows = {}
        self._max_model_len = pools.max_model_len

    def _draft_model(self, engine) -> torch.nn.Module:
        """The draft network on the engine's device, on the kvlab_paged attention, vocabulary checked."""
        loaded = engine.private_pools.load_model(self.model, self.seed)
        self._check_vocabulary(loaded, engine)
        return loaded.model

    def _extra_tokens(self) -> int:
        """Pool room beyond the target's capacity: the drafts of 64 sequences."""
        return 64 * self.max_num_tokens

    def _check_vocabulary(self, loaded, engine) -> None:
        check_same_vocabulary(self.model, loaded, engine.config.model, engine.model_config, engine.tokenizer)

    def _context(self, seq: Sequence) -> list[int]:
        """The token ids the draft model conditions on: the target's own (same vocabulary)."""
        return seq.token_ids

    def propose(self, seqs, lengths, generators) -> list[Proposal]:
        drafted, probs = self._draft_chains(seqs, lengths, generators)
        return [Proposal(d, torch.stack(p) if p else None) for d, p in zip(drafted, probs)]

    def _draft_chains(self, seqs, lengths, generators, allowed: torch.Tensor | None = None):
        """Up to lengths[i] draft-vocabulary tokens per sequence, in k packed passes -> (tokens,
        the distributions sampled rows drew them from). `allowed` [V_draft] bool: the only tokens
        the draft may propose (its distribution restricted to them before temperature / top-k / top-p). With a
        `confidence_threshold`, a sequence drafts nothing after a token whose distribution's top probability is
        below it (kvlab/speculation/draft_length.py)."""
        if self._pool is None:
            raise RuntimeError(f"draft {self.registry_name!r} was not set up: the engine calls setup(engine) first")
        live = {s.seq_id for s in seqs}
        for seq_id in [k for k in self._shadows if k not in live]:
            self._drop(seq_id)
        shadows = [self._sync(s) for s in seqs]
        drafted: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        unsure: set[int] = set()  # sequences whose chain a confidence stop ended
        for j in range(max(lengths, default=0)):
            active = [i for i, (sh, n) in enumerate(zip(shadows, lengths))
                      if sh is not None and j < n and i not in unsure]
            active = [i for i in active if self._grow(shadows, i)]
            if not active:
                break
            logits = self._forward([shadows[i] for i in active])  # [len(active), V]
            if allowed is not None:
                logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
            q = probabilities(logits, [seqs[i].params for i in active])  # [len(active), V]
            unsure |= self._unsure(logits, active)
            for row, i in enumerate(active):
                token = draw(q[row], seqs[i].params.greedy, generators[i])
                if not seqs[i].params.greedy:
                    probs[i].append(q[row])
                drafted[i].append(token)
                shadows[i].token_ids.append(token)
        return drafted, probs

    def _unsure(self, logits: torch.Tensor, active: list[int]) -> set[int]:
        """The sequences of `active` (rows of logits [len(active), V]) whose draft is unsure: the top probability
        of its own distribution (softmax of its logits, temperature 1) below the confidence threshold. Each
        drafts this token, then stops."""
        if self.confidence_threshold is None:
            return set()
        return unsure(logits, active, self.confidence_threshold)

    # -- the shadow sequences on the draft's pool --------------------------------
    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, its cache rolled back to the longest prefix it shares with `seq`'s tokens."""
        ids = self._context(seq)
        sh = self._shadows.get(seq.seq_id)
        if sh is not None:
            keep = common_prefix(sh.token_ids[:sh.num_computed_tokens], ids, len(ids) - 1)
            try:
                self._pool.rollback(sh, sh.num_computed_tokens - keep)
                sh.num_computed_tokens = keep
            except ValueError:  # into pages a sliding window released: start over
                self._drop(seq.seq_id)
                sh = None
        if sh is None:
            sh = Sequence(seq.seq_id, [], seq.params, self._shadow_len(seq, ids), seq.arrival_time)
            self._shadows[seq.seq_id] = sh
        sh.token_ids = list(ids)
        return sh

    def _shadow_len(self, seq: Sequence, ids: list[int]) -> int:
        """The most tokens the shadow of `seq` will hold (its pages are reserved against it)."""
        return seq.max_len + self.max_num_tokens

    def _grow(self, shadows: list, i: int) -> bool:
        """Slots for shadow i's uncomputed tokens; False (and the shadow dropped) if the pool is full."""
        sh = shadows[i]
        if self._take_slots(sh):
            return True
        self._drop(sh.seq_id)
        shadows[i] = None
        return False

    def _take_slots(self, sh: Sequence) -> bool:
        """Slots in the draft's pool for the shadow's uncomputed tokens; False, and nothing taken, if they do not fit."""
        return self._pool.take_slots(sh)

    def _forward(self, shadows: list[Sequence]) -> torch.Tensor:
        return self._pool.forward(shadows)  # [B, V], in the order of `shadows`

    def forget(self, seq_id: int) -> None:
        self._drop(seq_id)

    def num_tracked(self) -> int:
        return len(self._shadows)

    def _drop(self, seq_id: int) -> None:
        sh = self._shadows.pop(seq_id, None)
        if sh is not None:
            self._pool.free(sh)


def unsure(logits: torch.Tensor, rows: list, threshold: float) -> set:
    """`rows` (one per row of logits [R, V]) whose softmax's top probability is below `threshold`."""
    top = logits.float().softmax(-1).amax(-1).tolist()  # [R]
    return {r for r, p in zip(rows, top) if not confident(p, threshold)}


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
            f"vocabulary drafts 'slem' or 'tli' (Timor et al. 2025, arXiv:2502.05202): "
            f"draft='slem' or draft='tli' with the same draft_args")

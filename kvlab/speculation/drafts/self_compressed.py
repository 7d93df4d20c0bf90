"""Self-speculation through a compressed view of the target's own cache.

Based on MagicDec (Chen et al. 2024, arXiv:2408.11049) and TriForce (Sun et al. 2024, arXiv:2404.11912):
once decoding is bound by reading the KV cache, the target model itself, attending to a small view of its
own cache (StreamingLLM's sinks and recent pages), drafts tokens it then accepts at a high rate. The draft
is the target's own network (or, with `layers`, its early exit: kvlab/speculation/drafts/layerskip.py's
`early_exit`), run on kvlab's paged attention with a *shorter block table over the target's own pages*
(kvlab/speculation/drafts/page_view.py): no copy of the view, no second cache.

Where the draft's own K/V go: a small private scratch of the target's pool tensors, pages past the block
manager's (`KVCache.scratch_pages`, sized by `scratch_pages` at build, outside `kv_cache_memory` like a
model draft's pool, but about one page a sequence instead of a whole cache). Each step, per sequence and
layer group, the scratch's first page starts as a copy of the target's partial last page (its committed
tokens: fewer than one page); the draft's k passes then write the last committed token's K/V and its
drafts' after them, there. The target's pages are only read: the target's cache never holds a K/V the draft
computed, and verification (the exact verifier, kvlab/speculation/speculator.py) computes and writes every
tentative token itself, in the tentative slots the scheduler appended, rolled back when rejected.

Per step: `max_batch` sequences a round (the scratch holds that many), k packed passes of one token each.
The draft keeps no per-sequence state. Packed formats (int8 / int4 / int2) are refused
(kvlab/engine/capabilities.py): the scratch would open and seal packed pages. A quantised view (QuantSpec)
and token-granular or query-aware views (SnapKV, Quest) are refused with what is supported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlab.kernels.attention_plan import NULL_BLOCK
from kvlab.registry import DRAFTS, POLICIES
from kvlab.sampler import draw, probabilities
from kvlab.speculation.drafts.base import DraftModel, Proposal
from kvlab.speculation.drafts.layerskip import early_exit
from kvlab.speculation.drafts.model import unsure as unsure_rows
from kvlab.speculation.drafts.page_view import PageView, page_view


@DRAFTS.register("self_compressed")
@dataclass
class SelfCompressedDraft(DraftModel):
    """The target (or its first `layers` layers) drafting through a page-granular view of its own cache."""

    policy: str = "streaming_llm"  # registered policy naming the view (page_view.SUPPORTED)
    policy_args: dict = field(default_factory=lambda: {"budget": 256})  # its arguments (budget: tokens read)
    layers: int | None = None  # decoder layers the draft runs (an early exit); None: all of them
    quant: str | None = None  # a quantised view (QuantSpec): not supported yet, None reads the target's format
    max_batch: int = 16  # sequences drafted in one pass (the scratch holds this many)

    reads_target_cache: ClassVar[bool] = True  # capabilities: the draft reads the target's pages, writes a scratch
    stops_on_confidence: ClassVar[bool] = True  # confidence_threshold (kvlab/speculation/draft_length.py)

    _view: PageView | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("layers", "max_batch"):
            value = getattr(self, key)
            if value is None and key == "layers":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"draft self_compressed: {key} must be an integer >= 1, got {value!r}")
        if self.quant is not None:
            raise ValueError(f"draft self_compressed: a quantised view (quant={self.quant!r}) is not supported yet; "
                             f"the draft reads the target's pages in the target's own format (quant=None)")
        if not isinstance(self.policy_args, dict):
            raise ValueError(f"draft self_compressed: policy_args must be a mapping, got {self.policy_args!r}")
        self._view = page_view(POLICIES.build(self.policy, **self.policy_args))

    # -- what the engine builds for it ------------------------------------------------
    def longest(self) -> int:
        """The most tokens one step drafts for a sequence."""
        return self.max_num_tokens if self.adaptive else self.num_tokens

    def pages_per_sequence(self, block_size: int) -> int:
        """Scratch pages one sequence needs per layer group: its partial last page and the drafted tokens."""
        return -(-(block_size - 1 + self.longest()) // block_size)

    def scratch_pages(self, block_size: int) -> int:
        return self.max_batch * self.pages_per_sequence(block_size)

    def setup(self, engine) -> None:
        if engine.quant.packed:
            raise ValueError(f"draft self_compressed cannot write its scratch into packed pages "
                             f"(quant={engine.config.quant!r})")
        cache, bm = engine.cache, engine.block_manager
        need = len(bm.groups) * self.scratch_pages(bm.block_size)
        if len(cache.scratch_pages) != need:
            raise RuntimeError(f"draft self_compressed needs {need} scratch pages, the cache has "
                               f"{len(cache.scratch_pages)}: build it through kvlab.engine.build")
        self._cache, self._bm, self._device = cache, bm, torch.device(engine.config.device)
        self._plan_view = engine.plan_view  # kvlab.engine.attention.plan_view (the engine lends it)
        if self.layers is None:
            self._model = engine.model
            return
        try:
            self._model = early_exit(engine.model, self.layers).eval()
        except ValueError as e:
            raise ValueError(str(e).replace("draft layerskip", "draft self_compressed")) from None

    # -- propose ------------------------------------------------------------------------
    def propose(self, seqs, lengths, generators) -> list[Proposal]:
        if getattr(self, "_cache", None) is None:
            raise RuntimeError("draft 'self_compressed' was not set up: the engine calls setup(engine) first")
        out: list[Proposal] = []
        for start in range(0, len(seqs), self.max_batch):
            end = start + self.max_batch
            out += self._round(seqs[start:end], lengths[start:end], generators[start:end])
        return out

    def _round(self, seqs, lengths, generators) -> list[Proposal]:
        """At most `max_batch` sequences: their views (scratch primed), then k packed one-token passes."""
        views = [self._views(seq, i) for i, seq in enumerate(seqs)]  # [B][G] (table, cached slots before the step)
        drafted: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        unsure: set[int] = set()  # sequences whose chain a confidence stop ended
        for j in range(max(lengths, default=0)):
            active = [i for i, n in enumerate(lengths) if j < n and i not in unsure]
            if not active:
                break
            ids = [drafted[i][-1] if j else seqs[i].token_ids[-1] for i in active]
            positions = [seqs[i].num_tokens - 1 + j for i in active]  # the last committed token's, then its drafts'
            logits = self._forward(ids, positions, [views[i] for i in active], j)  # [len(active), V]
            q = probabilities(logits, [seqs[i].params for i in active])  # [len(active), V]
            if self.confidence_threshold is not None:  # kvlab/speculation/draft_length.py
                unsure |= unsure_rows(logits, active, self.confidence_threshold)
            for row, i in enumerate(active):
                token = draw(q[row], seqs[i].params.greedy, generators[i])
                if not seqs[i].params.greedy:
                    probs[i].append(q[row])
                drafted[i].append(token)
        return [Proposal(d, torch.stack(p) if p else None) for d, p in zip(drafted, probs)]

    def _views(self, seq, i: int) -> list[tuple[list[int], int]]:
        """Per layer group: the draft's table (view pages, then scratch pages) and its cached slots before the
        draft's first token. The target's partial last page is copied to the scratch's first page."""
        bm, bs, copies, out = self._bm, self._bm.block_size, [], []
        per_seq = self.pages_per_sequence(bs)
        for g, group in enumerate(bm.groups):
            table, n = bm.block_tables([seq], g)[0], bm.cached_lens([seq], g)[0]
            full, partial = divmod(n, bs)
            first = (g * self.max_batch + i) * per_seq
            scratch = list(self._cache.scratch_pages[first:first + per_seq])
            if partial:
                copies.append((table[full], scratch[0]))
            if group.sliding_window is not None:  # the window bounds the read already: cache indices kept as they are
                kept = list(table[:full])
            else:  # released entries (an eviction's, a window's) hold nothing to read
                kept = [table[p] for p in self._view.full_pages(n, bs) if table[p] != NULL_BLOCK]
            out.append((kept + scratch, len(kept) * bs + partial))
        self._cache.copy_scratch(copies)
        return out

    @torch.inference_mode()
    def _forward(self, ids: list[int], positions: list[int], views, j: int) -> torch.Tensor:
        """One packed pass, one token a sequence at draft offset `j` -> logits [B, V] (float32)."""
        dev = self._device
        meta = self._plan_view([[v[g][0] for v in views] for g in range(len(self._bm.groups))],
                         [[v[g][1] + j + 1 for v in views] for g in range(len(self._bm.groups))],
                         self._bm, self._cache, dev)
        B = len(ids)
        out = self._model(input_ids=torch.tensor([ids], dtype=torch.int64, device=dev),
                          position_ids=torch.tensor([positions], dtype=torch.int64, device=dev),
                          use_cache=False, logits_to_keep=torch.arange(B, device=dev), kvlab_meta=meta)
        return out.logits[0].float()

"""Self-speculation through a compressed view of the target's own cache.

Based on MagicDec (Chen et al. 2024, arXiv:2408.11049), TriForce (Sun et al. 2024, arXiv:2404.11912) and
QuantSpec (Tiwari et al. 2025, arXiv:2502.10424): once decoding is bound by reading the KV cache, the target
model itself, attending to a small view of its own cache, drafts tokens it then accepts at a high rate. The
draft is the target's own network (or, with `layers`, its early exit: kvlab/speculation/drafts/layerskip.py's
`early_exit`), run on kvlab's paged attention over one of two kinds of view:

- a *page view* (StreamingLLM's sinks and recent pages, or every page: kvlab/speculation/drafts/page_view.py)
  over an element-wise target: a shorter block table over the target's own pages, no copy. The draft's own
  K/V go to a small private scratch of the target's pool tensors, pages past the block manager's
  (`KVCache.scratch_pages`, outside `kv_cache_memory` like a model draft's pool, about one page a sequence):
  each step, per sequence and layer group, the scratch's first page starts as a copy of the target's partial
  last page; the draft's k passes write the last committed token's K/V and its drafts' after it, there.
- a *copied view* (kvlab/speculation/drafts/view_copy.py): a token-granular view (any registered token-level
  policy, its `budget` tokens of [0, P) chosen by the policy's own select: kvlab/speculation/drafts/token_view.py),
  a quantised view (`quant`: QuantSpec's idea, the copy *stored* in that format -- int4's codes, scales and
  zero points -- its open pages in full-precision rows), or any view over a packed target (int8 / int4 / int2,
  whose pages a draft cannot write beside). The copy is refreshed at P, every `refresh` tokens of the sequence
  (by position, not by step), holds the target's tokens [P, c) besides, and its draft tokens after them; its
  bytes come out of `kv_cache_memory` (`reserved_bytes`).

Either way the target's pages are only read: the target's cache (pages, residual rows, page summaries) never
holds a K/V the draft computed, and verification (the exact verifier, kvlab/speculation/speculator.py)
computes and writes every tentative token itself, in the tentative slots the scheduler appended, rolled back
when rejected. Per step: `max_batch` sequences a round, k packed passes of one token each. Query-aware page
selection (Quest) is refused with what is supported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlab.kernels.attention_plan import NULL_BLOCK
from kvlab.registry import DRAFTS, POLICIES, QUANT_FORMATS
from kvlab.sampler import draw, probabilities
from kvlab.speculation.drafts.base import DraftModel, Proposal
from kvlab.speculation.drafts.layerskip import early_exit
from kvlab.speculation.drafts.model import unsure as unsure_rows
from kvlab.speculation.drafts.page_view import SUPPORTED, PageView, page_view
from kvlab.speculation.drafts.token_view import QueryLog, TokenView, candidates, gather_heads
from kvlab.speculation.drafts.view_copy import ViewCopy, copy_nbytes, keeps_rows


def choose_view(policy) -> PageView | TokenView:
    """The page view a policy names (page_view.SUPPORTED), else its token view: a token-level compressing policy
    with an integer budget. Query-aware page selection (Quest) and per-head budgets (AdaKV) are refused."""
    name = getattr(type(policy), "registry_name", type(policy).__name__)
    if name in SUPPORTED or getattr(policy, "reads_sparsely", None) or not policy.compresses:
        return page_view(policy)
    if policy.head_budgets:
        raise ValueError(f"draft self_compressed: policy {name!r} keeps a budget per KV head, which a view copy "
                         f"(one table per layer group) does not hold; use its scorer (e.g. snapkv) as the view")
    if not isinstance(policy.budget, int):
        raise ValueError(f"draft self_compressed: a token view ({name!r}) is a copy of fixed size: give "
                         f"policy_args.budget (tokens kept per layer), not a compression_ratio")
    return TokenView(policy, 0)


@DRAFTS.register("self_compressed")
@dataclass
class SelfCompressedDraft(DraftModel):
    """The target (or its first `layers` layers) drafting through a view of its own cache."""

    policy: str = "streaming_llm"  # registered policy naming the view: a page view (page_view.SUPPORTED) or any
    # token-level policy (snapkv, h2o, tova, knorm, ...: a copied view of `budget` tokens)
    policy_args: dict = field(default_factory=lambda: {"budget": 256})  # its arguments (budget: tokens read)
    layers: int | None = None  # decoder layers the draft runs (an early exit); None: all of them
    quant: str | None = None  # a quantised view (QuantSpec): a registered format the copy is stored in (int4: its
    # codes and scales, a fraction of the decoded copy's bytes); None: the target's values, decoded
    refresh: int = 64  # a copied view's selection is remade every `refresh` tokens of the sequence (by position)
    rescore: str = "kept"  # a token view's refresh scores `kept`: the previous selection and the tokens since it
    # (cost ~ budget + refresh); `all`: every token of [0, P) (cost ~ context; kvlab/speculation/drafts/token_view.py)
    max_batch: int = 16  # sequences drafted in one pass (the scratch, or the copy, holds this many)

    reads_target_cache: ClassVar[bool] = True  # capabilities: the draft reads the target's cache, writes none of it
    stops_on_confidence: ClassVar[bool] = True  # confidence_threshold (kvlab/speculation/draft_length.py)

    _view: PageView | TokenView | None = field(default=None, init=False, repr=False)
    _refresh_s: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("layers", "max_batch", "refresh"):
            value = getattr(self, key)
            if value is None and key == "layers":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"draft self_compressed: {key} must be an integer >= 1, got {value!r}")
        if self.rescore not in ("kept", "all"):
            raise ValueError(f"draft self_compressed: rescore must be 'kept' or 'all', got {self.rescore!r}")
        if self.quant is not None:
            QUANT_FORMATS.build(self.quant)  # an unknown format names the registered ones
        if not isinstance(self.policy_args, dict):
            raise ValueError(f"draft self_compressed: policy_args must be a mapping, got {self.policy_args!r}")
        self._view = choose_view(POLICIES.build(self.policy, **self.policy_args))

    # -- what the engine builds for it ------------------------------------------------
    def longest(self) -> int:
        """The most tokens one step drafts for a sequence."""
        return self.max_num_tokens if self.adaptive else self.num_tokens

    def copies(self, packed: bool) -> bool:
        """Whether the view is a copy (token-granular, quantised, or over a packed target's pages)."""
        return isinstance(self._view, TokenView) or self.quant is not None or packed

    def pages_per_sequence(self, block_size: int) -> int:
        """Scratch pages one sequence needs per layer group: its partial last page and the drafted tokens."""
        return -(-(block_size - 1 + self.longest()) // block_size)

    def scratch_pages(self, block_size: int, packed: bool = False) -> int:
        return 0 if self.copies(packed) else self.max_batch * self.pages_per_sequence(block_size)

    def copy_pages(self, groups, block_size: int) -> int:
        """Pages of one sequence's copy per layer group: the selection, the tokens since the refresh, the draft's."""
        budget = self._view.policy.budget if isinstance(self._view, TokenView) else self._view.budget
        if budget is None:
            raise ValueError(f"draft self_compressed: a copied view (quant={self.quant!r}, or a packed target) of "
                             f"policy {self.policy!r} needs policy_args.budget (the copy's size)")
        windows = [g.sliding_window for g in groups if g.sliding_window is not None]
        return -(-(max([budget + self.refresh - 1] + windows) + self.longest()) // block_size)

    def copy_format(self):
        """The format the copy is stored in: the quantised view's, else `auto` (decoded, the compute dtype)."""
        return QUANT_FORMATS.build(self.quant or "auto")

    def open_pages(self, block_size: int) -> int:
        """Open pages (residual rows) one slot of a copy that keeps rows needs per layer group: those a draft chain
        writes, and the page where the selection ends where that may fall inside a page (a selection of a budget
        or refresh interval that is no multiple of the block size; its S tokens are min(budget, P))."""
        if not keeps_rows(self.copy_format()):
            return 0
        budget = self._view.policy.budget if isinstance(self._view, TokenView) else self._view.budget
        straddles = bool((budget or 0) % block_size or self.refresh % block_size)
        return self.pages_per_sequence(block_size) + straddles

    def reserved_bytes(self, groups, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       packed: bool) -> int:
        """Bytes of the view's copy, taken from the target's `kv_cache_memory` (0: a page view, no copy)."""
        if not self.copies(packed):
            return 0
        fmt = self.copy_format()
        fmt.check_shape(num_kv_heads, head_dim, block_size)
        return copy_nbytes(fmt, len(groups), len(groups[0].layers), self.max_batch, self.copy_pages(groups, block_size),
                           block_size, num_kv_heads, head_dim, dtype, self.open_pages(block_size))

    def setup(self, engine) -> None:
        cache, bm = engine.cache, engine.block_manager
        packed, dtype = engine.quant.packed, cache.compute_dtype
        need = len(bm.groups) * self.scratch_pages(bm.block_size, packed)
        if len(cache.scratch_pages) != need:
            raise RuntimeError(f"draft self_compressed needs {need} scratch pages, the cache has "
                               f"{len(cache.scratch_pages)}: build it through kvlab.engine.build")
        self._cache, self._bm, self._device = cache, bm, torch.device(engine.config.device)
        self._plan_view = engine.plan_view  # kvlab.engine.attention.plan_view (the engine lends it)
        self._copy = self._log = None
        self._kept: dict[tuple[int, int], torch.Tensor] = {}  # (slot, layer) -> [Hkv, S] positions it last kept
        if self.copies(packed):
            self._build_copy(engine, dtype)
        runner = getattr(engine, "runner", None)
        self._lean = getattr(runner, "lean", None)  # the runner's lean forward (kvlab/engine/lean_forward.py); None: transformers'
        if self.layers is None:
            self._model = engine.model
            return
        try:
            self._model = early_exit(engine.model, self.layers).eval()
        except ValueError as e:
            raise ValueError(str(e).replace("draft layerskip", "draft self_compressed")) from None
        self._lean = runner.lean_for(self._model) if self._lean is not None else None

    def _build_copy(self, engine, dtype: torch.dtype) -> None:
        bm, mc = self._bm, engine.model.config
        if any(g.head is not None for g in bm.groups):
            raise ValueError(f"draft self_compressed: a copied view over per-head tables (policy "
                             f"{engine.config.policy!r} keeps a budget per KV head) is not supported; use a page view "
                             f"over an element-wise format")
        heads = mc.num_key_value_heads
        dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        self._copy = ViewCopy(bm.groups, self.max_batch, self.copy_pages(bm.groups, bm.block_size), bm.block_size,
                              heads, dim, dtype, self._device, self.copy_format(), self.open_pages(bm.block_size))
        if self._copy.nbytes() != self.reserved_bytes(bm.groups, bm.block_size, heads, dim, dtype, True):
            raise RuntimeError("draft self_compressed: the view copy's bytes differ from those reserved at build")
        if isinstance(self._view, TokenView):
            self._view = TokenView(self._view.policy, mc.num_hidden_layers)
            self._view.policy.bind(engine.model)
            if self._view.window:
                self._log = QueryLog(keep=self._view.window + self.refresh + self.longest() + 1)

    # -- what the engine hands it of the target's passes -----------------------------------
    def query_rows(self, seq, num_new_tokens: int) -> int:
        """Trailing rows of this step's chunk of `seq` whose target queries the token view's scores read."""
        if self._log is None:
            return 0
        return min(num_new_tokens, num_new_tokens if seq.draft_token_ids else self._view.window + self.refresh)

    def prompt_query_tail(self) -> int:
        """A token view's scores read the target's queries of the `window` positions before a refresh point P;
        the first P after the prefill is at most refresh - 1 before the prompt's end."""
        if isinstance(self._view, TokenView) and self._view.window:
            return self._view.window + self.refresh - 1
        return 0

    def observe(self, seq, positions: list[int], queries: dict[int, torch.Tensor]) -> None:
        """The target's queries (layer -> [len(positions), Hq, D]) of `seq`'s committed tokens at `positions`."""
        if self._log is not None:
            self._log.record(seq.seq_id, positions, queries)

    def forget(self, seq_id: int) -> None:
        if getattr(self, "_copy", None) is not None:
            self._copy.forget(seq_id)
        if getattr(self, "_log", None) is not None:
            self._log.forget(seq_id)

    def num_tracked(self) -> int:
        copy, log = getattr(self, "_copy", None), getattr(self, "_log", None)
        return (copy.num_held() if copy is not None else 0) + (log.num_tracked() if log is not None else 0)

    def stats(self) -> dict:
        copy = getattr(self, "_copy", None)
        return {"spec_view_bytes": copy.nbytes() if copy is not None else 0,
                "spec_view_pages": copy.num_pages() if copy is not None else 0,
                "spec_view_refresh_s": self._refresh_s}  # seconds spent selecting a copied view's tokens

    def reset_stats(self) -> None:
        self._refresh_s = 0.0

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
        """At most `max_batch` sequences: their views (scratch primed, or copy refreshed), then k one-token passes."""
        if self._copy is not None:
            slots = self._copy.take([s.seq_id for s in seqs])
            views = [self._copied(seq, slot) for seq, slot in zip(seqs, slots)]  # [B][G] (table, cached slots)
        else:
            views = [self._views(seq, i) for i, seq in enumerate(seqs)]
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
            if self.confidence_threshold is not None:  # kvlab/speculation/draft_length.py
                unsure |= unsure_rows(logits, active, self.confidence_threshold)
            if all(seqs[i].params.greedy for i in active):  # point masses on the argmax: no [B, V] one-hot
                for i, token in zip(active, logits.argmax(dim=-1).tolist()):
                    drafted[i].append(token)
                continue
            q = probabilities(logits, [seqs[i].params for i in active])  # [len(active), V]
            for row, i in enumerate(active):
                token = draw(q[row], seqs[i].params.greedy, generators[i])
                if not seqs[i].params.greedy:
                    probs[i].append(q[row])
                drafted[i].append(token)
        if self._copy is not None:
            self._copy.check_rows()
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

    # -- a copied view -------------------------------------------------------------------
    def _copied(self, seq, slot: int) -> list[tuple[list[int], int]]:
        """Per layer group: the copy's table of `slot` and its cached slots before the draft's first token: the
        selection at the last refresh point P (remade when P moved), then the target's tokens [P, c)."""
        copy, out = self._copy, []
        for g, group in enumerate(self._bm.groups):
            table, c = self._bm.block_tables([seq], g)[0], self._bm.cached_lens([seq], g)[0]
            P = c // self.refresh * self.refresh
            if group.sliding_window is not None:  # the window's last tokens, as they are: no selection
                P = start = max(0, c - group.sliding_window)
                selected = 0
            else:
                last = copy.refreshed.get((slot, g))
                if last != (seq.seq_id, P):
                    since = last[1] if self.rescore == "kept" and last and last[0] == seq.seq_id and last[1] < P \
                        else None  # this sequence's previous refresh point, whose selection is still in the slot
                    copy.reset(slot, g)
                    t0 = time.perf_counter()
                    copy.selected[(slot, g)] = self._select(seq, slot, g, table, P, since)
                    self._refresh_s += time.perf_counter() - t0
                    copy.refreshed[(slot, g)] = (seq.seq_id, P)
                selected, start = copy.selected[(slot, g)], P
            length = self._copy_tokens(slot, g, table, range(start, c), selected)
            copy.close(slot, g, selected, length)
            out.append((copy.table(slot, g), length))
        return out

    def _select(self, seq, slot: int, g: int, table: list[int], P: int, since: int | None = None) -> int:
        """Write the view's selection of the target's tokens [0, P) of group `g` into `slot`; -> its length S.
        `since`: the slot's previous refresh point for this sequence, whose kept positions are candidates with
        [since, P) (rescore `kept`); None: every token of [0, P) is."""
        group, sizes, kv = self._bm.groups[g], set(), []
        if isinstance(self._view, PageView):
            bs = self._bm.block_size
            pages = self._view.full_pages(P, bs)
            tokens = [p * bs + t for p in pages for t in range(bs)] + list(range(P // bs * bs, P))
            return self._copy_tokens(slot, g, table, tokens, 0)
        for layer in group.layers:
            queries = self._log.window(seq.seq_id, layer, P, self._view.window) if self._log else None
            kept = self._kept.get((slot, layer)) if since is not None else None
            if kept is None:  # every token of [0, P)
                keys, values = self._read(layer, table, range(P))  # [P, Hkv, D] each
                pick = idx = self._view.select(layer, keys, values, queries)  # [Hkv, S] positions
            else:  # the candidates: what was kept at `since`, then [since, P)
                cand = candidates(kept, since, P)  # [Hkv, C] positions
                where, local = torch.unique(cand, sorted=True, return_inverse=True)  # [U], [Hkv, C]
                keys, values = (gather_heads(x, local) for x in self._read(layer, table, where.tolist()))  # [C, Hkv, D]
                pick = self._view.select(layer, keys, values, queries, seq_len=P)  # [Hkv, S] candidate rows
                idx = cand.gather(1, pick)  # [Hkv, S] positions
            self._kept[(slot, layer)] = idx
            kv.append((gather_heads(keys, pick), gather_heads(values, pick)))  # [S, Hkv, D] each
            sizes.add(idx.shape[1])
        if len(sizes) > 1:
            raise ValueError(f"draft self_compressed: policy {self.policy!r} keeps {sorted(sizes)} tokens in layers "
                             f"of one group; a token view needs one budget for every layer")
        if kv:
            self._copy.write(slot, g, 0, kv)
        return sizes.pop() if sizes else 0

    def _copy_tokens(self, slot: int, g: int, table: list[int], tokens, start: int) -> int:
        """The target's cache indices `tokens` of group `g` -> the copy's indices start.. of `slot`; -> start + n."""
        tokens = list(tokens)
        if tokens:
            self._copy.write(slot, g, start, [self._read(layer, table, tokens) for layer in self._bm.groups[g].layers])
        return start + len(tokens)

    def _read(self, layer: int, table: list[int], tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's K/V of `layer` at cache indices `tokens` of `table`, decoded: ([N, Hkv, D], [N, Hkv, D])."""
        bs, index = self._bm.block_size, torch.tensor(list(tokens), dtype=torch.int64)
        slots = torch.tensor(table, dtype=torch.int64)[index // bs] * bs + index % bs
        return self._cache.read_slots(layer, slots.to(self._device), self._cache.compute_dtype)

    @torch.inference_mode()
    def _forward(self, ids: list[int], positions: list[int], views, j: int) -> torch.Tensor:
        """One packed pass, one token a sequence at draft offset `j` -> logits [B, V] (float32)."""
        dev, cache = self._device, self._copy.cache if self._copy is not None else self._cache
        meta = self._plan_view([[v[g][0] for v in views] for g in range(len(self._bm.groups))],
                               [[v[g][1] + j + 1 for v in views] for g in range(len(self._bm.groups))],
                               self._bm, cache, dev)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)  # [B]
        position_ids = torch.tensor(positions, dtype=torch.int64, device=dev)  # [B]
        keep = torch.arange(len(ids), device=dev)  # [B]: every row's logits
        # the lean forward runs the same ops as transformers' (the logits to the bit) without its module stack,
        # which cost ~14 ms a pass (experiments/results/self_speculation_round_smollm2.md); None: a hooked model
        logits = self._lean(input_ids, position_ids, keep, meta) if self._lean is not None else None
        if logits is None:
            logits = self._model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False,
                                 logits_to_keep=keep, kvlab_meta=meta).logits[0]
        return logits.float()  # [B, V]

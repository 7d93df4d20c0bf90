"""Sparse reading at decode: a policy chooses, per layer and per sequence, which pages of its table a
decode step's query reads. Nothing is evicted: the pages stay allocated and are read again whenever
a later step selects them (Quest, arXiv:2406.10774; RocketKV's second stage, arXiv:2502.14051).

Three parts, kept apart from the dense path:

- `SparseReadPolicy`, the capability a policy implements: how many pages a step reads and a score
  per page (higher = read) from the step's queries and the pages' key bounds.
- `PageSummaries`: per page and per layer, the channel-wise max and min of its keys, kept as
  `[num_pages + 2, Hkv, 2 * D]` (max | -min) per layer slot (pages indexed like the pool), updated
  from `KVCache.store` as keys are written (a write at offset 0 starts the page afresh), copied with
  copy-on-write copies, and recomputed exactly from the pool for the pages a compaction rewrote
  (before the next step writes anything). They live beside the pool, outside its byte budget
  (1 / block_size of the keys' size).
- `SparseRead` / `SparseStep`: once per step, which batch rows are decoding (a sequence computing one
  generated token; prefill chunks, scoring requests and extends stay dense); once per layer group
  and step, their tables as tensors; once per layer, the policy's top-k pages and a reduced
  `AttentionPlan` whose table holds only those pages, in order. The page holding the newest token
  is always read and always comes last, so the reduced cache length is known on the host and both
  backends run the reduced plan unchanged (RoPE is already in the stored keys; a decode query sees
  every cache index before it, so positions inside the reduced table do not matter).

Per-step index work is tensor work once per layer (no per-token Python); the per-group tables are
built once per step. Per-KV-head selection is not possible here: a sequence's table is shared by
the KV heads of a layer, so a policy aggregates its heads into one score per page.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from kvlab.kernels.attention_plan import NULL_BLOCK, AttentionPlan, plan_paged_attention
from kvlab.kernels.reference.store_kv import dequantize_ref


class SparseReadPolicy(ABC):
    """A policy that, at decode, reads only selected pages (mix in before `Policy`)."""

    def reads_sparsely(self, layer_idx: int) -> bool:
        """Whether `layer_idx` reads selected pages at all (False: it reads densely)."""
        return True

    @abstractmethod
    def pages_read(self, block_size: int) -> int:
        """Pages one decode step reads per sequence and layer (the newest page included); raises
        ValueError when the policy's budget cannot cover that many pages of `block_size` tokens."""

    @abstractmethod
    def page_scores(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [S, Hq, D] the decode query of each sparse row (RoPE applied)
        bounds: torch.Tensor,  # [S, NB, Hkv, 2D] per page of its table: [..., :D] key max, [..., D:] -(key min); 0 where empty
        counts: torch.Tensor,  # [S, NB] int64 cached tokens in each page (0: padding or released)
        scale: float,  # the attention's logit scale
    ) -> torch.Tensor:  # [S, NB] float, higher = read; empty pages are masked and the newest page forced after
        """Importance of every page of each row's table for this step's query."""


class PageSummaries:
    """Channel-wise key max and (negated) min per page, per layer slot of the pool (kvlab.cache.kv_cache's layout).

    `bounds[s]`: [num_pages + 2, Hkv, 2 * D] with `[..., :D]` = max and `[..., D:]` = -min over the page's
    keys, so one `amax` keeps both and one matmul scores a page (q+ . max + q- . min = [q+, -q-] . bounds).
    Row `num_pages` is the null page (always zero: padding and released entries gather it); row
    `num_pages + 1` absorbs skipped writes."""

    def __init__(self, num_slots: int, num_pages: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_pages + 2, num_kv_heads, 2 * head_dim)
        self.bounds = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_slots)]
        self.block_size = block_size
        self.null_page = num_pages
        self.scratch = num_pages + 1
        self.stale: set[int] = set()  # pages a compaction rewrote: recomputed from the pool before the next step

    def update(self, slot: int, key: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key [T, Hkv, D] written at `slot_mapping` [T] (< 0: skipped) in layer slot `slot`."""
        bs, bounds = self.block_size, self.bounds[slot]
        valid = slot_mapping >= 0
        page = torch.where(valid, slot_mapping // bs, self.scratch)  # [T]
        fresh = torch.where(valid & (slot_mapping % bs == 0), page, self.scratch)  # pages a write starts afresh
        bounds.index_fill_(0, fresh, -math.inf)
        both = torch.cat([key, -key], dim=-1).to(bounds.dtype)  # [T, Hkv, 2D]
        bounds.scatter_reduce_(0, page[:, None, None].expand(both.shape), both, "amax")

    def kmax(self, slot: int) -> torch.Tensor:
        """[num_pages + 2, Hkv, D] channel-wise key maximum of every page (a view)."""
        return self.bounds[slot][..., : self.bounds[slot].shape[-1] // 2]

    def kmin(self, slot: int) -> torch.Tensor:
        """[num_pages + 2, Hkv, D] channel-wise key minimum of every page."""
        return -self.bounds[slot][..., self.bounds[slot].shape[-1] // 2 :]

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write copies page src -> dst: the summaries follow."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.bounds[0].device)
        dst = torch.tensor([d for _, d in pairs], device=src.device)
        for t in self.bounds:
            t.index_copy_(0, dst, t.index_select(0, src))
        self.stale.update(d for s, d in pairs if s in self.stale)

    def moved(self, moves: list[tuple[int, int]]) -> None:
        """Compaction moved token slots src -> dst: their destination pages must be recomputed."""
        self.stale.update(d // self.block_size for _, d in moves)

    def moved_to(self, dst: torch.Tensor) -> None:
        """Per-head compaction wrote slots `dst` [m]: their pages must be recomputed."""
        self.stale.update((dst // self.block_size).unique().tolist())

    def refresh(self, pages: list[int], counts: list[int], k_pool: list[torch.Tensor],
                k_scales: list[torch.Tensor | None]) -> None:
        """Recompute `pages` from the pool, each over its first `counts` tokens, in every layer slot."""
        if not pages:
            return
        dev = self.bounds[0].device
        p = torch.tensor(pages, dtype=torch.int64, device=dev)  # [P]
        n = torch.tensor(counts, dtype=torch.int64, device=dev)  # [P]
        held = (torch.arange(self.block_size, device=dev)[None, :] < n[:, None])[:, :, None, None]  # [P, bs, 1, 1]
        for s, (k, scale) in enumerate(zip(k_pool, k_scales)):
            keys = dequantize_ref(k.index_select(0, p), scale, self.bounds[s].dtype)  # [P, bs, Hkv, D]
            both = torch.where(held, torch.cat([keys, -keys], dim=-1), -math.inf)  # [P, bs, Hkv, 2D]
            self.bounds[s].index_copy_(0, p, both.amax(dim=1))
        self.stale.difference_update(pages)


class SparseRead:
    """The engine's sparse reader: the policy, the page summaries and what was read (set on the KVCache)."""

    def __init__(self, policy: SparseReadPolicy, cache, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.policy = policy
        self.cache = cache
        self.block_size = block_size
        self.pages = policy.pages_read(block_size)
        self.summaries = PageSummaries(len(cache.groups[0].layers), cache.null_page, block_size, num_kv_heads,
                                       head_dim, dtype, device)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.reads = 0  # (layer, sequence) decode reads that were reduced
        self.tokens_read = 0  # cache slots those reads covered
        self.tokens_cached = 0  # cache slots the same reads would have covered densely
        self.max_tokens_read = 0  # the most slots one reduced read covered

    def stats(self) -> dict:
        return {"sparse_reads": self.reads, "sparse_tokens_read": self.tokens_read,
                "sparse_tokens_cached": self.tokens_cached}

    # -- the cache's hooks -------------------------------------------------------
    def stored(self, layer: int, key: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.summaries.update(self.cache.slot_of[layer], key, slot_mapping)

    def copied(self, pairs: list[tuple[int, int]]) -> None:
        self.summaries.copy_pages(pairs)

    def moved(self, moves: list[tuple[int, int]]) -> None:
        self.summaries.moved(moves)

    def moved_to(self, dst: torch.Tensor) -> None:
        self.summaries.moved_to(dst)

    # -- once per step -----------------------------------------------------------
    def begin_step(self, seqs: list, num_new_tokens: list[int], plans: list[AttentionPlan]) -> SparseStep | None:
        """Before the step writes anything: recompute pages a compaction rewrote; then which rows decode."""
        if self.summaries.stale:
            self._refresh(plans)
        decode = [not s.is_scoring and n == 1 and s.num_computed_tokens >= s.num_prompt_tokens
                  for s, n in zip(seqs, num_new_tokens)]
        return SparseStep(self, decode) if any(decode) else None

    def _refresh(self, plans: list[AttentionPlan]) -> None:
        """Recompute the stale pages the step's tables hold, over the slots cached before the step."""
        stale, bs, cache = self.summaries.stale, self.block_size, self.cache
        for g, plan in enumerate(plans):  # plan g is layer group g's: its pages hold its layers
            pages, counts, seen = [], [], set()
            q_lens = plan.q_lens
            for b, table in enumerate(plan.block_tables):
                before = plan.seq_lens[b] - q_lens[b]
                for j, page in enumerate(table):
                    if page in stale and page not in seen:
                        seen.add(page)
                        pages.append(int(page))
                        counts.append(max(0, min(bs, before - j * bs)))
            layers = cache.groups[g].layers  # in slot order
            self.summaries.refresh(pages, counts, [cache.k(layer) for layer in layers],
                                   [(cache.scales[layer] or (None, None))[0] for layer in layers])


class _Rows:
    """One layer group's sparse rows for one step (host lists and device tensors, built once)."""

    def __init__(self, plan: AttentionPlan, decode: list[bool], pages: int, null_page: int):
        bs, dev = plan.block_size, plan.device
        tables = [list(t) for t in plan.block_tables]
        nb = [-(-n // bs) for n in plan.seq_lens]
        self.rows = [b for b, d in enumerate(decode) if d and nb[b] > pages]
        sparse = set(self.rows)
        self.empty = not self.rows
        if self.empty:
            return
        width = max(nb[b] for b in self.rows)
        entries = [[int(x) for x in tables[b][: nb[b]]] + [NULL_BLOCK] * (width - nb[b]) for b in self.rows]
        table = torch.tensor(entries, dtype=torch.int64)  # [S, NB] the rows' tables (NULL past their end)
        j = torch.arange(width)[None, :]
        n = torch.tensor([plan.seq_lens[b] for b in self.rows])[:, None]
        counts = (n - j * bs).clamp(0, bs).masked_fill(table == NULL_BLOCK, 0)  # [S, NB] cached tokens per page
        self.table = table.to(dev)
        self.summary_pages = table.masked_fill(table == NULL_BLOCK, null_page).to(dev)  # [S, NB]
        self.counts = counts.to(dev)
        self.empty_pages = (counts == 0).to(dev)  # [S, NB]
        self.last = torch.tensor([nb[b] - 1 for b in self.rows], dtype=torch.int64, device=dev)  # [S]
        self.q_index = torch.tensor([plan.cu_seqlens_q[b] for b in self.rows], dtype=torch.int64, device=dev)
        self.row_index = torch.tensor(self.rows, dtype=torch.int64, device=dev)
        # the reduced plan: `pages` pages per sparse row, the newest (partial) one last
        self.seq_lens = [(pages - 1) * bs + plan.seq_lens[b] - (nb[b] - 1) * bs if b in sparse else plan.seq_lens[b]
                         for b in range(len(tables))]
        self.width = max([pages] + [len(t) for b, t in enumerate(tables) if b not in sparse])
        self.full = torch.tensor([t[: self.width] + [NULL_BLOCK] * (self.width - len(t[: self.width]))
                                  for t in tables], dtype=torch.int64, device=dev)  # [B, W]
        self.pad = torch.full((len(self.rows), self.width - pages), NULL_BLOCK, dtype=torch.int64, device=dev)
        self.every_row = self.rows == list(range(len(tables))) and self.width == pages
        self.tokens_read = sum(self.seq_lens[b] for b in self.rows)
        self.tokens_cached = sum(plan.seq_lens[b] for b in self.rows)
        self.max_read = max(self.seq_lens[b] for b in self.rows)


class SparseStep:
    """One step's sparse reads: `plan(layer, q, plan, scale)` -> the plan that layer's attention runs."""

    def __init__(self, reader: SparseRead, decode: list[bool]):
        self.reader = reader
        self.decode = decode
        self._rows: dict[int, _Rows] = {}  # id(plan) -> rows (plans live for the step)
        self.selected: dict[int, torch.Tensor] = {}  # layer -> [S, K] table positions read (for inspection)

    def rows(self, plan: AttentionPlan) -> _Rows:
        key = id(plan)
        if key not in self._rows:
            self._rows[key] = _Rows(plan, self.decode, self.reader.pages, self.reader.summaries.null_page)
        return self._rows[key]

    def plan(self, layer: int, q: torch.Tensor, plan: AttentionPlan, scale: float) -> AttentionPlan:
        """q [T, Hq, D] this step's queries of `layer`; returns `plan` with each decoding row's table
        reduced to the pages the policy selects (rows that fit in the budget read everything)."""
        if plan.sliding_window is not None or plan.tree_mask is not None or not self.reader.policy.reads_sparsely(layer):
            return plan  # a window already bounds the read; trees (speculation) are refused at engine build
        rows = self.rows(plan)
        if rows.empty:
            return plan
        reader, k = self.reader, self.reader.pages
        bounds = reader.summaries.bounds[reader.cache.slot_of[layer]][rows.summary_pages]  # [S, NB, Hkv, 2D]
        scores = reader.policy.page_scores(layer, q.index_select(0, rows.q_index), bounds, rows.counts, scale)
        scores = scores.float().masked_fill(rows.empty_pages, -math.inf)  # [S, NB]
        scores.scatter_(1, rows.last[:, None], math.inf)  # the newest page is always read, and comes last
        chosen = scores.topk(k, dim=1).indices.sort(dim=1).values  # [S, K] table positions, ascending
        self.selected[layer] = chosen
        reduced = rows.table.gather(1, chosen)  # [S, K]
        if rows.every_row:  # all rows decode past the budget: the reduced rows are the table
            tables = reduced
        else:
            tables = rows.full.index_copy(0, rows.row_index, torch.cat([reduced, rows.pad], dim=1))  # [B, W]
        reader.reads += len(rows.rows)
        reader.tokens_read += rows.tokens_read
        reader.tokens_cached += rows.tokens_cached
        reader.max_tokens_read = max(reader.max_tokens_read, rows.max_read)
        return plan_paged_attention(plan.cu_seqlens_q, rows.seq_lens, tables, plan.block_size, None, plan.device,
                                    null_block=plan.null_block)


def check_engine(policy, config) -> None:
    """A sparse-reading policy's budget checked against the block size before any work starts (what it
    cannot run with is in kvlab/engine/capabilities.py)."""
    if not isinstance(policy, SparseReadPolicy):
        return
    policy.pages_read(config.block_size)

"""Sparse reading at decode: a policy chooses, per layer and per sequence, which pages of its table a
decode step's query reads. Nothing is evicted: the pages stay allocated and are read again whenever
a later step selects them (Quest, arXiv:2406.10774; RocketKV's second stage, arXiv:2502.14051).

Three parts, kept apart from the dense path:

- `SparseReadPolicy`, the capability a policy implements: how many pages a step reads and a score
  per page (higher = read) from the step's queries and the pages' key bounds.
- `PageSummaries`: per page and per layer, the channel-wise max and min of its keys, kept as
  `[num_pages + 2, Hkv, 2 * D]` (max | -min) per layer slot (pages indexed like the pool). A summary
  is defined in token time, over the keys of the tokens its page holds *as the model computed them*
  (the keys handed to `KVCache.store`, before any format encodes them), for every format, packed
  ones included: so it does not depend on when a packed page seals or leaves a residual window (an
  early seal, a schedule's batching), only on the page's tokens. It is updated from `store` as keys
  are written (a write at offset 0 starts the page afresh). Pages written otherwise are recomputed
  from the pool (the stored keys, dequantised) before the next step writes anything: the pages a
  compaction rewrote, and every copy-on-write copy, over the tokens the copy really holds (a prefix
  hit that ends inside a page copies tokens after the match that the request then overwrites). For
  a format that does not round, the stored keys are the computed ones, so a recomputed summary is the
  one the writes would have built; for a rounding format they differ by its rounding, which the
  declared deviation "a rounding format under a changing schedule" covers. They live beside the
  pool, outside its byte budget (1 / block_size of the keys' size).
- `SparseRead` / `SparseStep`: once per step, which batch rows are decoding (a sequence computing one
  generated token, or verifying drafts: its last token plus a chain of k drafts; prefill chunks,
  scoring requests and extends stay dense); once per layer group and step, their query rows and
  tables as tensors; once per layer, the policy's top-k pages per query row and a reduced
  `AttentionPlan` whose table holds only those pages, in order. The page holding the row's newest
  token is always read and always comes last, so the reduced cache length is known on the host and
  both backends run the reduced plan unchanged (RoPE is already in the stored keys; a decode query
  sees every cache index before it, so positions inside the reduced table do not matter).
- Verify rows: a verify step's k + 1 query rows each read exactly the pages plain decoding would
  have selected at its position. Each row becomes a row of its own in the reduced plan (one query,
  its own table and length); it scores the pages visible at its position with its own query, over
  summaries of the tokens up to its own position: the persistent summaries hold only committed keys
  (the drafts' keys are held aside as tentative, per layer) and each row folds in the tentative keys
  of its own sequence up to itself. Verification then commits the accepted drafts' keys into the
  summaries (`accept`); a rejected token leaves nothing behind.
- Token trees (SpecInfer): a node's row is defined by position, the root's cache index R plus its depth,
  with its ancestors as the tokens before it: it scores the pages visible at R + depth, its ancestors'
  tentative keys folded into the pages of their plain positions. Its nodes sit in tentative slots in
  preorder, so its reduced table is the selected pages before the root's page, then its tree's pages,
  under a tree mask that starts where the selected pages end (`AttentionPlan.tree_starts`) and shows
  what plain decoding would read there. `accept(rejected, kept)` enters the accepted path's keys at the
  slots plain decoding gives them (where `PagedKV.move_path` moves their K/V).

Per-step index work is tensor work once per layer (no per-token Python); the per-group tables are
built once per step. Per-KV-head selection is not possible here: a sequence's table is shared by
the KV heads of a layer, so a policy aggregates its heads into one score per page.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from kvlab.kernels.attention_plan import NULL_BLOCK, AttentionPlan, plan_paged_attention


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

    def copy_pages(self, pairs: list[tuple[int, int]], whole: set[int] = frozenset()) -> None:
        """Copy-on-write copies page src -> dst: the summaries follow, and each copy is recomputed from the
        pool before the next step, over the tokens it holds (a partly matching prefix hit holds fewer
        than its source: the source's summary still covers tokens after the match); a copy in `whole` holds
        every token its source holds (a kept compressed turn's page, kvlab.cache.kept_turns) and keeps the
        source's summary as it is, built from the keys as computed, as a request continuing would read it
        (unless the source's own is still to be recomputed)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.bounds[0].device)
        dst = torch.tensor([d for _, d in pairs], device=src.device)
        for t in self.bounds:
            t.index_copy_(0, dst, t.index_select(0, src))
        self.stale.update([d for s, d in pairs if d not in whole or s in self.stale])

    def moved(self, moves: list[tuple[int, int]]) -> None:
        """Compaction moved token slots src -> dst: their destination pages must be recomputed."""
        self.stale.update(d // self.block_size for _, d in moves)

    def moved_to(self, dst: torch.Tensor) -> None:
        """Per-head compaction wrote slots `dst` [m]: their pages must be recomputed."""
        self.stale.update((dst // self.block_size).unique().tolist())

    def refresh(self, pages: list[int], counts: list[int], read) -> None:
        """Recompute `pages` over their first `counts` tokens in every layer slot, from the keys
        `read(slot, token slots [N]) -> [N, Hkv, D]` returns (the pool's, dequantised)."""
        if not pages:
            return
        dev, bs = self.bounds[0].device, self.block_size
        p = torch.tensor(pages, dtype=torch.int64, device=dev)  # [P]
        n = torch.tensor(counts, dtype=torch.int64, device=dev)  # [P]
        slots = (p[:, None] * bs + torch.arange(bs, device=dev)[None, :]).view(-1)  # [P * bs]
        held = (torch.arange(bs, device=dev)[None, :] < n[:, None])[:, :, None, None]  # [P, bs, 1, 1]
        for s, bounds in enumerate(self.bounds):
            keys = read(s, slots).to(bounds.dtype).view(len(pages), bs, *bounds.shape[1:-1], -1)  # [P, bs, Hkv, D]
            both = torch.where(held, torch.cat([keys, -keys], dim=-1), -math.inf)  # [P, bs, Hkv, 2D]
            bounds.index_copy_(0, p, both.amax(dim=1).masked_fill(n[:, None, None] == 0, 0))
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
        self._tentative: torch.Tensor | None = None  # [Tp] packed tokens of this step's drafts
        # layer -> (this step's drafts' keys [Tp, Hkv, D], their slots [Tp]), until `accept`
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._drafted: list[tuple[int, int]] = []  # (seq_id, drafts) of this step's verifying sequences
        self.reset_stats()

    def reset_stats(self) -> None:
        self.reads = 0  # (layer, query row) decode reads that were reduced (a verify step: k + 1 rows a sequence)
        self.tokens_read = 0  # cache slots those reads covered
        self.tokens_cached = 0  # cache slots the same reads would have covered densely
        self.max_tokens_read = 0  # the most slots one reduced read covered

    def stats(self) -> dict:
        return {"sparse_reads": self.reads, "sparse_tokens_read": self.tokens_read,
                "sparse_tokens_cached": self.tokens_cached}

    # -- the cache's hooks -------------------------------------------------------
    def stored(self, layer: int, key: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key [T, Hkv, D] written at slot_mapping [T]: committed keys enter the summaries, a verify step's
        drafts' keys are held aside (tentative) until verification accepts them."""
        tentative = self._tentative
        if tentative is not None and tentative.numel():
            self.pending[layer] = (key.index_select(0, tentative), slot_mapping.index_select(0, tentative))
            slot_mapping = slot_mapping.index_fill(0, tentative, -1)
        self.summaries.update(self.cache.slot_of[layer], key, slot_mapping)

    def copied(self, pairs: list[tuple[int, int]], whole: set[int] = frozenset()) -> None:
        self.summaries.copy_pages(pairs, whole)

    def moved(self, moves: list[tuple[int, int]]) -> None:
        self.summaries.moved(moves)

    def moved_to(self, dst: torch.Tensor) -> None:
        self.summaries.moved_to(dst)

    # -- once per step -----------------------------------------------------------
    def begin_step(self, seqs: list, num_new_tokens: list[int], plans: list[AttentionPlan]) -> SparseStep | None:
        """Before the step writes anything: recompute pages a compaction or a copy rewrote; then which rows
        decode (one generated token, or a verify step's last token and its drafts: a chain, or a token
        tree's nodes in preorder, whose keys stay tentative until `accept`)."""
        if self.summaries.stale:
            self._refresh(plans)
        self._tentative, self.pending, self._drafted = None, {}, []
        decode = [not s.is_scoring and s.num_computed_tokens >= s.num_prompt_tokens
                  and n == 1 + len(s.draft_token_ids) for s, n in zip(seqs, num_new_tokens)]
        trees = {b: [-1] + [p + 1 for p in s.draft_parents] for b, (s, d) in enumerate(zip(seqs, decode))
                 if d and s.draft_parents}  # batch row -> parents over the root (node 0) and its nodes
        tentative, start = [], 0
        for b, (s, n, d) in enumerate(zip(seqs, num_new_tokens, decode)):
            if d and n > 1:  # packed tokens start + 1 .. start + n - 1: the drafts
                tentative += range(start + 1, start + n)
                self._drafted.append((s.seq_id, n - 1, b in trees))
            start += n
        if tentative:
            self._tentative = torch.tensor(tentative, dtype=torch.int64, device=self.summaries.bounds[0].device)
        return SparseStep(self, decode, trees) if any(decode) else None

    def accept(self, rejected: dict[int, int], kept: dict[int, list[int]] | None = None) -> None:
        """Verification ran: each verified sequence's accepted drafts enter the summaries, as plain decoding
        would have written them; rejected ones leave nothing. A chain keeps its k drafts less
        `rejected[seq_id]`; a token tree keeps the path `kept[seq_id]` = [0, n1, n2, ...] (its root's row,
        then the accepted nodes by depth: kvlab.speculation.speculator.Speculator.kept_rows), node n_j's key
        entering the summary at the slot after the root's j - 1 drafts, where plain decoding writes it (and
        `PagedKV.move_path` moves it)."""
        if self._tentative is None:
            return
        src, dst, first = [], [], 0  # into the step's tentative tokens: whose key, at whose slot
        for seq_id, k, tree in self._drafted:
            if tree:
                if kept is None or seq_id not in kept:
                    raise ValueError(f"sequence {seq_id} verified a token tree: its accepted path (kept) is needed")
                nodes = kept[seq_id][1:]
            else:
                nodes = list(range(1, k - rejected.get(seq_id, 0) + 1))
            src += [first + n - 1 for n in nodes]
            dst += [first + j for j in range(len(nodes))]
            first += k
        dev = self._tentative.device
        src_t = torch.tensor(src, dtype=torch.int64, device=dev)  # [A]
        dst_t = torch.tensor(dst, dtype=torch.int64, device=dev)  # [A]
        for layer, (key, slots) in self.pending.items():
            self.summaries.update(self.cache.slot_of[layer], key.index_select(0, src_t), slots.index_select(0, dst_t))
        self._tentative, self.pending, self._drafted = None, {}, []

    def _refresh(self, plans: list[AttentionPlan]) -> None:
        """Recompute the stale pages the step's tables hold, over the slots cached before the step."""
        stale, bs, cache = self.summaries.stale, self.block_size, self.cache
        dtype = self.summaries.bounds[0].dtype
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
            self.summaries.refresh(pages, counts, lambda s, slots: cache.read_slots(layers[s], slots, dtype)[0])


def tree_paths(parents: list[int] | None, n: int) -> list[list[int]]:
    """Each of a verify step's n rows -> the drafts it sees after its root, by depth (row i's ancestors and
    itself among nodes 1..n-1; row 0, the root, sees none): a chain's row i sees 1..i; a token tree's
    (`parents` over the root, node 0, and its nodes in preorder) its path from the root."""
    if parents is None:
        return [list(range(1, i + 1)) for i in range(n)]
    paths = [[]]
    for i in range(1, n):
        paths.append(paths[parents[i]] + [i])
    return paths


class _Rows:
    """One layer group's sparse rows for one step (host lists and device tensors, built once).

    A decoding sequence's query rows: one for a plain decode, k + 1 for a verify step (its last token,
    then its drafts). Row i is defined by the position plain decoding would give it: the root's cache
    index R plus its depth (a chain's row i: R + i; a token tree's node: R + its depth, its ancestors
    before it), and sees the cache up to there. In the reduced plan each of a verify step's rows is a row of
    its own (one query, its own table); other sequences keep their one row. A query row whose visible pages
    exceed the budget is sparse (`rows`).

    A token tree's nodes sit in tentative slots R + 1 .. R + k in preorder, not where plain decoding puts
    them, so a sparse tree row's table is the selected pages before the root's page, then its tree's pages
    from the root's on (`tail`), and a tree mask from `tree_starts` (the end of the selected pages) shows
    it, of those, what plain decoding would read: the root page's committed tokens if that page is selected,
    and each ancestor (and itself) if the page its plain position falls in is selected (`mask_rows`)."""

    def __init__(self, plan: AttentionPlan, decode: list[bool], pages: int, null_page: int,
                 pending: torch.Tensor | None, trees: dict[int, list[int]] | None = None):
        bs, dev = plan.block_size, plan.device
        trees = trees or {}
        tables = [list(t) for t in plan.block_tables]
        q_lens = plan.q_lens
        # the reduced plan's rows: (batch row, query index or None for the whole chunk), seq_len, table
        out, cu, lens, paths = [], [0], [], []
        for b, table in enumerate(tables):
            if decode[b]:
                start = plan.seq_lens[b] - q_lens[b]
                for i, path in enumerate(tree_paths(trees.get(b), q_lens[b])):
                    out.append((b, i))
                    paths.append(path)
                    lens.append(start + len(path) + 1)  # plain decoding's length at the row: R + depth + 1
                    cu.append(cu[-1] + 1)
            else:
                out.append((b, None))
                paths.append(None)
                lens.append(plan.seq_lens[b])
                cu.append(plan.cu_seqlens_q[b + 1])
        nb = [-(-n // bs) for n in lens]
        self.rows = [r for r, (b, i) in enumerate(out) if i is not None and nb[r] > pages]  # sparse, reduced rows
        self.empty = not self.rows
        if self.empty:
            return
        sparse = set(self.rows)
        width = max(nb[r] for r in self.rows)
        entries = [[int(x) for x in tables[out[r][0]][: nb[r]]] + [NULL_BLOCK] * (width - nb[r]) for r in self.rows]
        table = torch.tensor(entries, dtype=torch.int64)  # [S, NB] the rows' tables (NULL past their end)
        j = torch.arange(width)[None, :]
        n = torch.tensor([lens[r] for r in self.rows])[:, None]
        counts = (n - j * bs).clamp(0, bs).masked_fill(table == NULL_BLOCK, 0)  # [S, NB] tokens visible per page
        self.table = table.to(dev)
        self.summary_pages = table.masked_fill(table == NULL_BLOCK, null_page).to(dev)  # [S, NB]
        self.counts = counts.to(dev)
        self.empty_pages = (counts == 0).to(dev)  # [S, NB]
        self.last = torch.tensor([nb[r] - 1 for r in self.rows], dtype=torch.int64, device=dev)  # [S]
        self.q_index = torch.tensor([cu[r] for r in self.rows], dtype=torch.int64, device=dev)
        self.row_index = torch.tensor(self.rows, dtype=torch.int64, device=dev)
        self._fold(plan, decode, out, paths, q_lens, width, pending, bs, dev)
        # what plain decoding reads: `pages` pages per sparse row, the newest (partial) one last
        plain = {r: (pages - 1) * bs + lens[r] - (nb[r] - 1) * bs for r in self.rows}
        self.cu_seqlens_q = cu
        self.seq_lens = [plain[r] if r in sparse else lens[r] for r in range(len(out))]
        full = [tables[b][: nb[r]] if i is not None else tables[b] for r, (b, i) in enumerate(out)]
        tails = [[] for _ in self.rows]
        self.tree_mask = None
        if any(out[r][0] in trees for r in range(len(out)) if out[r][1] is not None):
            self._tree(plan, out, paths, trees, tables, full, tails, pages, bs, dev)
        self.width = max([pages + len(t) for t in tails] + [len(t) for r, t in enumerate(full) if r not in sparse])
        self.full = torch.tensor([t[: self.width] + [NULL_BLOCK] * (self.width - len(t[: self.width]))
                                  for t in full], dtype=torch.int64, device=dev)  # [B', W]
        self.tail = torch.tensor([t + [NULL_BLOCK] * (self.width - pages - len(t)) for t in tails],
                                 dtype=torch.int64, device=dev)  # [S, W - pages]
        self.every_row = self.rows == list(range(len(out))) and self.width == pages
        self.tokens_read = sum(plain.values())
        self.tokens_cached = sum(lens[r] for r in self.rows)
        self.max_read = max(plain.values())

    def _fold(self, plan, decode, out, paths, q_lens, width, pending, bs, dev) -> None:
        """Verify rows: which summary entries hold no committed key yet (`uncommitted` [S, NB]), and which
        tentative keys each sparse row folds in (`fold_src` [P] into the step's drafts, `fold_dst` [P]
        into the flattened [S * NB]): its own sequence's drafts up to itself (a tree node: its ancestors
        and itself), each in the page of the position plain decoding gives it."""
        self.fold_src = self.fold_dst = self.uncommitted = None
        if pending is None:
            return
        offset, first = {}, 0  # batch row -> index of its first draft among the step's tentative tokens
        for b, n in enumerate(q_lens):
            if decode[b] and n > 1:  # the order of SparseRead.begin_step's tentative tokens
                offset[b] = first
                first += n - 1
        src, dst, committed = [], [], []
        for s, r in enumerate(self.rows):
            b, i = out[r]
            start = plan.seq_lens[b] - q_lens[b]
            committed.append(start + 1)  # the sequence's last token (row 0) is committed; its drafts are not
            for depth, node in enumerate(paths[r], start=1):
                src.append(offset[b] + node - 1)
                dst.append(s * width + (start + depth) // bs)
        if not src:
            return
        self.fold_src = torch.tensor(src, dtype=torch.int64, device=dev)
        self.fold_dst = torch.tensor(dst, dtype=torch.int64, device=dev)
        c = torch.tensor(committed)[:, None]
        self.uncommitted = (torch.arange(width)[None, :] * bs >= c).to(dev)  # [S, NB]

    def _tree(self, plan, out, paths, trees, tables, full, tails, pages, bs, dev) -> None:
        """Token trees in the reduced plan: every row's tree-mask row and start (`base_mask` [T, W],
        `tree_starts`), sparse tree rows' tails (their tree's pages) and what decides each of their mask
        columns (`col_page` [St, Wt]: the table position whose selection shows it; `col_seen` [St, Wt]: it is
        the root page's committed part or an ancestor); a dense tree row reads its table up to its own slot
        under its ancestor mask, as the step's plan had it."""
        sparse = {r: s for s, r in enumerate(self.rows)}
        q_lens = plan.q_lens
        widths, starts, rows_of = [], [], []  # per reduced row: mask columns from its start; its start
        for r, (b, i) in enumerate(out):
            root = plan.seq_lens[b] - q_lens[b]
            if i is None or b not in trees:  # every key visible (the causal rule still applies)
                n = self.seq_lens[r]
                starts.append(n - (q_lens[b] if i is None else 1))
                widths.append(n - starts[-1])
                continue
            seen = set(paths[r])
            if r not in sparse:  # dense: its table up to its own tentative slot R + i, masked to its path
                full[r] = tables[b][: -(-(root + i + 1) // bs)]
                self.seq_lens[r] = root + i + 1
                starts.append(root)
                rows_of.append((r, [True] + [a in seen for a in range(1, i + 1)]))
                widths.append(i + 1)
                continue
            first, off = root // bs, root % bs  # the root's page (table position) and slot in it
            tails[sparse[r]] = tables[b][first : first + -(-(off + i + 1) // bs)]
            self.seq_lens[r] = pages * bs + off + i + 1
            starts.append(pages * bs)
            widths.append(off + i + 1)
            depth = {a: d for d, a in enumerate(paths[r], start=1)}
            cols = [(first, True)] * (off + 1) + [((root + depth[a]) // bs, True) if a in depth else (0, False)
                                                 for a in range(1, i + 1)]
            rows_of.append((r, cols))
        tokens = torch.tensor(self.cu_seqlens_q[:-1])
        mask = torch.ones(plan.num_tokens, max(widths), dtype=torch.bool)  # [T, W]
        tree_rows, col_page, col_seen = [], [], []
        wt = max([widths[r] for r, _ in rows_of if r in sparse], default=0)
        for r, cols in rows_of:
            t = int(tokens[r])
            if r in sparse:
                tree_rows.append((sparse[r], t))
                col_page.append([c for c, _ in cols] + [0] * (wt - len(cols)))
                col_seen.append([v for _, v in cols] + [False] * (wt - len(cols)))
            else:
                mask[t, : len(cols)] = torch.tensor(cols)
        self.tree_mask, self.tree_starts = mask.to(dev), starts
        self.tree_sparse = torch.tensor([s for s, _ in tree_rows], dtype=torch.int64, device=dev)  # [St] into rows
        self.tree_tokens = torch.tensor([t for _, t in tree_rows], dtype=torch.int64, device=dev)  # [St]
        self.col_page = torch.tensor(col_page, dtype=torch.int64, device=dev).view(len(tree_rows), wt)
        self.col_seen = torch.tensor(col_seen, dtype=torch.bool, device=dev).view(len(tree_rows), wt)
        root_page = torch.full((len(self.rows),), 1 << 30, dtype=torch.int64)  # [S] chain rows: never
        for s, _ in tree_rows:
            b = out[self.rows[s]][0]
            root_page[s] = (plan.seq_lens[b] - q_lens[b]) // bs
        self.root_page = root_page.to(dev)

    def mask_rows(self, chosen: torch.Tensor) -> torch.Tensor:
        """chosen [S, K] table positions each sparse row selected -> the reduced plan's tree mask [T, W]: a
        sparse tree row sees a column when it is the root page's committed part or an ancestor, and the page
        plain decoding would hold it in is selected."""
        picked = torch.zeros(self.table.shape, dtype=torch.bool, device=chosen.device)  # [S, NB]
        picked.scatter_(1, chosen, True)
        if not self.tree_tokens.numel():
            return self.tree_mask
        seen = self.col_seen & picked.index_select(0, self.tree_sparse).gather(1, self.col_page)  # [St, Wt]
        mask = self.tree_mask.clone()
        mask[self.tree_tokens, : seen.shape[1]] = seen
        return mask


class SparseStep:
    """One step's sparse reads: `plan(layer, q, plan, scale)` -> the plan that layer's attention runs."""

    def __init__(self, reader: SparseRead, decode: list[bool], trees: dict[int, list[int]] | None = None):
        self.reader = reader
        self.decode = decode
        self.trees = trees or {}  # batch row -> parents (node 0 the root) of the token tree it verifies
        self._rows: dict[int, _Rows] = {}  # id(plan) -> rows (plans live for the step)
        self.selected: dict[int, torch.Tensor] = {}  # layer -> [S, K] table positions read (for inspection)

    def rows(self, plan: AttentionPlan) -> _Rows:
        key = id(plan)
        if key not in self._rows:
            self._rows[key] = _Rows(plan, self.decode, self.reader.pages, self.reader.summaries.null_page,
                                    self.reader._tentative, self.trees)
        return self._rows[key]

    def bounds(self, layer: int, rows: _Rows) -> torch.Tensor:
        """[S, NB, Hkv, 2D] each sparse row's page summaries, over the tokens up to its own position."""
        reader = self.reader
        bounds = reader.summaries.bounds[reader.cache.slot_of[layer]][rows.summary_pages]  # [S, NB, Hkv, 2D]
        if rows.fold_src is None:
            return bounds
        key = reader.pending[layer][0].index_select(0, rows.fold_src)  # [P, Hkv, D] tentative keys folded in
        both = torch.cat([key, -key], dim=-1).to(bounds.dtype)  # [P, Hkv, 2D]
        bounds = bounds.masked_fill(rows.uncommitted[:, :, None, None], -math.inf)
        flat = bounds.view(-1, *bounds.shape[2:])  # [S * NB, Hkv, 2D]
        flat.scatter_reduce_(0, rows.fold_dst[:, None, None].expand(both.shape), both, "amax")
        return bounds.masked_fill(rows.empty_pages[:, :, None, None], 0)

    def plan(self, layer: int, q: torch.Tensor, plan: AttentionPlan, scale: float) -> AttentionPlan:
        """q [T, Hq, D] this step's queries of `layer`; returns `plan` with each decoding query row's table
        reduced to the pages the policy selects (rows that fit in the budget read everything; a token
        tree's rows under a tree mask showing what plain decoding would read)."""
        if plan.sliding_window is not None or not self.reader.policy.reads_sparsely(layer):
            return plan  # a window already bounds the read (a tree is cut to a chain where one could matter)
        rows = self.rows(plan)
        if rows.empty:
            return plan
        reader, k = self.reader, self.reader.pages
        bounds = self.bounds(layer, rows)  # [S, NB, Hkv, 2D]
        scores = reader.policy.page_scores(layer, q.index_select(0, rows.q_index), bounds, rows.counts, scale)
        scores = scores.float().masked_fill(rows.empty_pages, -math.inf)  # [S, NB]
        scores.scatter_(1, rows.last[:, None], math.inf)  # the newest page is always read, and comes last
        chosen = scores.topk(k, dim=1).indices.sort(dim=1).values  # [S, K] table positions, ascending
        self.selected[layer] = chosen
        reduced = rows.table.gather(1, chosen)  # [S, K]
        tree_mask = None
        if rows.tree_mask is not None:  # a tree row's selected pages from its root's on are read through its tail
            reduced = reduced.masked_fill(chosen >= rows.root_page[:, None], NULL_BLOCK)
            tree_mask = rows.mask_rows(chosen)
        if rows.every_row:  # all rows decode past the budget: the reduced rows are the table
            tables = reduced
        else:
            tables = rows.full.index_copy(0, rows.row_index, torch.cat([reduced, rows.tail], dim=1))  # [B', W]
        reader.reads += len(rows.rows)
        reader.tokens_read += rows.tokens_read
        reader.tokens_cached += rows.tokens_cached
        reader.max_tokens_read = max(reader.max_tokens_read, rows.max_read)
        return plan_paged_attention(rows.cu_seqlens_q, rows.seq_lens, tables, plan.block_size, None, plan.device,
                                    tree_mask=tree_mask, null_block=plan.null_block,
                                    tree_starts=None if tree_mask is None else rows.tree_starts)


def check_engine(policy, config) -> None:
    """A sparse-reading policy's budget checked against the block size before any work starts (what it
    cannot run with is in kvlab/engine/capabilities.py)."""
    if not isinstance(policy, SparseReadPolicy):
        return
    policy.pages_read(config.block_size)

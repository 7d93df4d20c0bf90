"""The packed page layout (int8 / int4 / int2, fp8 with per-token scales): PageStores and a residual window.

    k[s], v[s]:  PageStore objects (kvlab.cache.quant.page_store), a dict of page parts each
                 [num_pages + 1, *part shape] (codes, scales, zero points), plus full-precision
                 residual rows [block_size, heads, D] when the format keeps a residual window

Which page is open (its tokens in a residual row) and where its row lives is the one `ResidualArea`'s
(`area`, shared by every layer slot and both sides): with a lessor (the engine's) each row lives in
the codes of pool pages leased while its page is open (kvlab.cache.quant.lease); without one, in a
separate area of `residual_rows` rows.

Writes go through a `WritePlan` per (step, layer group), built at the group's first store of the
step and shared by its layers; the pages the step's planner says left the window are sealed then
(encoded from their rows), those no write touches as well. Leased rows go back at each step's start
and whenever a sequence's pages are freed (`release_unheld`). Copies take a row for an open copy;
compaction re-quantises the pages it writes (sealed).
"""

from __future__ import annotations

import torch

from kvlab.cache.kv_layout import PageLayout, Scales
from kvlab.cache.quant.base import QuantFormat
from kvlab.cache.quant.page_store import PageStore, ResidualArea, WritePlan, plan_write


def pages_per_row(codecs: tuple, block_size: int, heads: int, head_dim: int, residual_dtype: torch.dtype) -> int:
    """Pages whose codes hold one residual row (a page's K or V in `residual_dtype`): int4 codes
    with float32 rows, 8; 0 when the codes do not divide a row evenly (rows then need an area)."""
    row = block_size * heads * head_dim * residual_dtype.itemsize
    codes = {c.parts(block_size, heads, head_dim)["data"].nbytes for c in codecs}
    code = codes.pop() if len(codes) == 1 else 0
    return row // code if code and row % code == 0 and code % residual_dtype.itemsize == 0 else 0


class PackedLayout(PageLayout):
    def __init__(self, quant: QuantFormat, per_group: int, num_blocks: int, block_size: int, heads: int,
                 head_dim: int, compute_dtype: torch.dtype, device: torch.device | str,
                 residual_rows: int | None = None, lessor=None):
        """`per_group` layer slots of `num_blocks` pages and the null page. A residual window's rows:
        leased by `lessor` (kvlab.cache.quant.lease.PageLessor) from the pool's free pages; without one,
        `residual_rows` rows of an area of their own (default one per page)."""
        self.quant, self.block_size, self.compute_dtype = quant, block_size, compute_dtype
        self.codecs = quant.codecs(block_size, head_dim)
        self.area: ResidualArea | None = None
        if quant.residual is not None:
            self.area = self._residual_area(num_blocks, heads, head_dim, device, residual_rows, lessor)
        make = lambda codec: PageStore(codec, num_blocks + 1, block_size, heads, head_dim,  # noqa: E731
                                       self.area, quant.residual_storage_dtype(compute_dtype), device)
        self.k = [make(self.codecs[0]) for _ in range(per_group)]
        self.v = [make(self.codecs[1]) for _ in range(per_group)]
        self._step: dict[int, tuple[torch.Tensor, set[int] | None]] = {}  # group -> (slot mapping, pages to seal)
        self._plans: dict[int, WritePlan] = {}
        self._busy: set[int] = set()  # pages the step writes (never sealed early)

    def _residual_area(self, num_blocks, heads, head_dim, device, rows, lessor) -> ResidualArea:
        dtype = self.quant.residual_storage_dtype(self.compute_dtype)
        k = pages_per_row(self.codecs, self.block_size, heads, head_dim, dtype)
        if lessor is None:
            return ResidualArea(num_blocks + 1, num_blocks if rows is None else rows, device)
        if not k:
            raise ValueError(f"{type(self.quant).__name__.lower()}: a residual row ({self.block_size} tokens x "
                             f"{heads} heads x {head_dim} in {dtype}) does not fill whole pages' codes, where rows "
                             f"are leased from; use a larger block_size")
        return ResidualArea(num_blocks + 1, num_blocks // k, device, k, lessor)

    @property
    def residual(self) -> int | None:
        return self.quant.residual

    def _stores(self) -> tuple[PageStore, ...]:
        return (*self.k, *self.v)

    # -- writes ---------------------------------------------------------------
    def begin_step(self, slot_mappings: list[torch.Tensor], seal_pages: list[set[int]] | None) -> None:
        """Write plans are built at each group's first store (`_write_plan`)."""
        if self.area is not None:
            self.area.end_step()
            self.release_unheld()
        self._plans.clear()
        self._step = {g: (m, None if seal_pages is None else seal_pages[g]) for g, m in enumerate(slot_mappings)}
        if self.area is not None:
            bs = self.block_size
            self._busy = {s // bs for m in slot_mappings for s in m.tolist() if s >= 0}

    def plan_writes(self) -> None:
        """Residual rows taken or leased, pages sealed, as each group's first store would."""
        for g, (mapping, _) in list(self._step.items()):
            self._write_plan(g, mapping)

    def _write_plan(self, g: int, slot_mapping: torch.Tensor) -> WritePlan:
        """Group `g`'s plan of the step for `slot_mapping` (a mapping the step did not begin with: nothing sealed)."""
        plan = self._plans.get(g)
        step = self._step.get(g)
        if plan is None or step is None or step[0] is not slot_mapping:
            seal = step[1] if step is not None and step[0] is slot_mapping else set()
            plan = plan_write(slot_mapping.long(), self.block_size, self.codecs, self.area, seal, self._busy,
                              [*self.k, *self.v])
            if seal and self.area is not None:
                self._seal_untouched(seal, set(plan.pages.tolist()))
            self._plans[g] = plan
            self._step[g] = (slot_mapping, seal)
        return plan

    def _seal_untouched(self, seal: set[int], touched: set[int]) -> None:
        """Pages that left the window without being written this step: encode them from their rows."""
        self._seal_now({p: self.area.row(p) for p in seal - touched if self.area.row(p) >= 0})

    def release_unheld(self) -> None:
        """Leased rows go back to the pool when no sequence needs them: rows of pages sealed this step,
        and rows of open pages no table holds any more (encoded into their parts first, so a finished
        request's prefix-cached page stays findable, sealed). Called at each step's start and, by the
        engine, whenever a sequence's pages are freed (never while a step's layers are writing)."""
        if self.area is None or self.area.lessor is None:
            return
        self.area.end_step()
        self._seal_now(self.area.unheld())

    def _seal_now(self, pages: dict[int, int]) -> None:
        """Encode open pages (page -> row) from their rows and free the rows at once."""
        if not pages:
            return
        device = self.area.row_of.device
        pages_t = torch.tensor(list(pages), dtype=torch.int64, device=device)
        rows_t = torch.tensor(list(pages.values()), dtype=torch.int64, device=device)
        for store in self._stores():
            store.seal_rows(pages_t, rows_t)
        for p in pages:
            self.area.seal(p)

    def shareable(self, page: int, unowned: bool) -> bool:
        """A sealed page, or an open one (its K/V still in a full-precision residual row) that no sequence
        holds (kvlab.cache.kv_cache.KVCache.shareable)."""
        return unowned or self.area is None or self.area.row(page) < 0

    def store(self, slot: int, group: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              scales: Scales) -> None:
        """(The scales live in the pages: `scales` is unused.)"""
        plan = self._write_plan(group, slot_mapping)
        self.k[slot].write(key, plan)
        self.v[slot].write(value, plan)

    # -- reads ------------------------------------------------------------------
    def read_slots(self, slot: int, slots: torch.Tensor, dtype: torch.dtype,
                   scales: Scales) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[slot].read_slots(slots, dtype), self.v[slot].read_slots(slots, dtype)

    # -- page copies and slot moves -----------------------------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Every part of each page, and an open source's residual row into a row of the copy's own."""
        if not pairs:
            return
        device = self.k[0].device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        for store in self._stores():
            store.copy_pages(src, dst)
        if self.area is not None:
            pairs = self._hand_over_rows(pairs)
            self.release_unheld()  # before taking rows: a freed page's leased row is not taken twice
            self._copy_rows(pairs)

    def _hand_over_rows(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """An open source no table holds any more (its sequence freed it, e.g. preempted, after the copy was
        planned) gives its residual row to its copy, after encoding it into its own parts (so a prefix-cached
        page stays findable, sealed): the copy stays open in full precision, as it would have had a row of its
        own, instead of being sealed with the source by `release_unheld`. Returns the pairs left to copy."""
        unheld = self.area.unheld()
        handed, rest = {}, []
        for s, d in pairs:
            if s in unheld and s not in handed:
                handed[s] = d
            else:
                rest.append((s, d))
        if not handed:
            return pairs
        device = self.k[0].device
        pages_t = torch.tensor(list(handed), dtype=torch.int64, device=device)
        rows_t = torch.tensor([unheld[p] for p in handed], dtype=torch.int64, device=device)
        for store in self._stores():
            store.seal_rows(pages_t, rows_t)
        for s, d in handed.items():
            self.area.seal(d)
            self.area.hand_over(s, d)
        return rest

    def _copy_rows(self, pairs: list[tuple[int, int]]) -> None:
        """Each copy of an open page takes a row and gets the source's; with no free row it is sealed
        from the source's row (an early seal)."""
        device = self.k[0].device
        row_pairs = []
        for s, d in pairs:
            rs = self.area.row(s)
            self.area.seal(d)
            if rs >= 0:
                rd = self.area.take(d)
                if rd >= 0:
                    row_pairs.append((rs, rd))
                else:  # no free row: the copy is sealed from the source's residual row
                    self.area.early_seals += 1
                    for store in self._stores():
                        store.seal_rows(torch.tensor([d], device=device), torch.tensor([rs], device=device))
        if row_pairs:
            rs_t = torch.tensor([a for a, _ in row_pairs], device=device)
            rd_t = torch.tensor([b for _, b in row_pairs], device=device)
            for store in self._stores():
                store.copy_rows(rs_t, rd_t)

    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        """Reads the survivors dequantised and re-quantises the pages written (they are sealed)."""
        if not moves:
            return
        device = self.k[0].device
        src = torch.tensor([s for s, _ in moves], dtype=torch.int64, device=device)
        dst = torch.tensor([d for _, d in moves], dtype=torch.int64, device=device)
        writes = []
        for k, v in zip(self.k, self.v):
            writes += [(k, k.read_slots(src, self.compute_dtype)), (v, v.read_slots(src, self.compute_dtype))]
        self._rewrite(dst, writes)

    def move_head_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Reads every head's survivors dequantised and re-quantises the pages written (sealed)."""
        if dst.numel() == 0:
            return
        writes = []
        for store in self._stores():  # head h's survivors: [m, Hkv, D]
            per_head = [store.read_slots(src[h], self.compute_dtype)[:, h] for h in range(src.shape[0])]
            writes.append((store, torch.stack(per_head, dim=1)))
        self._rewrite(dst.long(), writes)

    def _rewrite(self, dst: torch.Tensor, writes: list[tuple[PageStore, torch.Tensor]]) -> None:
        """Each (store, x [N, Hkv, D]) -> slots dst [N] int64, every page written sealed."""
        plan = plan_write(dst, self.block_size, self.codecs, self.area, None)
        for store, x in writes:
            store.write(x, plan)
        if self.area is not None:
            self.area.end_step()

    # -- token trees: tentative slots (kvlab.cache.paged_kv.PagedKV.move_path) -------------------------
    # A tree's nodes stay where their bits can move: open pages' full-precision rows (the window counts only
    # committed tokens, kvlab.engine.attention.leaving_window), or a token-local codec's own codes and scales.
    def move_tentative(self, moves: list[tuple[int, int]]) -> None:
        """Bits kept: open page -> open page through the rows, or a token-local codec's parts slot by slot;
        with a page sealed early (no row could be leased) every move is re-quantised, as compaction does."""
        if not moves:
            return
        src, src_rows, src_off = self._tentative([s for s, _ in moves])
        dst, dst_rows, dst_off = self._tentative([d for _, d in moves])
        rows = (src_rows >= 0) & (dst_rows >= 0)
        parts = (src_rows < 0) & (dst_rows < 0) & self._token_local
        if not bool((rows | parts).all()):
            self.move_slots(moves)
            return
        for store in self._stores():  # all reads, then the writes
            tokens = store.read_row_slots(src_rows[rows], src_off[rows]) if rows.any() else None
            codes = store.read_token_parts(src[parts]) if parts.any() else None
            if tokens is not None:
                store.write_row_slots(dst_rows[rows], dst_off[rows], tokens)
            if codes is not None:
                store.write_token_parts(dst[parts], codes)

    def clear_slots(self, slots: list[int]) -> None:
        """Zeroed in open pages' rows and in a token-local codec's parts (a page sealed early keeps its codes)."""
        if not slots:
            return
        index, rows, offsets = self._tentative(slots)
        open_, parts = rows >= 0, (rows < 0) & self._token_local
        for store in self._stores():
            if open_.any():
                store.write_row_slots(rows[open_], offsets[open_], None)
            if parts.any():
                store.write_token_parts(index[parts], None)

    def seal(self, pages: set[int]) -> None:
        if self.area is not None:
            self._seal_now({p: self.area.row(p) for p in sorted(pages) if self.area.row(p) >= 0})

    @property
    def _token_local(self) -> bool:
        return all(c.token_local for c in self.codecs)

    def _tentative(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """slots -> (slots [N], residual row of each slot's page [N] (-1: sealed), offset in the page [N]) int64."""
        index = torch.tensor(slots, dtype=torch.int64, device=self.k[0].device)
        pages, offsets = index // self.block_size, index % self.block_size
        rows = self.area.row_of[pages] if self.area is not None else torch.full_like(index, -1)
        return index, rows, offsets

    # -- bytes ------------------------------------------------------------------------
    def page_tensors(self) -> list[torch.Tensor]:
        return [t for store in self._stores() for t in store.parts.values()]

    def residual_nbytes(self) -> int:
        """A residual area of its own (rows leased from the pool's pages are the pool's bytes)."""
        if self.area is None or self.area.lessor is not None:
            return 0
        return sum(s.residual.numel() * s.residual.element_size() for s in self._stores())

    def leased_pages(self) -> int:
        """Pool pages residual rows hold now (leased from the allocator's free pages)."""
        return 0 if self.area is None or self.area.lessor is None else self.area.num_leased * self.area.k

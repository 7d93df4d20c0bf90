"""The KV pool tensors: one shared page pool, plus quantisation scales per layer.

Every layer group has the same number of layers (kvlab.cache.block_manager), so the pool is stored per
layer *slot within a group*. What a page holds is the format's business (kvlab.cache.quant.base):

    element-wise formats (fp32 / bf16 / fp16, fp8 with a fixed scale):
        k[s], v[s]:     [num_pages + 1, block_size, heads, head_dim]  (storage dtype; heads = num_kv_heads,
                        or 1 where every (layer, KV head) has its own table: per-head budgets)
        scales[layer]:  (k_scale [num_kv_heads], v_scale [num_kv_heads]) float32 fixed by the configuration, or None
    packed formats (int8 / int4 / int2, fp8 with per-token scales): k[s], v[s] are PageStore objects
        (kvlab.cache.quant.page_store),
        a dict of page parts each [num_pages + 1, *part shape] (codes, scales, zero points), plus
        full-precision residual rows [block_size, heads, D] when the format keeps a residual window
        (which page is open, and where its row lives, is the one `ResidualArea`'s): with a lessor
        (the engine's) each row lives in the codes of pool pages leased while its page is open
        (kvlab.cache.quant.lease); without one, in a separate area of `residual_rows` rows.

Layer `l` of group `g` at slot `s` reads and writes page `p` at `k[s][p]`; a page belongs to one
group at a time (the block manager hands it out), so layers of different groups never meet in it.
The last page (`null_page`) stays zero: released table entries and padding point at it.
"""

from __future__ import annotations

import torch

from kvlab.cache.block_manager import LayerGroup
from kvlab.kernels import ops
from kvlab.cache.quant.base import QuantFormat
from kvlab.cache.quant.page_store import PageStore, ResidualArea, WritePlan, plan_write


def heads_per_page(groups: list[LayerGroup], num_kv_heads: int) -> int:
    """KV heads a page holds: all of them, or one where each (layer, KV head) has its own table."""
    return 1 if groups[0].head is not None else num_kv_heads


def bytes_per_block(groups: list[LayerGroup], block_size: int, num_kv_heads: int, head_dim: int,
                    quant: QuantFormat, compute_dtype: torch.dtype) -> float:
    """Bytes one page costs: K and V of `block_size` tokens for every layer (and KV head) of one group,
    with the format's scales and zero points."""
    per_token = quant.bytes_per_token(heads_per_page(groups, num_kv_heads), head_dim, block_size, compute_dtype)
    return len(groups[0].layers) * block_size * per_token


def pages_per_row(codecs: tuple, block_size: int, heads: int, head_dim: int, residual_dtype: torch.dtype) -> int:
    """Pages whose codes hold one residual row (a page's K or V in `residual_dtype`): int4 codes
    with float32 rows, 8; 0 when the codes do not divide a row evenly (rows then need an area)."""
    row = block_size * heads * head_dim * residual_dtype.itemsize
    codes = {c.parts(block_size, heads, head_dim)["data"].nbytes for c in codecs}
    code = codes.pop() if len(codes) == 1 else 0
    return row // code if code and row % code == 0 and code % residual_dtype.itemsize == 0 else 0


class KVCache:
    def __init__(self, groups: list[LayerGroup], num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, quant: QuantFormat, compute_dtype: torch.dtype, device: torch.device | str,
                 residual_rows: int | None = None, lessor=None):
        """Formats with a residual window: `lessor` (kvlab.cache.quant.lease.PageLessor) leases each open page's
        row from the pool's free pages; without one, `residual_rows` rows of an area of their own
        (default one per page)."""
        quant.check_shape(num_kv_heads, head_dim, block_size)
        self.groups = groups
        self.quant = quant
        self.block_size = block_size
        self.compute_dtype = compute_dtype
        # layer -> [(group, KV head or None for all)]: one entry, or one per KV head with per-head tables
        self.groups_of: dict[int, list[tuple[int, int | None]]] = {}
        for g, group in enumerate(groups):
            for layer in group.layers:
                self.groups_of.setdefault(layer, []).append((g, group.head))
        self.slot_of: dict[int, int] = {layer: s for group in groups for s, layer in enumerate(group.layers)}
        self.null_page = num_blocks
        per_group = len(groups[0].layers)
        heads = heads_per_page(groups, num_kv_heads)
        self.area: ResidualArea | None = None
        if quant.packed:
            self.codecs = quant.codecs(block_size, head_dim)
            if quant.residual is not None:
                self.area = self._residual_area(num_blocks, block_size, heads, head_dim, device, residual_rows, lessor)
            make = lambda codec: PageStore(codec, num_blocks + 1, block_size, heads, head_dim,  # noqa: E731
                                           self.area, quant.residual_storage_dtype(compute_dtype), device)
            self._k = [make(self.codecs[0]) for _ in range(per_group)]
            self._v = [make(self.codecs[1]) for _ in range(per_group)]
        else:
            dtype = quant.storage_dtype(compute_dtype)
            shape = (num_blocks + 1, block_size, heads, head_dim)
            self._k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(per_group)]
            self._v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(per_group)]
        self.scales = {layer: quant.init_scales(num_kv_heads, device) for layer in self.groups_of}  # fixed
        self.sparse_read = None  # kvlab.policies.sparse_read.SparseRead, set by the engine for a policy that reads
        # selected pages at decode: it keeps page key summaries from every store, copy and move
        self._step: dict[int, tuple[torch.Tensor, set[int] | None]] = {}  # group -> (slot mapping, pages to seal)
        self._plans: dict[int, WritePlan] = {}
        self._busy: set[int] = set()

    def _residual_area(self, num_blocks, block_size, heads, head_dim, device, rows, lessor) -> ResidualArea:
        dtype = self.quant.residual_storage_dtype(self.compute_dtype)
        k = pages_per_row(self.codecs, block_size, heads, head_dim, dtype)
        if lessor is None:
            return ResidualArea(num_blocks + 1, num_blocks if rows is None else rows, device)
        if not k:
            raise ValueError(f"{type(self.quant).__name__.lower()}: a residual row ({block_size} tokens x {heads} "
                             f"heads x {head_dim} in {dtype}) does not fill whole pages' codes, where rows are "
                             f"leased from; use a larger block_size")
        return ResidualArea(num_blocks + 1, num_blocks // k, device, k, lessor)

    @property
    def residual(self) -> int | None:
        """Tokens per sequence the format keeps in full precision (None: no residual area)."""
        return self.quant.residual if self.quant.packed else None

    def k(self, layer: int) -> torch.Tensor | PageStore:
        """Keys of `layer`: [num_pages + 1, block_size, Hkv, D], or a PageStore for packed formats."""
        return self._k[self.slot_of[layer]]

    def v(self, layer: int) -> torch.Tensor | PageStore:
        return self._v[self.slot_of[layer]]

    # -- writes ---------------------------------------------------------------
    def begin_step(self, slot_mappings: list[torch.Tensor], seal_pages: list[set[int]] | None = None) -> None:
        """The step's slot mapping per group and, for a residual window, the pages per group that
        leave it this step (kvlab.engine.attention.plan_step). Write plans are built at each group's first store."""
        if self.area is not None:
            self.area.end_step()
            self.release_unheld()
        self._plans.clear()
        self._step = {g: (m, None if seal_pages is None else seal_pages[g]) for g, m in enumerate(slot_mappings)}
        if self.area is not None:
            bs = self.block_size
            self._busy = {s // bs for m in slot_mappings for s in m.tolist() if s >= 0}

    def plan_writes(self) -> None:
        """Every group's write plan of the step begun, as each group's first store builds it (residual rows
        taken or leased, pages sealed), without writing K/V: what a replay without the model calls where
        the forward would store (kvlab.engine.attention.plan_step begins the step)."""
        if not self.quant.packed:
            return
        for g, (mapping, _) in list(self._step.items()):
            self._write_plan(self.groups[g].layers[0], mapping, self.groups[g].head)

    def _write_plan(self, layer: int, slot_mapping: torch.Tensor, head: int | None) -> WritePlan:
        g = next(g for g, h in self.groups_of[layer] if h == head)
        plan = self._plans.get(g)
        step = self._step.get(g)
        if plan is None or step is None or step[0] is not slot_mapping:
            seal = step[1] if step is not None and step[0] is slot_mapping else set()
            plan = plan_write(slot_mapping.long(), self.block_size, self.codecs, self.area, seal, self._busy,
                              [*self._k, *self._v])
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
        for store in (*self._k, *self._v):
            store.seal_rows(pages_t, rows_t)
        for p in pages:
            self.area.seal(p)

    def shareable(self, page: int, unowned: bool) -> bool:
        """Whether a prefix hit may share `page`: a sealed page, or an open one (its K/V still in a
        full-precision residual row) that no sequence holds. The new request's own window rule seals
        such a page at its first step if the page has left the window by then (kvlab.engine.attention.plan_step),
        as its own prefill would have; an open page another sequence holds would be sealed under it."""
        return unowned or self.area is None or self.area.row(page) < 0

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              head: int | None = None) -> None:
        """key/value [T, Hkv, D] -> their slots in `layer`'s pool (`head`: only that KV head's, into pages
        that hold one head)."""
        if self.quant.packed:
            plan = self._write_plan(layer, slot_mapping, head)
            if head is not None:
                key, value = key[:, head : head + 1], value[:, head : head + 1]  # [T, 1, D]
            self.k(layer).write(key, plan)
            self.v(layer).write(value, plan)
            return
        k_scale, v_scale = self.head_scales(layer, head)
        if head is not None:
            key, value = key[:, head : head + 1], value[:, head : head + 1]  # [T, 1, D]
        ops.store_kv(key, value, self.k(layer), self.v(layer), slot_mapping, k_scale, v_scale)
        if self.sparse_read is not None:
            self.sparse_read.stored(layer, key, slot_mapping)

    def head_scales(self, layer: int, head: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) of `layer` ([Hkv], or [1] for one KV head), or (None, None) unscaled
        (packed formats carry their scales in their pages)."""
        scales = self.scales[layer]
        if scales is None:
            return None, None
        return scales if head is None else (scales[0][head : head + 1], scales[1][head : head + 1])

    # -- reads (policies) ---------------------------------------------------------
    def read_slots(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `layer` at slots [N] int64, dequantised: ([N, Hkv, D], [N, Hkv, D]) in `dtype`."""
        if self.quant.packed:
            return self.k(layer).read_slots(slots, dtype), self.v(layer).read_slots(slots, dtype)
        from kvlab.kernels.reference.store_kv import dequantize_ref

        k_scale, v_scale = self.scales[layer] or (None, None)
        k, v = self.k(layer), self.v(layer)
        return (dequantize_ref(k.view(-1, *k.shape[2:]).index_select(0, slots), k_scale, dtype),
                dequantize_ref(v.view(-1, *v.shape[2:]).index_select(0, slots), v_scale, dtype))

    # -- page copies and slot moves -----------------------------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: page src -> page dst, in every layer slot, with its scales (and residual row)."""
        if self.sparse_read is not None:
            self.sparse_read.copied(pairs)
        if not self.quant.packed:
            self._apply(ops.copy_blocks, pairs)
            return
        if not pairs:
            return
        device = self._k[0].device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        for store in (*self._k, *self._v):
            store.copy_pages(src, dst)
        if self.area is None:
            return
        self.release_unheld()  # before taking rows: a freed page's leased row is not taken twice
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
                    for store in (*self._k, *self._v):
                        store.seal_rows(torch.tensor([d], device=device), torch.tensor([rs], device=device))
        if row_pairs:
            rs_t = torch.tensor([a for a, _ in row_pairs], device=device)
            rd_t = torch.tensor([b for _, b in row_pairs], device=device)
            for store in (*self._k, *self._v):
                store.copy_rows(rs_t, rd_t)

    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        """Compaction: token slot src -> slot dst (all reads before writes), in every layer slot.
        Packed formats re-quantise the pages written (they are sealed)."""
        if self.sparse_read is not None:
            self.sparse_read.moved(moves)
        if not self.quant.packed:
            self._apply(ops.compact_slots, moves)
            return
        if not moves:
            return
        device = self._k[0].device
        src = torch.tensor([s for s, _ in moves], dtype=torch.int64, device=device)
        dst = torch.tensor([d for _, d in moves], dtype=torch.int64, device=device)
        values = [(k.read_slots(src, self.compute_dtype), v.read_slots(src, self.compute_dtype))
                  for k, v in zip(self._k, self._v)]
        plan = plan_write(dst, self.block_size, self.codecs, self.area, None)
        for (k, v), (kx, vx) in zip(zip(self._k, self._v), values):
            k.write(kx, plan)
            v.write(vx, plan)
        if self.area is not None:
            self.area.end_step()

    def move_head_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per-head compaction: KV head h's K/V at slots src[h] ([Hkv, m]) -> slots dst ([m]), all reads
        before writes, in every layer slot (released source pages are read before anything reuses them).
        Packed formats re-quantise the pages written."""
        heads = torch.arange(src.shape[0], device=src.device)[:, None]  # [Hkv, 1]
        if self.sparse_read is not None:
            self.sparse_read.moved_to(dst)
        if not self.quant.packed:
            for pool in (*self._k, *self._v):
                flat = pool.view(-1, *pool.shape[2:])  # [slots, Hkv, D]
                flat[dst[None, :], heads] = flat[src, heads]  # [Hkv, m, D]
            return
        if dst.numel() == 0:
            return
        dtype = self.compute_dtype
        values = []
        for store in (*self._k, *self._v):  # head h's survivors: [m, Hkv, D]
            per_head = [store.read_slots(src[h], dtype)[:, h] for h in range(src.shape[0])]
            values.append(torch.stack(per_head, dim=1))
        plan = plan_write(dst.long(), self.block_size, self.codecs, self.area, None)
        for store, x in zip((*self._k, *self._v), values):
            store.write(x, plan)
        if self.area is not None:
            self.area.end_step()

    def _apply(self, op, pairs: list[tuple[int, int]]) -> None:
        """op(k, v, src [N], dst [N]) on every layer slot's pool tensors."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self._k[0].device)
        dst = torch.tensor([d for _, d in pairs], device=src.device)
        for k, v in zip(self._k, self._v):
            op(k, v, src, dst)

    # -- bytes ------------------------------------------------------------------------
    def pool_nbytes(self) -> int:
        """Bytes of the page pool tensors (every part of every page, the null page included)."""
        if self.quant.packed:
            return sum(t.numel() * t.element_size() for s in (*self._k, *self._v) for t in s.parts.values())
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))

    def residual_nbytes(self) -> int:
        """Bytes of a residual area of its own (0 without one, and where rows are leased from the pool's
        pages: those bytes are the pool's)."""
        if self.area is None or self.area.lessor is not None:
            return 0
        return sum(s.residual.numel() * s.residual.element_size() for s in (*self._k, *self._v))

    def leased_pages(self) -> int:
        """Pool pages residual rows hold now (leased from the allocator's free pages)."""
        return 0 if self.area is None or self.area.lessor is None else self.area.num_leased * self.area.k

    def nbytes(self) -> int:
        """Everything the cache holds: pool, residual area and per-layer scales."""
        scales = sum(t.numel() * t.element_size() for pair in self.scales.values() if pair for t in pair)
        return self.pool_nbytes() + self.residual_nbytes() + scales

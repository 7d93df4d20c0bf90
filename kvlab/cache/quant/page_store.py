"""Pages of a packed format (int8, int4, int2) and the full-precision residual rows beside them.

A `PageStore` holds one side (K or V) of one layer slot of the pool: the format's page parts,
each `[num_pages + 1, *part shape]`, and, when the format keeps a residual window, the storage of
its residual rows (`residual`, flat, in the residual dtype). The `ResidualArea` (shared by every
layer slot and both sides) says which page is *open* (its tokens live in a residual row, full
precision) and which is *sealed* (its tokens live quantised in the parts):

    row_of[page] >= 0   open: read the residual row
    row_of[page] == -1  sealed: decode the parts

A row is `[block_size, Hkv, D]` in `k` chunks of `chunk` elements: chunk j of row r is chunk
`lease[r, j]` of each store's `residual` (viewed `[-1, chunk]`). Two ways to hold rows:

    own     (no lessor): a separate area of `rows` rows (k = 1, lease[r] = r), paid for up front
    leased  (a lessor, kvlab.cache.quant.lease): a row lives in the codes of k pool pages leased from the
            allocator's free pages while its page is open (k = residual bytes / code bytes of a page:
            8 for int4 with fp32 rows), given back when the page is sealed; `residual` is then the
            pages' codes viewed in the residual dtype, and rows cost pages only while in use

Writes go through a `WritePlan`, built once per (step, layer group) and shared by the layers:
the pages the step touches are read (decoded, or their residual row), the new tokens written
in, and each page either sealed (encoded into the parts over the tokens up to the last one
written: later slots are stale) or kept open in its row. A page is sealed when the step's
planner says it left the residual window (kvlab.engine.attention.plan_step), when a compaction
writes it, or early, when no row can be had (the area's `early_seals` counts those).
Formats without a residual (int8) and token-local codecs write straight into their slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.quant.base import PageCodec


class ResidualArea:
    """Which pages are open, and where their residual rows live (bookkeeping; one per cache)."""

    def __init__(self, num_pages: int, rows: int, device: torch.device | str, k: int = 1, lessor=None):
        """`rows`: row ids (own rows; leased: the most that could ever be leased); `k`: chunks per row
        (pages per lease); `lessor`: kvlab.cache.quant.lease.PageLessor, or None for own rows."""
        self.rows, self.k, self.lessor = rows, k, lessor
        self.row_of = torch.full((num_pages,), -1, dtype=torch.int64, device=device)  # [num_pages + 1]
        self.lease = torch.arange(rows * k, dtype=torch.int64, device=device).view(rows, k)  # [rows, k] chunks
        self._open: dict[int, int] = {}  # page -> row
        self._free = list(range(rows - 1, -1, -1))
        self._deferred: list[int] = []  # rows of pages sealed this step, free from the next step on
        self._keys: dict[int, int] = {}  # leased row -> the lessor's key
        self.early_seals = 0
        self.leased_peak = 0  # most rows leased at once

    def row(self, page: int) -> int:
        return self._open.get(page, -1)

    def open_pages(self) -> dict[int, int]:
        return dict(self._open)

    @property
    def any_open(self) -> bool:
        return bool(self._open)

    @property
    def num_leased(self) -> int:
        return len(self._keys)

    def take(self, page: int) -> int:
        """A row for `page` (-1 when none can be had: no free row, or no pages to lease)."""
        if not self._free:
            return -1
        if self.lessor is not None:
            got = self.lessor.lease(self.k)
            if got is None:
                return -1
            key, pages = got
        row = self._free.pop()
        if self.lessor is not None:
            self._keys[row] = key
            self.lease[row] = torch.tensor(pages, dtype=torch.int64)
            self.leased_peak = max(self.leased_peak, len(self._keys))
        self._open[page] = row
        self.row_of[page] = row
        return row

    def seal(self, page: int, deferred: bool = False) -> None:
        row = self._open.pop(page, -1)
        if row < 0:
            return
        self.row_of[page] = -1
        if deferred:
            self._deferred.append(row)
        else:
            self._release(row)

    def hand_over(self, page: int, to: int) -> None:
        """Open `page`'s row becomes open `to`'s (lease and all); `page` is left sealed."""
        row = self._open.pop(page)
        self.row_of[page] = -1
        self._open[to] = row
        self.row_of[to] = row

    def row_pages(self, page: int) -> int:
        """Pool pages the leased row of open `page` holds (0: sealed, or own rows)."""
        return self.k if self.lessor is not None and page in self._open else 0

    def release(self, pages: list[int]) -> None:
        """The rows of open `pages`, which no table holds any more (a dropped kept turn's, kvlab.cache.kept_turns),
        go back now, their contents unencoded: a freed page is written afresh before anything reads it. A page
        a pending copy still reads keeps its row (the copy takes it over, PackedLayout.copy_blocks)."""
        held = self.lessor.held() if self.lessor is not None else lambda page: False
        for page in pages:
            if not held(page):
                self.seal(page)

    def _release(self, row: int) -> None:
        key = self._keys.pop(row, None)
        if key is not None:
            self.lessor.give_back(key)
        self._free.append(row)

    def end_step(self) -> None:
        """Rows of pages sealed during the step become free (leased pages go back to the allocator)."""
        for row in self._deferred:
            self._release(row)
        self._deferred.clear()

    def unheld(self) -> dict[int, int]:
        """Open pages no table holds any more (their sequence finished or was preempted): page -> row.
        Leased rows only (own rows stay with their page until it is written again)."""
        if self.lessor is None or not self._open:
            return {}
        held = self.lessor.held()
        return {p: r for p, r in self._open.items() if not held(p)}


@dataclass
class WritePlan:
    """Where one write's tokens go, shared by every layer of a group (built by kvlab.cache.packed_layout)."""

    slots: torch.Tensor  # [N] int64 slots written (padding dropped)
    keep: torch.Tensor | None  # [T] bool rows of the input that are written (None: all)
    pages: torch.Tensor  # [P] int64 distinct pages touched
    index: torch.Tensor  # [N] int64 flat position (page row * bs + offset) of each token in the page buffer
    valid: torch.Tensor  # [P, bs] bool slots holding data after the write (up to the last written)
    old_rows: torch.Tensor  # [P] int64 residual row holding the page's contents before (-1: decode parts)
    new_rows: torch.Tensor  # [P] int64 residual row after the write (-1: encode into the parts)
    direct: bool = False  # token-local codec, no residual: scatter encoded tokens into their slots


class PageStore:
    """One side (K or V) of one layer slot of a packed format."""

    def __init__(self, codec: PageCodec, num_pages: int, block_size: int, num_kv_heads: int, head_dim: int,
                 area: ResidualArea | None, residual_dtype: torch.dtype, device: torch.device | str):
        self.codec = codec
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self.parts = {name: torch.zeros((num_pages, *spec.shape), dtype=spec.dtype, device=device)
                      for name, spec in codec.parts(block_size, num_kv_heads, head_dim).items()}
        self.area = area
        self.residual: torch.Tensor | None = None  # flat residual storage, viewed [-1, chunk] (module docstring)
        if area is not None:
            row = block_size * num_kv_heads * head_dim
            if area.lessor is None:
                self.residual = torch.zeros(area.rows * row, dtype=residual_dtype, device=device)
            else:  # rows live in leased pages' codes
                self.residual = self.parts["data"].view(-1).view(residual_dtype)
            self.chunk = row // area.k  # elements of one chunk
            page_bytes = self.parts["data"][0].numel() * self.parts["data"].element_size()
            if self.chunk * area.k != row or (area.lessor is not None
                                              and self.chunk * self.residual.element_size() != page_bytes):
                raise ValueError(f"a residual row of {row} elements does not split into {area.k} chunks of "
                                 f"one page's codes ({page_bytes} bytes)")

    # -- what the attention backends see -------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical pool shape [num_pages + 1, block_size, Hkv, D]."""
        return (next(iter(self.parts.values())).shape[0], self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts.values())).device

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor with storage of its own (leased rows live in the parts)."""
        own = self.residual is not None and self.area.lessor is None
        return [*self.parts.values(), *([self.residual] if own else [])]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N] int64 -> [N, bs, Hkv, D] residual rows (residual dtype)."""
        chunks = self.area.lease.index_select(0, rows).view(-1)  # [N * k]
        x = self.residual.view(-1, self.chunk).index_select(0, chunks)  # [N * k, chunk]
        return x.view(rows.numel(), self.block_size, self.num_kv_heads, self.head_dim)

    def write_rows(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """x [N, bs, Hkv, D] -> residual rows [N] int64."""
        chunks = self.area.lease.index_select(0, rows).view(-1)  # [N * k]
        self.residual.view(-1, self.chunk)[chunks] = x.reshape(-1, self.chunk).to(self.residual.dtype)

    # -- reads ------------------------------------------------------------------
    def read_pages(self, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """pages [N] int64 -> [N, bs, Hkv, D] in `dtype` (open pages from their residual rows)."""
        x = self.codec.decode({name: t.index_select(0, pages) for name, t in self.parts.items()}, dtype)
        if self.area is not None and self.area.any_open:
            rows = self.area.row_of.index_select(0, pages)  # [N]
            open_ = (rows >= 0).nonzero().view(-1)
            if open_.numel():
                x[open_] = self.read_rows(rows[open_]).to(dtype)
        return x

    def read_slots(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """slots [N] int64 -> [N, Hkv, D] in `dtype`."""
        bs = self.block_size
        pages, inv = torch.unique(slots // bs, return_inverse=True)
        x = self.read_pages(pages, dtype).view(-1, self.num_kv_heads, self.head_dim)
        return x.index_select(0, inv * bs + slots % bs)

    def steps_at(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [N] int64 -> [N, Hkv, D] float32 quantisation step of each element read there
        (0 in open pages, which hold the exact values)."""
        bs = self.block_size
        pages, inv = torch.unique(slots // bs, return_inverse=True)
        steps = self.codec.steps({name: t.index_select(0, pages) for name, t in self.parts.items()})
        if self.area is not None:
            steps = steps * (self.area.row_of.index_select(0, pages) < 0).float()[:, None, None, None]
        return steps.reshape(-1, self.num_kv_heads, self.head_dim).index_select(0, inv * bs + slots % bs)

    # -- writes ---------------------------------------------------------------
    def write(self, x: torch.Tensor, plan: WritePlan) -> None:
        """x [T, Hkv, D] (compute dtype) -> the slots of `plan`."""
        if plan.keep is not None:
            x = x[plan.keep]
        if plan.slots.numel() == 0:
            return
        if plan.direct:
            for name, t in self.codec.encode_tokens(x.float()).items():
                self.parts[name].view(-1, *t.shape[1:])[plan.slots] = t
            return
        P, bs = plan.pages.shape[0], self.block_size
        buf = torch.empty(P, bs, self.num_kv_heads, self.head_dim, dtype=torch.float32, device=x.device)
        from_parts = (plan.old_rows < 0).nonzero().view(-1)
        if from_parts.numel():
            pages = plan.pages[from_parts]
            buf[from_parts] = self.codec.decode({n: t.index_select(0, pages) for n, t in self.parts.items()},
                                                torch.float32)
        from_rows = (plan.old_rows >= 0).nonzero().view(-1)
        if from_rows.numel():
            buf[from_rows] = self.read_rows(plan.old_rows[from_rows]).float()
        buf.view(P * bs, self.num_kv_heads, self.head_dim)[plan.index] = x.float()
        sealed = (plan.new_rows < 0).nonzero().view(-1)
        if sealed.numel():
            parts = self.codec.encode(buf[sealed], plan.valid[sealed])
            pages = plan.pages[sealed]
            for name, t in parts.items():
                self.parts[name][pages] = t
        kept = (plan.new_rows >= 0).nonzero().view(-1)
        if kept.numel():
            self.write_rows(plan.new_rows[kept], buf[kept])

    def seal_rows(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """Encode open pages [N] from their residual rows [N] into the parts (all their slots)."""
        buf = self.read_rows(rows).float()  # [N, bs, Hkv, D]
        valid = torch.ones(buf.shape[:2], dtype=torch.bool, device=buf.device)
        for name, t in self.codec.encode(buf, valid).items():
            self.parts[name][pages] = t

    # -- token trees: tentative slots, bit for bit (kvlab.cache.packed_layout.PackedLayout.move_tentative) --
    def read_row_slots(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Tokens of open pages: rows [N], offsets [N] int64 -> [N, Hkv, D] in the residual dtype."""
        return self.read_rows(rows)[torch.arange(rows.numel(), device=rows.device), offsets]

    def write_row_slots(self, rows: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor | None) -> None:
        """x [N, Hkv, D] (residual dtype; None: zeros) -> offsets [N] of residual rows [N]; the rows' other
        tokens kept."""
        unique, inv = torch.unique(rows, return_inverse=True)
        buf = self.read_rows(unique)  # [R, bs, Hkv, D]
        buf[inv, offsets] = 0 if x is None else x
        self.write_rows(unique, buf)

    def read_token_parts(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """A token-local codec's parts of token slots [N] int64 -> name -> [N, ...]."""
        return {name: t.view(-1, *t.shape[2:]).index_select(0, slots) for name, t in self.parts.items()}

    def write_token_parts(self, slots: torch.Tensor, parts: dict[str, torch.Tensor] | None) -> None:
        """name -> [N, ...] (None: zeros) -> token slots [N] int64 of a token-local codec's parts."""
        for name, t in self.parts.items():
            t.view(-1, *t.shape[2:])[slots] = 0 if parts is None else parts[name]

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self.parts.values():
            t[dst] = t[src]

    def copy_rows(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        self.write_rows(dst_rows, self.read_rows(src_rows))


def plan_write(slot_mapping: torch.Tensor, block_size: int, codecs: tuple[PageCodec, PageCodec],
               area: ResidualArea | None, seal: set[int] | None, busy: set[int] | None = None,
               stores: list[PageStore] | None = None) -> WritePlan:
    """The plan of one write: slot_mapping [T] int64 (< 0 skips). Pages in `seal` (all of them
    when None) are encoded; the others stay or become open. With no free row, open pages not in
    `busy` (the step's pages) are sealed early from `stores`; failing that, the page is sealed."""
    keep = slot_mapping >= 0
    all_kept = bool(keep.all())
    slots = slot_mapping if all_kept else slot_mapping[keep]
    keep = None if all_kept else keep
    if area is None and all(c.token_local for c in codecs):
        empty = slots.new_empty(0)
        return WritePlan(slots, keep, empty, empty, empty.bool(), empty, empty, direct=True)
    pages, inv = torch.unique(slots // block_size, return_inverse=True)
    offsets = slots % block_size
    last = torch.full_like(pages, -1).scatter_reduce(0, inv, offsets, reduce="amax")  # [P]
    valid = torch.arange(block_size, device=slots.device)[None, :] <= last[:, None]  # [P, bs]
    old_rows, new_rows = [], []
    for page in pages.tolist():
        old = area.row(page) if area is not None else -1
        if area is None or seal is None or page in seal:
            new = -1
            if old >= 0:
                area.seal(page, deferred=True)  # its row is read by the group's other layers this step
        elif old >= 0:
            new = old
        else:
            new = area.take(page)
            if new < 0 and stores is not None:
                seal_early(area, busy or set(), stores)
                new = area.take(page)
            if new < 0:
                area.early_seals += 1
        old_rows.append(old)
        new_rows.append(new)
    as_t = lambda rows: torch.tensor(rows, dtype=torch.int64, device=slots.device)  # noqa: E731
    return WritePlan(slots, keep, pages, inv * block_size + offsets, valid, as_t(old_rows), as_t(new_rows))


def seal_early(area: ResidualArea, busy: set[int], stores: list[PageStore]) -> None:
    """Free rows by sealing every open page the current step does not touch."""
    victims = {p: r for p, r in area.open_pages().items() if p not in busy}
    if not victims:
        return
    device = area.row_of.device
    pages = torch.tensor(list(victims), dtype=torch.int64, device=device)
    rows = torch.tensor(list(victims.values()), dtype=torch.int64, device=device)
    for store in stores:
        store.seal_rows(pages, rows)
    for p in victims:
        area.seal(p)
    area.early_seals += len(victims)

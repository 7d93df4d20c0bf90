"""A pool page as one row of bytes: the fast copies between the pool and the tiers below it.

The pool keeps one tensor per (layer slot, side) (`KVCache.page_tensors()`, `[num_pages + 1, ...]` each; a packed
format's codes, scales and zero points), so a page is ~60 separate slices on SmolLM2. A tier holds a page as one
contiguous row of `row_bytes` bytes, each part at a fixed offset (aligned to `ALIGN` bytes so every part's dtype
can be viewed in place). Where the pool's tensors are views of one allocation (`KVCache.page_block()`: the
element-wise formats), a row is exactly `block[:, page]` and a page moves in one copy (a run: one copy a page;
an `index_select` over the block's page dimension measured ~30x slower); otherwise in one copy per pool tensor, whatever the number
of pages (one batched `torch._foreach_copy_` for a page, an `index_select` / `index_copy_` per tensor for a run),
never a copy per (page, tensor). A disk page is one file write / read of its row. (Python-side tensor indexing
costs ~5 us a view on this machine's CPU: 60 views a page were most of the earlier per-slice moves.)
"""

from __future__ import annotations

import torch

ALIGN = 64


class PageRows:
    """Offsets of each pool tensor's page slice in a row; gather pool pages into rows, scatter rows into pages."""

    def __init__(self, tensors: list[torch.Tensor], block: torch.Tensor | None = None):
        self.tensors = tensors
        self.offsets, self.sizes, offset = [], [], 0
        for t in tensors:
            n = t[0].numel() * t.element_size()
            self.offsets.append(offset)
            self.sizes.append(n)
            offset += -(-n // ALIGN) * ALIGN
        self.row_bytes = offset
        self.nbytes = sum(self.sizes)  # bytes of page data in a row (padding excluded)
        # [tensors, num_pages + 1, elements]: a row is block[:, page] laid end to end (no padding between parts)
        self.block = block if block is not None and self.nbytes == self.row_bytes else None

    def _flat(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` ([n, row_bytes] uint8) as [n, tensors, elements] in the block's dtype."""
        b = self.block
        return rows.view(b.dtype).view(rows.shape[0], b.shape[0], b.shape[2])

    def empty(self, n: int, pin: bool = False) -> torch.Tensor:
        """`n` rows of host memory, [n, row_bytes] uint8."""
        return torch.empty((n, self.row_bytes), dtype=torch.uint8, pin_memory=pin)

    def views(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Each pool tensor's part of `rows` ([n, row_bytes] uint8), as [n, *page shape] in its dtype (strided)."""
        out = []
        for t, off, n in zip(self.tensors, self.offsets, self.sizes):
            out.append(rows[:, off:off + n].view(t.dtype).view(rows.shape[0], *t.shape[1:]))
        return out

    def gather(self, pages: list[int], rows: torch.Tensor, views: list[torch.Tensor] | None = None) -> None:
        """Pool `pages` -> `rows` ([len(pages), row_bytes]; `views`: its `views`, if kept)."""
        if self.block is not None:  # one copy a page (an index_select over dim 1 is ~30x slower on CPU)
            flat = self._flat(rows)
            for i, page in enumerate(pages):
                flat[i].copy_(self.block[:, page])
            return
        views = self.views(rows) if views is None else views
        if len(pages) == 1:
            p = pages[0]
            torch._foreach_copy_([v[0] for v in views], [t[p] for t in self.tensors])
            return
        index = torch.tensor(pages, dtype=torch.long, device=self.tensors[0].device)
        torch._foreach_copy_(views, [t.index_select(0, index) for t in self.tensors])

    def scatter(self, rows: torch.Tensor, pages: list[int], views: list[torch.Tensor] | None = None) -> None:
        """`rows` ([len(pages), row_bytes]) -> pool `pages`, bit for bit."""
        if self.block is not None:
            flat = self._flat(rows)
            for i, page in enumerate(pages):
                self.block[:, page].copy_(flat[i])
            return
        views = self.views(rows) if views is None else views
        if len(pages) == 1:
            p = pages[0]
            torch._foreach_copy_([t[p] for t in self.tensors], [v[0] for v in views])
            return
        index = torch.tensor(pages, dtype=torch.long, device=self.tensors[0].device)
        for t, v in zip(self.tensors, views):
            t.index_copy_(0, index, v.to(t.device))

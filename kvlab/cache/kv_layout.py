"""The page layout interface: how one pool stores a page's K and V for every layer slot of a group.

`KVCache` (kvlab.cache.kv_cache) keeps what every format shares (the layer groups, which layer is
at which slot, the null page, per-layer scales, the sparse-read hooks) and hands the pool tensors to
one `PageLayout`, chosen once from the format:

    DenseLayout   (kvlab.cache.dense_layout)   element-wise formats: one tensor per side and slot
    PackedLayout  (kvlab.cache.packed_layout)  packed formats: a PageStore per side and slot, write
                                               plans, a residual window and its sealing

A layout indexes its pools by layer *slot within a group* `s` (every group has as many layers), and
its pages by page id `p` in `[0, num_pages]` (the last one is the cache's null page). Slots and pages
are plain ints, token slots `p * block_size + offset`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvlab.cache.quant.base import PageCodec
    from kvlab.cache.quant.page_store import PageStore, ResidualArea

Scales = tuple["torch.Tensor | None", "torch.Tensor | None"]  # (k_scale, v_scale) [heads] float32, or None


class PageLayout(ABC):
    """One layout of the pool's pages (module docstring). `k[s]`, `v[s]`: keys and values of layer slot `s`."""

    k: list[torch.Tensor | PageStore]
    v: list[torch.Tensor | PageStore]
    area: ResidualArea | None = None  # which pages are open in a residual window (None: no window)
    codecs: tuple[PageCodec, PageCodec] | None = None  # (key, value) codecs of packed pages (None: element-wise)

    @property
    def residual(self) -> int | None:
        """Tokens per sequence kept in full precision (None: no residual window)."""
        return None

    # -- writes ---------------------------------------------------------------
    def begin_step(self, slot_mappings: list[torch.Tensor], seal_pages: list[set[int]] | None) -> None:
        """A step begins: its slot mapping per group and the pages per group that leave the window."""

    def plan_writes(self) -> None:
        """Every group's write bookkeeping of the step begun, without writing K/V."""

    def release_unheld(self) -> None:
        """Give back what pages no sequence holds keep beside the pool (leased residual rows)."""

    def shareable(self, page: int, unowned: bool) -> bool:
        """Whether a prefix hit may share `page` (`unowned`: no sequence holds it)."""
        return True

    @abstractmethod
    def store(self, slot: int, group: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              scales: Scales) -> None:
        """key/value [T, heads, D] (compute dtype) -> their token slots [T] (< 0 skips) in layer slot `slot`
        of layer group `group`, with the layer's (k_scale, v_scale) [heads]."""

    # -- reads ------------------------------------------------------------------
    @abstractmethod
    def read_slots(self, slot: int, slots: torch.Tensor, dtype: torch.dtype,
                   scales: Scales) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer slot `slot` at token slots [N] int64: ([N, heads, D], [N, heads, D]) in `dtype`."""

    # -- page copies and slot moves -----------------------------------------------
    @abstractmethod
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: page src -> page dst, in every layer slot."""

    @abstractmethod
    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        """Compaction: token slot src -> slot dst (all reads before writes), in every layer slot."""

    @abstractmethod
    def move_head_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per-head compaction: KV head h's K/V at slots src[h] ([Hkv, m]) -> slots dst ([m]), all reads
        before writes, in every layer slot."""

    # -- token trees: tentative slots ------------------------------------------------
    def move_tentative(self, moves: list[tuple[int, int]]) -> None:
        """A token tree's accepted path: tentative slot src -> slot dst, every bit as it was written (all reads
        before writes), in every layer slot. Element-wise pools copy bits anyway."""
        self.move_slots(moves)

    @abstractmethod
    def clear_slots(self, slots: list[int]) -> None:
        """A token tree's rejected nodes: token slots zeroed in every layer slot (nothing of them is kept)."""

    def seal(self, pages: set[int]) -> None:
        """Open pages that left the residual window once a tree's path is in place: encoded now (no window: none)."""

    # -- bytes ------------------------------------------------------------------------
    @abstractmethod
    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by page, `[num_pages + 1, ...]`, of every layer slot, K before V."""

    def page_block(self) -> torch.Tensor | None:
        """Every page tensor as one view `[num_tensors, num_pages + 1, page_elements]` (in `page_tensors` order),
        where they share one allocation: a page across every layer is `block[:, page]`, moved as one copy (the
        tiers below the pool, kvlab.cache.tiers.rows). None where they do not."""
        return None

    def pool_nbytes(self) -> int:
        """Bytes of the page pool tensors (every part of every page, the null page included)."""
        return sum(t.numel() * t.element_size() for t in self.page_tensors())

    def residual_nbytes(self) -> int:
        """Bytes of a residual area of its own (0 without one, or where its rows are the pool's pages)."""
        return 0

    def leased_pages(self) -> int:
        """Pool pages residual rows hold now."""
        return 0

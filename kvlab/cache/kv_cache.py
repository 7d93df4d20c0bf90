"""The KV pool: one shared page pool in a page layout, plus quantisation scales per layer.

Every layer group has the same number of layers (kvlab.cache.block_manager), so the pool is stored per
layer *slot within a group*. What a page holds is the format's business (kvlab.cache.quant.base); how
the pool holds it is the page layout's (kvlab.cache.kv_layout), chosen once from the format:

    element-wise formats (fp32 / bf16 / fp16, fp8 with a fixed scale): kvlab.cache.dense_layout
        k[s], v[s]:     [num_pages + 1, block_size, heads, head_dim]  (storage dtype; heads = num_kv_heads,
                        or 1 where every (layer, KV head) has its own table: per-head budgets)
        scales[layer]:  (k_scale [num_kv_heads], v_scale [num_kv_heads]) float32 fixed by the configuration, or None
    packed formats (int8 / int4 / int2, fp8 with per-token scales): kvlab.cache.packed_layout
        k[s], v[s]:     PageStore objects (kvlab.cache.quant.page_store), page parts each [num_pages + 1, *part
                        shape] (codes, scales, zero points), plus full-precision residual rows when the
                        format keeps a residual window (which page is open, and where its row lives, is the
                        one `ResidualArea`'s, `area`: leased pool pages, or an area of its own)

Layer `l` of group `g` at slot `s` reads and writes page `p` at `k[s][p]`; a page belongs to one
group at a time (the block manager hands it out), so layers of different groups never meet in it.
The last page (`null_page`) stays zero: released table entries and padding point at it.
"""

from __future__ import annotations

import torch

from kvlab.cache.block_manager import LayerGroup
from kvlab.cache.dense_layout import DenseLayout
from kvlab.cache.kv_layout import PageLayout
from kvlab.cache.packed_layout import PackedLayout
from kvlab.cache.quant.base import PageCodec, QuantFormat
from kvlab.cache.quant.page_store import PageStore, ResidualArea


def heads_per_page(groups: list[LayerGroup], num_kv_heads: int) -> int:
    """KV heads a page holds: all of them, or one where each (layer, KV head) has its own table."""
    return 1 if groups[0].head is not None else num_kv_heads


def bytes_per_block(groups: list[LayerGroup], block_size: int, num_kv_heads: int, head_dim: int,
                    quant: QuantFormat, compute_dtype: torch.dtype) -> float:
    """Bytes one page costs: K and V of `block_size` tokens for every layer (and KV head) of one group,
    with the format's scales and zero points."""
    per_token = quant.bytes_per_token(heads_per_page(groups, num_kv_heads), head_dim, block_size, compute_dtype)
    return len(groups[0].layers) * block_size * per_token


class KVCache:
    def __init__(self, groups: list[LayerGroup], num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, quant: QuantFormat, compute_dtype: torch.dtype, device: torch.device | str,
                 residual_rows: int | None = None, lessor=None, scratch_pages: int = 0):
        """`scratch_pages`: pages after the pool's `num_blocks` that no table of the block manager holds (a
        self-speculating draft's tentative K/V, kvlab/speculation/drafts/self_compressed.py). Formats with a residual window: `lessor` (kvlab.cache.quant.lease.PageLessor) leases each open page's
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
        self.scratch_pages = range(num_blocks, num_blocks + scratch_pages)
        num_blocks += scratch_pages
        self.null_page = num_blocks
        pool = (quant, len(groups[0].layers), num_blocks, block_size, heads_per_page(groups, num_kv_heads),
                head_dim, compute_dtype, device)
        self.layout: PageLayout = (PackedLayout(*pool, residual_rows, lessor) if quant.packed
                                   else DenseLayout(*pool))
        self.scales = {layer: quant.init_scales(num_kv_heads, device) for layer in self.groups_of}  # fixed
        self.sparse_read = None  # kvlab.policies.sparse_read.SparseRead, set by the engine for a policy that reads
        # selected pages at decode: it keeps page key summaries from every store, copy and move

    @property
    def area(self) -> ResidualArea | None:
        """Which pages are open in the residual window, and where their rows live (None: no window)."""
        return self.layout.area

    @property
    def codecs(self) -> tuple[PageCodec, PageCodec] | None:
        """(key codec, value codec) of a packed format (None for element-wise formats)."""
        return self.layout.codecs

    @property
    def residual(self) -> int | None:
        """Tokens per sequence the format keeps in full precision (None: no residual area)."""
        return self.layout.residual

    def k(self, layer: int) -> torch.Tensor | PageStore:
        """Keys of `layer`: [num_pages + 1, block_size, Hkv, D], or a PageStore for packed formats."""
        return self.layout.k[self.slot_of[layer]]

    def v(self, layer: int) -> torch.Tensor | PageStore:
        return self.layout.v[self.slot_of[layer]]

    def page_tensors(self) -> list[torch.Tensor]:
        """Every pool tensor indexed by page, [num_pages + 1, ...], of every layer slot, keys first: one per
        side and slot for element-wise formats, each PageStore's parts for packed ones."""
        return self.layout.page_tensors()

    def page_block(self) -> torch.Tensor | None:
        """The page tensors as one `[num_tensors, num_pages + 1, page_elements]` view, where they share one
        allocation (element-wise formats); None otherwise (kvlab.cache.kv_layout.PageLayout.page_block)."""
        return self.layout.page_block()

    # -- writes ---------------------------------------------------------------
    def begin_step(self, slot_mappings: list[torch.Tensor], seal_pages: list[set[int]] | None = None) -> None:
        """The step's slot mapping per group and, for a residual window, the pages per group that
        leave it this step (kvlab.engine.attention.plan_step). Write plans are built at each group's first store."""
        self.layout.begin_step(slot_mappings, seal_pages)

    def plan_writes(self) -> None:
        """Every group's write plan of the step begun, as each group's first store builds it (residual rows
        taken or leased, pages sealed), without writing K/V: what a replay without the model calls where
        the forward would store (kvlab.engine.attention.plan_step begins the step)."""
        self.layout.plan_writes()

    def release_unheld(self) -> None:
        """Leased rows go back to the pool when no sequence needs them (kvlab.cache.packed_layout): called
        at each step's start and, by the engine, whenever a sequence's pages are freed (never while a
        step's layers are writing)."""
        self.layout.release_unheld()

    def shareable(self, page: int, unowned: bool) -> bool:
        """Whether a prefix hit may share `page`: a sealed page, or an open one (its K/V still in a
        full-precision residual row) that no sequence holds. The new request's own window rule seals
        such a page at its first step if the page has left the window by then (kvlab.engine.attention.plan_step),
        as its own prefill would have; an open page another sequence holds would be sealed under it."""
        return self.layout.shareable(page, unowned)

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              head: int | None = None) -> None:
        """key/value [T, Hkv, D] -> their slots in `layer`'s pool (`head`: only that KV head's, into pages
        that hold one head)."""
        group = next(g for g, h in self.groups_of[layer] if h == head)
        scales = self.head_scales(layer, head)
        if head is not None:
            key, value = key[:, head : head + 1], value[:, head : head + 1]  # [T, 1, D]
        self.layout.store(self.slot_of[layer], group, key, value, slot_mapping, scales)
        if self.sparse_read is not None:  # page key summaries, from the keys as computed (every format)
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
        return self.layout.read_slots(self.slot_of[layer], slots, dtype, self.scales[layer] or (None, None))

    # -- page copies and slot moves -----------------------------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]], whole: set[int] = frozenset()) -> None:
        """Copy-on-write: page src -> page dst, in every layer slot, with its scales (and residual row). `whole`:
        destinations that hold every token their source holds (their page summaries are copied as they are)."""
        if self.sparse_read is not None:
            self.sparse_read.copied(pairs, whole)
        self.layout.copy_blocks(pairs)

    def copy_scratch(self, pairs: list[tuple[int, int]]) -> None:
        """Page src (the pool's) -> scratch page dst, in every layer slot (element-wise formats): what a draft
        reads besides the pool's pages. Nothing of the pool changes, so page summaries are not told."""
        if any(d not in self.scratch_pages for _, d in pairs):
            raise ValueError("copy_scratch writes scratch pages only")
        self.layout.copy_blocks(pairs)

    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        """Compaction: token slot src -> slot dst (all reads before writes), in every layer slot.
        Packed formats re-quantise the pages written (they are sealed)."""
        if self.sparse_read is not None:
            self.sparse_read.moved(moves)
        self.layout.move_slots(moves)

    def move_head_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per-head compaction: KV head h's K/V at slots src[h] ([Hkv, m]) -> slots dst ([m]), all reads
        before writes, in every layer slot (released source pages are read before anything reuses them).
        Packed formats re-quantise the pages written."""
        if self.sparse_read is not None:
            self.sparse_read.moved_to(dst)
        self.layout.move_head_slots(src, dst)

    # -- token trees: tentative slots (kvlab.cache.paged_kv.PagedKV.move_path) -------------------
    def move_tentative(self, moves: list[tuple[int, int]]) -> None:
        """A tree's accepted path: tentative slot src -> slot dst, every bit as written (packed pages: in open
        pages' full-precision rows, or a token-local codec's codes and scales), all reads before writes. Page
        summaries are not told: a sparse read's `accept` enters the path's keys, as computed, at `dst`."""
        if not moves:
            return
        self.layout.move_tentative(moves)

    def clear_slots(self, slots: list[int]) -> None:
        """A tree's rejected nodes: their token slots zeroed in every layer slot (rows and codes alike)."""
        self.layout.clear_slots(slots)

    def seal(self, pages: set[int]) -> None:
        """Open pages that left the residual window once a tree's path is in place: encoded from their rows now."""
        self.layout.seal(pages)

    # -- bytes ------------------------------------------------------------------------
    def pool_nbytes(self) -> int:
        """Bytes of the page pool tensors (every part of every page, the null page included)."""
        return self.layout.pool_nbytes()

    def residual_nbytes(self) -> int:
        """Bytes of a residual area of its own (0 without one, and where rows are leased from the pool's
        pages: those bytes are the pool's)."""
        return self.layout.residual_nbytes()

    def leased_pages(self) -> int:
        """Pool pages residual rows hold now (leased from the allocator's free pages)."""
        return self.layout.leased_pages()

    def nbytes(self) -> int:
        """Everything the cache holds: pool, residual area and per-layer scales."""
        scales = sum(t.numel() * t.element_size() for pair in self.scales.values() if pair for t in pair)
        return self.pool_nbytes() + self.residual_nbytes() + scales

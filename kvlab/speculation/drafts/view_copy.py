"""A self-speculating draft's private copy of a view of the target's cache: a small dense pool of its own.

Where a view cannot be a shorter block table over the target's own pages -- a token-granular view (SnapKV,
H2O, ...: kvlab/speculation/drafts/token_view.py), a quantised view (QuantSpec, Tiwari et al. 2025,
arXiv:2502.10424: the draft reads a copy encoded with a registered format), or any view over a target whose
pages are packed (int8 / int4 / int2: a draft's tentative K/V cannot sit beside them) -- the draft keeps the
view's tokens here, `slots` sequences at a time, each slot a run of `pages` pages of one layer group:

    cache indices [0, S)              the view's selection of the target's tokens [0, P) (P: the last refresh)
    cache indices [S, S + c - P)      the target's tokens since the refresh, copied each step (c: tokens cached)
    cache indices S + c - P ...       the draft's own passes: the last committed token, then its drafts

Nothing here is ever read by the target, and the draft never writes the target's pool: a rejected token leaves
nothing in any target page, residual row or page summary. The copy is stored decoded, in the compute dtype
(`KVCache` of an element-wise format, kvlab/cache/kv_cache.py): a quantised view saves no memory (a fidelity
study of what the draft reads), and its bytes -- `nbytes()`, the null page included -- are taken from the
target's `kv_cache_memory` (kvlab/engine/build.py `page_pool`). Slots go to the sequences of a draft round,
least recently used first; a sequence that lost its slot rebuilds its copy from the target's tokens (time,
never output: the copy's content is a function of the sequence's tokens and the refresh point).
"""

from __future__ import annotations

import torch

from kvlab.cache.block_manager import LayerGroup
from kvlab.cache.kv_cache import KVCache


def copy_nbytes(num_groups: int, layers_per_group: int, slots: int, pages: int, block_size: int, num_kv_heads: int,
                head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of a copy of `slots` x `pages` pages per layer group (K and V of each layer slot, the null page
    included): what `ViewCopy.nbytes` holds."""
    per_page = block_size * num_kv_heads * head_dim * dtype.itemsize
    return 2 * layers_per_group * (num_groups * slots * pages + 1) * per_page


class ViewCopy:
    """`slots` runs of `pages` pages (per layer group) in a dense pool of the target's shape and compute dtype."""

    def __init__(self, groups: list[LayerGroup], slots: int, pages: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, fmt):
        self.groups, self.slots, self.pages, self.block_size = groups, slots, pages, block_size
        self.cache = KVCache(groups, len(groups) * slots * pages, block_size, num_kv_heads, head_dim, fmt, dtype,
                             device)
        self._held: dict[int, int] = {}  # seq_id -> slot (insertion order: least recently used first)
        self.refreshed: dict[tuple[int, int], tuple[int, int]] = {}  # (slot, group) -> (seq_id, P) of its selection
        self.selected: dict[tuple[int, int], int] = {}  # (slot, group) -> S, tokens of its selection

    def nbytes(self) -> int:
        return self.cache.pool_nbytes()

    def num_pages(self) -> int:
        return len(self.groups) * self.slots * self.pages

    # -- slots ------------------------------------------------------------------------
    def take(self, seq_ids: list[int]) -> list[int]:
        """A slot for each of a round's sequences (at most `slots`): kept where held, else the least recently
        used one held by none of them (its selection dropped)."""
        if len(seq_ids) > self.slots:
            raise ValueError(f"{len(seq_ids)} sequences in a draft round, the view copy holds {self.slots}")
        for sid in seq_ids:  # the round's own go to the back of the queue
            if sid in self._held:
                self._held[sid] = self._held.pop(sid)
        free = [s for s in range(self.slots) if s not in self._held.values()]
        for sid in seq_ids:
            if sid in self._held:
                continue
            if not free:
                victim = next(k for k in self._held if k not in seq_ids)
                free.append(self._held.pop(victim))
            slot = free.pop(0)
            self._held[sid] = slot
            self._drop(slot)
        return [self._held[sid] for sid in seq_ids]

    def forget(self, seq_id: int) -> None:
        slot = self._held.pop(seq_id, None)
        if slot is not None:
            self._drop(slot)

    def _drop(self, slot: int) -> None:
        """`slot`'s selections are no one's now."""
        for key in [k for k in self.refreshed if k[0] == slot]:
            del self.refreshed[key]
            self.selected.pop(key, None)

    def num_held(self) -> int:
        return len(self._held)

    # -- pages and writes -----------------------------------------------------------------
    def table(self, slot: int, g: int) -> list[int]:
        """The copy's pages of `slot` in layer group `g`."""
        first = (g * self.slots + slot) * self.pages
        return list(range(first, first + self.pages))

    def write(self, slot: int, g: int, layer: int, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """key/value [N, Hkv, D] -> cache indices start .. start + N - 1 of `slot`'s run in `layer`'s pool."""
        n, bs = key.shape[0], self.block_size
        if start + n > self.pages * bs:
            raise ValueError(f"view copy: {start + n} tokens do not fit a slot of {self.pages * bs}")
        index = torch.arange(start, start + n)
        pages = torch.tensor(self.table(slot, g), dtype=torch.int64)[index // bs]
        self.cache.store(layer, key, value, (pages * bs + index % bs).to(key.device))


def through_format(fmt, x: torch.Tensor, side: int, block_size: int, scales=None) -> torch.Tensor:
    """x [N, Hkv, D] -> x encoded with format `fmt` and decoded again, in x's dtype (QuantSpec's view):
    a packed format through its page codec (`side` 0: keys, 1: values), tokens grouped into pages of
    `block_size` in the order the copy holds them; an element-wise one through its storage dtype and fixed
    scale (`scales`: (k_scale, v_scale) [Hkv] or None)."""
    from kvlab.kernels.reference.store_kv import dequantize_ref, quantize_ref

    n, H, D = x.shape
    if not fmt.packed:
        scale = None if scales is None else scales[side]
        return dequantize_ref(quantize_ref(x, scale, fmt.storage_dtype(x.dtype)), scale, x.dtype)
    codec = fmt.codecs(block_size, D)[side]
    pages = -(-n // block_size)
    padded = x.new_zeros(pages * block_size, H, D, dtype=torch.float32)
    padded[:n] = x.float()
    valid = (torch.arange(pages * block_size, device=x.device) < n).view(pages, block_size)  # [P, bs]
    parts = codec.encode(padded.view(pages, block_size, H, D), valid)
    return codec.decode(parts, x.dtype).reshape(pages * block_size, H, D)[:n]

"""A self-speculating draft's private copy of a view of the target's cache: a small pool of its own.

Where a view cannot be a shorter block table over the target's own pages -- a token-granular view (SnapKV,
H2O, ...: kvlab/speculation/drafts/token_view.py), a quantised view (QuantSpec, Tiwari et al. 2025,
arXiv:2502.10424: the draft reads a copy stored in a registered format), or any view over a target whose
pages are packed (int8 / int4 / int2: a draft's tentative K/V cannot sit beside them) -- the draft keeps the
view's tokens here, `slots` sequences at a time, each slot a run of `pages` pages of one layer group:

    cache indices [0, S)              the view's selection of the target's tokens [0, P) (P: the last refresh)
    cache indices [S, S + c - P)      the target's tokens since the refresh, copied each step (c: tokens cached)
    cache indices S + c - P ...       the draft's own passes: the last committed token, then its drafts

The copy is a `KVCache` (kvlab/cache/kv_cache.py) in the view's format `fmt`: `auto` (decoded, the compute
dtype) for a plain view, or the quantised view's format, whose pages hold what the target's would: an
element-wise format's storage dtype (bf16, fp8 with a fixed scale), a packed one's codes, scales and zero
points (int8 / fp8 per token: each token encoded alone; int4 / int2: KIVI's per-channel key groups over a
page). A KIVI page is encoded once a write covers all of it (`write`: the selection's whole pages, the
tokens since the refresh page by page as they fill); every other page a write touches stays *open*, its
tokens in a full-precision residual row of the copy's own: the page where the selection ends and the
tokens since the refresh begin (whose codes would otherwise depend on when it was written), and the
pages the draft's one-token passes write (a tentative token is written into a row and overwritten by the
next step's copy, never encoded). `close` gives back the rows of open pages past the draft's tokens, so a
slot holds at most `1 + pages a draft chain spans` rows (`open_pages`), sized at build. So what a page holds
is a function of the sequence's tokens and the refresh point alone, never of how many tokens each step
accepted.

Nothing here is ever read by the target, and the draft never writes the target's pool: a rejected token leaves
nothing in any target page, residual row or page summary. Its bytes -- `nbytes()`: every page part, the null
page and the residual rows -- are taken from the target's `kv_cache_memory` (kvlab/engine/build.py
`page_pool`): an int4 view of SmolLM2 costs about a quarter of the decoded fp32 one. Slots go to the sequences
of a draft round, least recently used first; a sequence that lost its slot rebuilds its copy from the target's
tokens (time, never output).
"""

from __future__ import annotations

import torch

from kvlab.cache.block_manager import LayerGroup
from kvlab.cache.kv_cache import KVCache
from kvlab.cache.quant.page_store import plan_write


def keeps_rows(fmt) -> bool:
    """Whether a copy in `fmt` keeps open pages in residual rows (packed formats encoding whole pages: KIVI)."""
    return bool(fmt.packed) and fmt.residual is not None


def copy_nbytes(fmt, num_groups: int, layers_per_group: int, slots: int, pages: int, block_size: int,
                num_kv_heads: int, head_dim: int, dtype: torch.dtype, open_pages: int = 0) -> int:
    """Bytes of a copy in format `fmt` of `slots` x `pages` pages per layer group (K and V of each layer slot,
    every page part, the null page included) and, for a format that keeps rows, `open_pages` residual rows per
    slot and group: what `ViewCopy.nbytes` holds."""
    k, v = fmt.storage(block_size, num_kv_heads, head_dim, dtype)
    per_page = sum(p.nbytes for p in (*k.values(), *v.values()))
    pool = layers_per_group * (num_groups * slots * pages + 1) * per_page
    if not keeps_rows(fmt):
        return pool
    row = block_size * num_kv_heads * head_dim * fmt.residual_storage_dtype(dtype).itemsize
    return pool + 2 * layers_per_group * num_groups * slots * open_pages * row


class ViewCopy:
    """`slots` runs of `pages` pages (per layer group) in a pool of the target's shape, in format `fmt`
    (`open_pages`: residual rows per slot and group, for a format that keeps rows)."""

    def __init__(self, groups: list[LayerGroup], slots: int, pages: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, fmt, open_pages: int = 0):
        self.groups, self.slots, self.pages, self.block_size = groups, slots, pages, block_size
        self.open_pages = open_pages if keeps_rows(fmt) else 0
        if keeps_rows(fmt) and open_pages < 1:
            raise ValueError("view copy: a format that keeps open pages in rows needs open_pages >= 1")
        self.cache = KVCache(groups, len(groups) * slots * pages, block_size, num_kv_heads, head_dim, fmt, dtype,
                             device, residual_rows=len(groups) * slots * self.open_pages if self.open_pages else None)
        self._held: dict[int, int] = {}  # seq_id -> slot (insertion order: least recently used first)
        self.refreshed: dict[tuple[int, int], tuple[int, int]] = {}  # (slot, group) -> (seq_id, P) of its selection
        self.selected: dict[tuple[int, int], int] = {}  # (slot, group) -> S, tokens of its selection

    def nbytes(self) -> int:
        return self.cache.pool_nbytes() + self.cache.residual_nbytes()

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
        """`slot`'s selections are no one's now (its open pages' rows go back)."""
        for key in [k for k in self.refreshed if k[0] == slot]:
            del self.refreshed[key]
            self.selected.pop(key, None)
        for g in range(len(self.groups)):
            self.reset(slot, g)

    def num_held(self) -> int:
        return len(self._held)

    # -- pages and writes -----------------------------------------------------------------
    def table(self, slot: int, g: int) -> list[int]:
        """The copy's pages of `slot` in layer group `g`."""
        first = (g * self.slots + slot) * self.pages
        return list(range(first, first + self.pages))

    def write(self, slot: int, g: int, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """kv: per layer of group `g` (in its order) key/value [N, Hkv, D] -> cache indices start .. start + N - 1
        of `slot`'s run. A format that keeps rows encodes each page the write covers whole and keeps every other
        page it touches open (module docstring)."""
        n, bs = kv[0][0].shape[0], self.block_size
        if start + n > self.pages * bs:
            raise ValueError(f"view copy: {start + n} tokens do not fit a slot of {self.pages * bs}")
        if n == 0:
            return
        index = torch.arange(start, start + n)
        table = self.table(slot, g)
        mapping = (torch.tensor(table, dtype=torch.int64)[index // bs] * bs + index % bs).to(kv[0][0].device)
        layers = self.groups[g].layers
        if not self.open_pages:
            for layer, (k, v) in zip(layers, kv):
                self.cache.store(layer, k, v, mapping)
            return
        whole = {table[j] for j in range(-(-start // bs), (start + n) // bs)}  # pages every slot of which is written
        area = self.cache.area
        plan = plan_write(mapping, bs, self.cache.codecs, area, whole)
        for layer, (k, v) in zip(layers, kv):
            self.cache.k(layer).write(k, plan)
            self.cache.v(layer).write(v, plan)
        area.end_step()  # rows of pages this write encoded go back
        self.check_rows()

    def close(self, slot: int, g: int, selected: int, length: int) -> None:
        """After a step's writes (`selected`: S, `length`: cached indices S + c - P): the rows of open pages other
        than the one where the selection ends and the one the draft's first token goes to (the page of index
        `length`) go back, their contents dropped (never read: the draft writes them before reading)."""
        if not self.open_pages:
            return
        bs, table = self.block_size, self.table(slot, g)
        keep = {table[length // bs]} | ({table[selected // bs]} if selected % bs else set())
        for page in table:
            if page not in keep:
                self.cache.area.seal(page)

    def reset(self, slot: int, g: int) -> None:
        """Every open page of `slot`'s run in group `g` gives its row back (a new selection is written)."""
        if self.open_pages:
            for page in self.table(slot, g):
                self.cache.area.seal(page)

    def check_rows(self) -> None:
        """A page that had to be encoded for want of a row would make the copy depend on the schedule: the rows
        are sized so that it never happens (`open_pages`); say so if it did."""
        if self.open_pages and self.cache.area.early_seals:
            raise RuntimeError(f"view copy: {self.cache.area.early_seals} open page(s) found no residual row "
                               f"({self.open_pages} per slot and group)")

    def num_open(self) -> int:
        """Pages open now (their tokens in residual rows)."""
        return len(self.cache.area.open_pages()) if self.open_pages else 0

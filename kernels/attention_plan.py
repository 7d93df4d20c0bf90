"""The per-step attention plan: the batch layout every layer of a layer group reads.

Planned once per step by the engine's attention layer (`kvlab.engine.attention.plan_step`) from the block
manager, then handed to whichever backend runs (flashinfer's plan()/run() split). The plan is a
read-only description; each backend derives what it needs from it on first use and keeps that in
a private memo keyed by the plan (`memo(plan, name, build)`), so all layers share the work and
nothing in the plan changes while the step runs.

Layout. Query token i of sequence b (packed at `cu_seqlens_q[b] + i`) sits at cache index
`seq_lens[b] - q_len[b] + i` of its sequence in this layer group and attends causally to the cache
indices before and at it (and, with a sliding window W, only to the last W of those). Cache index j
lives in slot `block_tables[b][j // block_size] * block_size + j % block_size`. A table entry of
-1 (`NULL_BLOCK`: a page released by the sliding window or an eviction policy) is never read: its
cache indices are invisible, and the torch path points them at the pool's zero `null_block`.

Cache indices are not positions: RoPE positions come from the sequence (and are already applied to
the keys in the pool), so a compacted sequence holds fewer cache indices than it has tokens.

An optional tree mask restricts the step's new tokens further (SpecInfer token-tree verification,
arXiv:2305.09781): `tree_mask[t, j]` says whether query token t may see the j-th new token of its
sequence. Tokens cached before the step are always visible; the causal rule still applies, so a tree
is laid out in topological order (ancestors first). `tree_starts[b]` moves where a row's mask columns
begin: column j is cache index `tree_starts[b] + j` (default `seq_lens[b] - q_len[b]`, the step's first
new token); indices before it are visible. A sparse read's reduced plan uses it for a token tree's
nodes (kvlab.policies.sparse_read): each node is a row of its own whose table holds the selected pages,
then its tree's pages, masked to what plain decoding would have read.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

NULL_BLOCK = -1


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """Per-step attention metadata for one layer group, shared by all its layers. Read-only."""

    num_tokens: int
    block_size: int
    cu_seqlens_q: tuple[int, ...]  # [B + 1]
    seq_lens: tuple[int, ...]  # [B] cached slots of each sequence after this step's tokens
    block_tables: tuple[tuple[int, ...], ...] | torch.Tensor  # [B][n_blocks] physical pages (-1 = released)
    sliding_window: int | None = None
    tree_mask: torch.Tensor | None = None  # [T, >= max q_len] bool on `device`
    tree_starts: tuple[int, ...] | None = None  # [B] cache index of each row's mask column 0 (tree_mask only)
    device: torch.device = torch.device("cpu")
    null_block: int | None = None  # an always-zero page that released entries and padding may point at

    @property
    def q_lens(self) -> list[int]:
        cu = self.cu_seqlens_q
        return [cu[b + 1] - cu[b] for b in range(len(self.seq_lens))]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)


_memos: dict[str, weakref.WeakKeyDictionary] = {}


def memo(plan: AttentionPlan, name: str, build: Callable[[AttentionPlan], Any]) -> Any:
    """`build(plan)` once per plan and backend-private `name`; later calls return the same object."""
    table = _memos.setdefault(name, weakref.WeakKeyDictionary())
    if plan not in table:
        table[plan] = build(plan)
    return table[plan]


def plan_paged_attention(
    cu_seqlens_q: list[int],  # [B + 1] cumulative query lengths of the packed batch
    seq_lens: list[int],  # [B] cache length of each sequence after this step's tokens
    block_tables: list[list[int]] | torch.Tensor,  # [B][n_blocks] physical block ids (-1 = released)
    block_size: int,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
    tree_mask: torch.Tensor | None = None,  # [T, >= max q_len] bool: query t sees new token j of its sequence
    null_block: int | None = None,
    tree_starts: list[int] | None = None,  # [B] cache index of mask column 0 (None: seq_len - q_len)
) -> AttentionPlan:
    cu_seqlens_q = tuple(int(x) for x in cu_seqlens_q)
    seq_lens = tuple(int(x) for x in seq_lens)
    if len(cu_seqlens_q) != len(seq_lens) + 1:
        raise ValueError(f"cu_seqlens_q has {len(cu_seqlens_q)} entries; expected len(seq_lens) + 1 = {len(seq_lens) + 1}")
    for b, n in enumerate(seq_lens):
        q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
        if q_len < 0 or q_len > n:
            raise ValueError(f"sequence {b}: query length {q_len} must be in [0, seq_len={n}]")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    device = torch.device(device)
    if not isinstance(block_tables, torch.Tensor):  # snapshot: the allocator's lists change after the step
        block_tables = tuple(tuple(int(x) for x in t) for t in block_tables)
    if tree_mask is not None:
        max_q = max((cu_seqlens_q[b + 1] - cu_seqlens_q[b] for b in range(len(seq_lens))), default=0)
        if tree_mask.dim() != 2 or tree_mask.shape[0] != cu_seqlens_q[-1] or tree_mask.shape[1] < max_q:
            raise ValueError(f"tree_mask must be [T={cu_seqlens_q[-1]}, >= {max_q}], got {tuple(tree_mask.shape)}")
        tree_mask = tree_mask.to(device)
    if tree_starts is not None:
        tree_starts = _check_tree_starts(tree_starts, cu_seqlens_q, seq_lens, tree_mask)
    return AttentionPlan(num_tokens=cu_seqlens_q[-1], block_size=block_size, cu_seqlens_q=cu_seqlens_q,
                         seq_lens=seq_lens, block_tables=block_tables, sliding_window=sliding_window,
                         tree_mask=tree_mask, tree_starts=tree_starts, device=device, null_block=null_block)


def _check_tree_starts(tree_starts, cu_seqlens_q, seq_lens, tree_mask) -> tuple[int, ...]:
    """Each row's mask origin at or before its first query, its mask wide enough to reach its last key."""
    if tree_mask is None:
        raise ValueError("tree_starts needs a tree_mask")
    starts = tuple(int(x) for x in tree_starts)
    if len(starts) != len(seq_lens):
        raise ValueError(f"tree_starts has {len(starts)} entries; expected {len(seq_lens)}")
    for b, (start, n) in enumerate(zip(starts, seq_lens)):
        q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
        if not 0 <= start <= n - q_len:
            raise ValueError(f"sequence {b}: tree_starts {start} must be in [0, seq_len - q_len = {n - q_len}]")
        if n - start > tree_mask.shape[1]:
            raise ValueError(f"sequence {b}: tree_mask has {tree_mask.shape[1]} columns, its keys from "
                             f"tree_starts {start} to seq_len {n} need {n - start}")
    return starts

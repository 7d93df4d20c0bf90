"""The torch reference's view of an attention plan: its sequences split into padded parts (decode rows,
extend rows bucketed by length), built once per plan and memoised, and the masked logits both the
reference attention and the reference statistics compute from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.kernels.attention_plan import NULL_BLOCK, AttentionPlan, memo


@dataclass
class _Part:
    """One padded group of sequences."""

    q_index: torch.Tensor  # [B, Qmax] int64 into the packed query tokens (pads point at 0)
    q_valid: torch.Tensor  # [B, Qmax] bool
    blocks: torch.Tensor  # [B, NBmax] int64 physical blocks to read (pads point at block 0)
    mask: torch.Tensor  # [B, 1, Qmax, NBmax * block_size] bool, True = attend
    key_index: torch.Tensor  # [B, NBmax * block_size] cache index of every gathered key (-1 pads)
    seq_rows: list[int] = field(default_factory=list)  # which batch rows are in this part
    q_local: torch.Tensor | None = None  # [B, Qmax] index of each query within its sequence's chunk (-1 pads)
    q_lens: torch.Tensor | None = None  # [B] query-chunk length of each row
    valid_rows: torch.Tensor | None = None  # [n_valid] positions in the flattened [B * Qmax] that hold a query
    valid_tokens: torch.Tensor | None = None  # [n_valid] the packed token each of those is
    unmasked_len: int | None = None  # set when one query per row sees exactly the first `unmasked_len` keys
    folded_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # g -> mask with GQA groups folded in


def plan_parts(plan: AttentionPlan) -> list[_Part]:
    """Padded decode / extend groups of the torch path (built once per plan, shared by every layer)."""
    return memo(plan, "torch.parts", _build_parts)


def _build_parts(plan: AttentionPlan) -> list[_Part]:
    tables = plan.block_tables
    if isinstance(tables, torch.Tensor) and plan.sliding_window is None and plan.tree_mask is None \
            and all(n == 1 for n in plan.q_lens):  # decode rows over a device table (sparse reading)
        return [_decode_part(plan)]
    if isinstance(tables, torch.Tensor):
        tables = tables.tolist()
    tree = None if plan.tree_mask is None else plan.tree_mask.bool().cpu()
    q_lens = plan.q_lens
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    extend = [b for b, n in enumerate(q_lens) if n > 1]
    groups = _buckets(decode, plan.seq_lens) + ([extend] if extend else [])
    return [
        _plan_part(rows, plan.cu_seqlens_q, q_lens, plan.seq_lens, tables, plan.block_size,
                   plan.sliding_window, tree, plan.device, plan.null_block, plan.tree_starts)
        for rows in groups
    ]


def _decode_part(plan: AttentionPlan) -> _Part:
    """One part of decode rows, built with tensor ops from a device table (no per-row Python)."""
    bs, dev, B = plan.block_size, plan.device, plan.batch_size
    pad = 0 if plan.null_block is None else plan.null_block
    nb_max = max(-(-n // bs) for n in plan.seq_lens)
    table = plan.block_tables.to(device=dev, dtype=torch.int64).reshape(B, -1)[:, :nb_max]  # [B, NB]
    released = table == NULL_BLOCK
    lens = torch.tensor(plan.seq_lens, dtype=torch.int64, device=dev)  # [B]
    j = torch.arange(nb_max * bs, device=dev)  # [L]
    visible = (j[None, :] < lens[:, None]) & ~released.repeat_interleave(bs, dim=1)  # [B, L]
    q_index = torch.tensor(plan.cu_seqlens_q[:-1], dtype=torch.int64, device=dev)[:, None]  # [B, 1]
    unmasked = B == 1 and not bool(released.any())  # batch-1 decode: SDPA without a mask
    return _Part(
        unmasked_len=plan.seq_lens[0] if unmasked else None,
        valid_rows=torch.arange(B, device=dev),
        valid_tokens=q_index.view(-1),
        q_index=q_index,
        q_valid=torch.ones(B, 1, dtype=torch.bool, device=dev),
        blocks=table.masked_fill(released, pad),
        mask=visible[:, None, None, :],
        key_index=torch.where(visible, j[None, :], -1),
        seq_rows=list(range(B)),
        q_local=torch.zeros(B, 1, dtype=torch.int64, device=dev),
        q_lens=torch.ones(B, dtype=torch.int64, device=dev),
    )


def _buckets(rows: list[int], seq_lens: list[int], slack: float = 0.25, min_rows: int = 8) -> list[list[int]]:
    """Decode rows sorted by length and cut where padding to the bucket's longest row would waste
    more than `slack` of the bucket, so a few long contexts do not pad every short one."""
    buckets: list[list[int]] = []
    for b in sorted(rows, key=lambda r: seq_lens[r]):
        cur = buckets[-1] if buckets else None
        if cur is not None:
            used = sum(seq_lens[r] for r in cur) + seq_lens[b]
            padded = seq_lens[b] * (len(cur) + 1)
            if len(cur) < min_rows or used >= (1 - slack) * padded:
                cur.append(b)
                continue
        buckets.append([b])
    return buckets


def _plan_part(rows, cu_seqlens_q, q_lens, seq_lens, block_tables, block_size, window, tree, device,
               null_block=None, tree_starts=None) -> _Part:
    bs = block_size
    pad = 0 if null_block is None else null_block  # padding and released entries point here (masked)
    q_max = max(q_lens[b] for b in rows)
    # first block any query of the row can see (sliding window drops the older ones)
    first = []
    for b in rows:
        lo = 0 if window is None else max(0, seq_lens[b] - q_lens[b] - window + 1)
        first.append(lo // bs)
    nb_max = max(-(-seq_lens[b] // bs) - f for b, f in zip(rows, first))
    blocks = torch.full((len(rows), nb_max), pad, dtype=torch.int64)
    has_null = False
    key_index = torch.full((len(rows), nb_max * bs), -1, dtype=torch.int64)
    q_index = torch.zeros(len(rows), q_max, dtype=torch.int64)
    q_pos = torch.full((len(rows), q_max), -1, dtype=torch.int64)
    q_local = torch.full((len(rows), q_max), -1, dtype=torch.int64)
    for r, (b, f) in enumerate(zip(rows, first)):
        n_blk = -(-seq_lens[b] // bs) - f
        table = torch.tensor(block_tables[b][f : f + n_blk], dtype=torch.int64)
        released = table == NULL_BLOCK
        blocks[r, :n_blk] = table.masked_fill(released, pad)
        key_index[r, : seq_lens[b] - f * bs] = torch.arange(f * bs, seq_lens[b])
        if released.any():  # a released page is never attended to
            has_null = True
            key_index[r, : n_blk * bs].view(n_blk, bs)[released] = -1
        q_index[r, : q_lens[b]] = torch.arange(cu_seqlens_q[b], cu_seqlens_q[b + 1])
        q_pos[r, : q_lens[b]] = torch.arange(seq_lens[b] - q_lens[b], seq_lens[b])
        q_local[r, : q_lens[b]] = torch.arange(q_lens[b])
    qp = q_pos[:, :, None]  # [B, Qmax, 1]
    kp = key_index[:, None, :]  # [B, 1, L]
    mask = (kp >= 0) & (kp <= qp)
    if window is not None:
        mask &= qp - kp < window
    if tree is not None:
        for r, (b, f) in enumerate(zip(rows, first)):
            n = q_lens[b]  # mask column 0 is cache index `start` (default: the first new token)
            start = seq_lens[b] - n if tree_starts is None else tree_starts[b]
            w = seq_lens[b] - start  # masked columns: cache indices start..seq_len-1
            c0 = start - f * bs  # their column in this row's gathered keys
            lo = max(0, -c0)  # columns a sliding window already dropped from the gather
            tm = tree[cu_seqlens_q[b] : cu_seqlens_q[b + 1], lo:w]  # [n, w - lo]
            mask[r, :n, c0 + lo : c0 + w] &= tm
    q_valid = q_pos >= 0
    mask[:, :, 0] |= ~q_valid  # padded query rows see one key so softmax stays finite
    valid_rows = q_valid.view(-1).nonzero().view(-1)
    lens = {seq_lens[b] - f * bs for b, f in zip(rows, first)}
    unmasked = q_max == 1 and window is None and tree is None and len(lens) == 1 and not has_null  # batch-1 decode
    return _Part(
        unmasked_len=lens.pop() if unmasked else None,
        valid_rows=valid_rows.to(device),
        valid_tokens=q_index.view(-1)[valid_rows].to(device),
        q_index=q_index.to(device),
        q_valid=q_valid.to(device),
        blocks=blocks.to(device),
        mask=mask[:, None].to(device),
        key_index=key_index.to(device),
        seq_rows=list(rows),
        q_local=q_local.to(device),
        q_lens=torch.tensor([q_lens[b] for b in rows], dtype=torch.int64, device=device),
    )


def attention_logits(q, k, mask, scale, softcap):
    """Masked logits [B, Hkv, g, Qmax, L] in float32 (soft-capped when asked) for q [B, Hq, Qmax, D], k [B, Hkv, L, D]."""
    B, Hq, Qmax, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    qg = q.float().reshape(B, Hkv, g * Qmax, D)
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # [B, Hkv, g*Qmax, L]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    return s.view(B, Hkv, g, Qmax, -1).masked_fill(~mask[:, :, None], float("-inf"))

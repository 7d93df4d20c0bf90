"""Reference paged attention over ragged batches (prefill, extend and decode alike).

PagedAttention (Kwon et al., arXiv:2309.06180): keys and values live in fixed-size
blocks of a shared pool, read through a per-sequence block table.

The batch layout (which cache indices each query sees, released pages, sliding
window, tree mask) is described by `kvlab.kernels.attention_plan.AttentionPlan`, planned
once per step by the engine; this backend derives its padded index tensors from
the plan on first use and keeps them in a private memo, so all layers share them:

    plan = plan_paged_attention(cu_seqlens_q, seq_lens, block_tables, block_size, window)
    out  = run_paged_attention(q, k_cache, v_cache, plan, scale, softcap)

`paged_attention_ref` does both, with the same signature as the Triton launcher.
Sequences are grouped into decode rows (one query) and extend rows (several);
each group is padded only to its own longest query/context, so a step mixing
a long prefill with many decodes does not pad every decode to the prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvlab.kernels.attention_plan import NULL_BLOCK, AttentionPlan, memo, plan_paged_attention
from kvlab.kernels.reference.store_kv import dequantize_ref, read_blocks

__all__ = ["AttentionPlan", "plan_paged_attention", "plan_parts", "run_paged_attention", "paged_attention_ref"]


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
                   plan.sliding_window, tree, plan.device, plan.null_block)
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
               null_block=None) -> _Part:
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
            n, start = q_lens[b], seq_lens[b] - q_lens[b]  # new tokens sit at cache index start..start+n-1
            c0 = start - f * bs  # their column in this row's gathered keys
            tm = tree[cu_seqlens_q[b] : cu_seqlens_q[b + 1], :n]  # [n, n]
            mask[r, :n, c0 : c0 + n] &= tm
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


def run_paged_attention(
    q: torch.Tensor,  # [T, Hq, D] packed queries
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    plan: AttentionPlan,
    scale: float,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,  # [Hkv] dequantisation scales (quantised caches)
    v_scale: torch.Tensor | None = None,
    *,
    return_stats: bool = False,
    stats_window: int | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D] written in place when given
    stats_out: torch.Tensor | None = None,  # [B, Hkv, max(seq_lens)] float32
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention output [T, Hq, D]; with `return_stats`, also the attention statistics
    (see kvlab.kernels.reference.attention_stats) as (out, stats)."""
    if out is None:
        out = q.new_empty(q.shape)  # [T, Hq, D]
    for part in plan_parts(plan):
        o = _attend_part(q, k_cache, v_cache, part, plan.block_size, scale, softcap, k_scale, v_scale)
        o = o.reshape(-1, *o.shape[2:]).index_select(0, part.valid_rows)  # [n_valid, Hq, D]
        out.index_copy_(0, part.valid_tokens, o.to(out.dtype))
    if not return_stats:
        return out
    from kvlab.kernels.reference.attention_stats import attention_stats_from_plan

    stats = attention_stats_from_plan(q, k_cache, plan, scale, softcap, k_scale, stats_window, out=stats_out)
    return out, stats


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """cache [NB, bs, Hkv, D] (or a packed PageStore), blocks [B, nb] -> [B, Hkv, nb * bs, D] in `dtype`
    (a strided view).

    index_select over whole blocks copies block-sized rows (advanced indexing copies element-wise)."""
    NB, bs, Hkv, D = cache.shape
    B, nb = blocks.shape
    if not isinstance(cache, torch.Tensor):  # packed format: decoded page by page
        return read_blocks(cache, blocks, scale, dtype).view(B, nb * bs, Hkv, D).transpose(1, 2)
    rows = cache.view(NB, bs * Hkv * D).index_select(0, blocks.reshape(-1))  # [B * nb, bs * Hkv * D]
    return dequantize_ref(rows.view(B, nb * bs, Hkv, D), scale, dtype).transpose(1, 2)


def _attend_part(q, k_cache, v_cache, part: _Part, block_size: int, scale, softcap, k_scale, v_scale):
    """Attention of one padded group: -> [B, Qmax, Hq, D].

    GQA folds the g query heads of each KV head into the query dimension
    ([B, Hkv, g * Qmax, D]), so keys and values are never repeated per query head."""
    B, Qmax = part.q_index.shape
    Hq, D = q.shape[1:]
    Hkv = k_cache.shape[2]
    g = Hq // Hkv
    k = gather_blocks(k_cache, part.blocks, k_scale, q.dtype)  # [B, Hkv, L, D]
    v = gather_blocks(v_cache, part.blocks, v_scale, q.dtype)
    qp = q.index_select(0, part.q_index.view(-1)).view(B, Qmax, Hq, D)
    if softcap is not None:
        return _attention_softcap(qp.transpose(1, 2), k, v, part.mask, scale, softcap).transpose(1, 2)
    qg = qp.view(B, Qmax, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * Qmax, D)
    mask = part.mask  # [B, 1, Qmax, L]
    if part.unmasked_len is not None:  # every row sees exactly its first keys: no mask, SDPA's fast path
        k, v, mask = k[:, :, : part.unmasked_len], v[:, :, : part.unmasked_len], None
    elif Qmax > 1 and g > 1:  # built by the first layer, reused by the others
        if g not in part.folded_masks:
            part.folded_masks[g] = mask[:, :, None].expand(B, 1, g, Qmax, mask.shape[-1]).reshape(B, 1, g * Qmax, -1)
        mask = part.folded_masks[g]
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, g*Qmax, D]
    return o.view(B, Hkv, g, Qmax, D).permute(0, 3, 1, 2, 4).reshape(B, Qmax, Hq, D)


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


def _attention_softcap(q, k, v, mask, scale, softcap):
    """Eager attention with logit soft-capping (Gemma 2): s = cap * tanh(qk^T * scale / cap)."""
    B, Hq, Qmax, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    s = attention_logits(q, k, mask, scale, softcap)
    p = torch.softmax(s, dim=-1).view(B, Hkv, g * Qmax, -1)
    return torch.matmul(p, v.float()).view(B, Hq, Qmax, D).to(q.dtype)


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64 (-1 = released / padding: never attended to)
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32/int64
    seq_lens: torch.Tensor,  # [B] int32/int64
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    tree_mask: torch.Tensor | None = None,  # [T, >= max q_len] bool
    return_stats: bool = False,
    stats_window: int | None = None,
    out: torch.Tensor | None = None,
    stats_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plan and run in one call; same signature as the Triton launcher."""
    plan = plan_paged_attention(
        cu_seqlens_q.tolist(),
        seq_lens.tolist(),
        block_tables.tolist(),
        k_cache.shape[1],
        sliding_window,
        q.device,
        tree_mask=tree_mask,
    )
    return run_paged_attention(
        q, k_cache, v_cache, plan, scale, softcap, k_scale, v_scale,
        return_stats=return_stats, stats_window=stats_window, out=out, stats_out=stats_out,
    )

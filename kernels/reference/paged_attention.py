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

import torch
import torch.nn.functional as F

from kvlab.kernels.attention_plan import AttentionPlan, plan_paged_attention
from kvlab.kernels.reference.attention_parts import _Part, attention_logits, plan_parts
from kvlab.kernels.reference.store_kv import dequantize_ref, read_blocks

__all__ = ["AttentionPlan", "plan_paged_attention", "plan_parts", "run_paged_attention", "paged_attention_ref"]


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
    tree_starts: list[int] | None = None,  # [B] cache index of each row's mask column 0 (AttentionPlan)
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
        tree_starts=tree_starts,
    )
    return run_paged_attention(
        q, k_cache, v_cache, plan, scale, softcap, k_scale, v_scale,
        return_stats=return_stats, stats_window=stats_window, out=out, stats_out=stats_out,
    )

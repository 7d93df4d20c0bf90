"""Reference attention statistics: how much attention each cached key received.

Score-based eviction policies rank cached tokens by the attention they receive:
H2O (Zhang et al., arXiv:2306.14048) accumulates it over all queries, SnapKV
(Li et al., arXiv:2404.14469) over an observation window of the last queries,
TOVA over the last query only. This returns, for every sequence b, KV head h
and cache index j,

    stats[b, h, j] = sum over the last `stats_window` queries i of sequence b
                     (all of this step's queries when None)
                     sum over the query heads g of KV head h
                     P[i, g, j]

where P is the attention probability (after scale, soft-capping, causal,
sliding-window and tree masks), so the policy never needs eager attention.
Keys that no counted query could see, and indices past `seq_lens[b]`, are 0.
"""

from __future__ import annotations

import torch

from kvlab.kernels.attention_plan import AttentionPlan, plan_paged_attention
from kvlab.kernels.reference.attention_parts import attention_logits, plan_parts
from kvlab.kernels.reference.store_kv import read_blocks


def attention_stats_from_plan(
    q: torch.Tensor,  # [T, Hq, D] packed queries
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    plan: AttentionPlan,
    scale: float,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,  # [Hkv]
    stats_window: int | None = None,
    out: torch.Tensor | None = None,  # [B, Hkv, max(seq_lens)] float32
) -> torch.Tensor:  # [B, Hkv, max(seq_lens)] float32
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    B, L_max = plan.batch_size, max(plan.seq_lens, default=0)
    if out is None:
        out = torch.empty(B, Hkv, L_max, dtype=torch.float32, device=q.device)
    out.zero_()
    window = T if stats_window is None else stats_window
    for part in plan_parts(plan):
        Bp = part.q_index.shape[0]
        L = part.blocks.shape[1] * plan.block_size
        qp = q[part.q_index].transpose(1, 2)  # [Bp, Hq, Qmax, D]
        k = read_blocks(k_cache, part.blocks, k_scale, q.dtype).view(Bp, L, Hkv, D).transpose(1, 2)
        p = torch.softmax(attention_logits(qp, k, part.mask, scale, softcap), dim=-1)  # [Bp, Hkv, g, Qmax, L]
        counted = part.q_valid & (part.q_local >= part.q_lens[:, None] - window)  # [Bp, Qmax]
        per_key = (p * counted[:, None, None, :, None]).sum(dim=(2, 3))  # [Bp, Hkv, L]
        for r, b in enumerate(part.seq_rows):
            keep = part.key_index[r] >= 0  # [L]
            out[b][:, part.key_index[r][keep]] = per_key[r][:, keep]
    return out


def attention_stats_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # unused here; the Triton launcher runs the attention for its log-sum-exp
    block_tables: torch.Tensor,  # [B, max_blocks]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    stats_window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, Hkv, max(seq_lens)] float32
    """Plan and compute the statistics alone (the attention calls return them with the output);
    same signature as the Triton launcher kvlab.kernels.paged_attention.attention_stats."""
    plan = plan_paged_attention(
        cu_seqlens_q.tolist(), seq_lens.tolist(), block_tables.tolist(), k_cache.shape[1],
        sliding_window, q.device, tree_mask=tree_mask,
    )
    return attention_stats_from_plan(q, k_cache, plan, scale, softcap, k_scale, stats_window)

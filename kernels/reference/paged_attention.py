"""Reference paged attention over ragged batches (prefill, extend and decode alike).

Every query token of sequence b sits at cache index `seq_lens[b] - q_len[b] + i`
and attends causally to the cache indices before and at it (and, with a sliding
window W, only to the last W of those). Keys and values are read through the
block table: cache index j of sequence b lives in slot
`block_tables[b][j // block_size] * block_size + j % block_size`.

The work is split in two steps so the engine can plan once per step and reuse
the plan in every layer (flashinfer's plan()/run()):

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

from kvlab.kernels.reference.store_kv import dequantize_ref


@dataclass
class _Part:
    """One padded group of sequences."""

    q_index: torch.Tensor  # [B, Qmax] int64 into the packed query tokens (pads point at 0)
    q_valid: torch.Tensor  # [B, Qmax] bool
    blocks: torch.Tensor  # [B, NBmax] int64 physical blocks to read (pads point at block 0)
    mask: torch.Tensor  # [B, 1, Qmax, NBmax * block_size] bool, True = attend
    key_index: torch.Tensor  # [B, NBmax * block_size] cache index of every gathered key (-1 pads)
    seq_rows: list[int] = field(default_factory=list)  # which batch rows are in this part


@dataclass
class AttentionPlan:
    """Per-step attention metadata for one layer group, shared by all its layers."""

    num_tokens: int
    block_size: int
    parts: list[_Part]


def plan_paged_attention(
    cu_seqlens_q: list[int],  # [B + 1] cumulative query lengths of the packed batch
    seq_lens: list[int],  # [B] cache length of each sequence after this step's tokens
    block_tables: list[list[int]],  # [B][n_blocks] physical block ids (-1 = released)
    block_size: int,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
) -> AttentionPlan:
    q_lens = [cu_seqlens_q[b + 1] - cu_seqlens_q[b] for b in range(len(seq_lens))]
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    extend = [b for b, n in enumerate(q_lens) if n > 1]
    parts = [
        _plan_part(rows, cu_seqlens_q, q_lens, seq_lens, block_tables, block_size, sliding_window, device)
        for rows in (decode, extend)
        if rows
    ]
    return AttentionPlan(num_tokens=cu_seqlens_q[-1], block_size=block_size, parts=parts)


def _plan_part(rows, cu_seqlens_q, q_lens, seq_lens, block_tables, block_size, window, device) -> _Part:
    bs = block_size
    q_max = max(q_lens[b] for b in rows)
    # first block any query of the row can see (sliding window drops the older ones)
    first = []
    for b in rows:
        lo = 0 if window is None else max(0, seq_lens[b] - q_lens[b] - window + 1)
        first.append(lo // bs)
    nb_max = max(-(-seq_lens[b] // bs) - f for b, f in zip(rows, first))
    blocks = torch.zeros(len(rows), nb_max, dtype=torch.int64)
    key_index = torch.full((len(rows), nb_max * bs), -1, dtype=torch.int64)
    q_index = torch.zeros(len(rows), q_max, dtype=torch.int64)
    q_pos = torch.full((len(rows), q_max), -1, dtype=torch.int64)
    for r, (b, f) in enumerate(zip(rows, first)):
        n_blk = -(-seq_lens[b] // bs) - f
        table = block_tables[b][f : f + n_blk]
        blocks[r, :n_blk] = torch.tensor(table, dtype=torch.int64).clamp_min(0)
        key_index[r, : seq_lens[b] - f * bs] = torch.arange(f * bs, seq_lens[b])
        q_index[r, : q_lens[b]] = torch.arange(cu_seqlens_q[b], cu_seqlens_q[b + 1])
        q_pos[r, : q_lens[b]] = torch.arange(seq_lens[b] - q_lens[b], seq_lens[b])
    qp = q_pos[:, :, None]  # [B, Qmax, 1]
    kp = key_index[:, None, :]  # [B, 1, L]
    mask = (kp >= 0) & (kp <= qp)
    if window is not None:
        mask &= qp - kp < window
    q_valid = q_pos >= 0
    mask[:, :, 0] |= ~q_valid  # padded query rows see one key so softmax stays finite
    return _Part(
        q_index=q_index.to(device),
        q_valid=q_valid.to(device),
        blocks=blocks.to(device),
        mask=mask[:, None].to(device),
        key_index=key_index.to(device),
        seq_rows=list(rows),
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
) -> torch.Tensor:  # [T, Hq, D]
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    out = q.new_empty(T, Hq, D)
    for part in plan.parts:
        B, Qmax = part.q_index.shape
        L = part.blocks.shape[1] * plan.block_size
        qp = q[part.q_index].transpose(1, 2)  # [B, Hq, Qmax, D]
        k = dequantize_ref(k_cache[part.blocks], k_scale, q.dtype).view(B, L, Hkv, D).transpose(1, 2)
        v = dequantize_ref(v_cache[part.blocks], v_scale, q.dtype).view(B, L, Hkv, D).transpose(1, 2)
        if softcap is None:
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=part.mask, scale=scale, enable_gqa=Hq != Hkv)
        else:
            o = _attention_softcap(qp, k, v, part.mask, scale, softcap)
        o = o.transpose(1, 2)  # [B, Qmax, Hq, D]
        out[part.q_index[part.q_valid]] = o[part.q_valid]
    return out


def _attention_softcap(q, k, v, mask, scale, softcap):
    """Eager attention with logit soft-capping (Gemma 2): s = cap * tanh(qk^T * scale / cap)."""
    B, Hq, Qmax, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    qg = q.view(B, Hkv, g * Qmax, D)
    s = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hkv, g*Qmax, L]
    s = softcap * torch.tanh(s / softcap)
    s = s.view(B, Hkv, g, Qmax, -1).masked_fill(~mask[:, :, None], float("-inf"))
    p = torch.softmax(s, dim=-1).view(B, Hkv, g * Qmax, -1)
    return torch.matmul(p, v).view(B, Hq, Qmax, D)


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64 (-1 = released / padding)
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32/int64
    seq_lens: torch.Tensor,  # [B] int32/int64
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plan and run in one call; same signature as the Triton launcher."""
    plan = plan_paged_attention(
        cu_seqlens_q.tolist(),
        seq_lens.tolist(),
        block_tables.tolist(),
        k_cache.shape[1],
        sliding_window,
        q.device,
    )
    return run_paged_attention(q, k_cache, v_cache, plan, scale, softcap, k_scale, v_scale)

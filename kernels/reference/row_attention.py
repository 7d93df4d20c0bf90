"""Batch-invariant attention: every query row computed alone, over exactly the keys it sees, in token time.

The engine's batch-invariant mode (`EngineConfig.batch_invariant`, kvlab.engine.batch_invariant) runs each
query row of a step through the same call whatever else the step computes: a decode row, a row of a
prefill chunk and a row a draft adds to a verification pass reach the same numbers to the bit, because
each is `scaled_dot_product_attention` of one query ([1, Hkv, g, D]) over its own visible keys
([1, Hkv, n, D], in cache order), never a padded or batched matrix whose shape depends on the step.

What a row reads is defined by its own cache index c (token time), not by the step:
- the keys the plan shows it (causal, sliding window, released pages, tree mask: the reference's masks);
- with a format that keeps a residual window of R tokens, page j as its stored codes (dequantised) when
  it had left the window at c ((j + 1) * block_size <= c + 1 - R), and in full precision otherwise (c: where
  plain decoding puts the row, so a token tree's node counts its depth, `offsets`, not its tentative slot),
  even if a later row of the same step has since sealed it. `before` holds the pages as they were
  before this step's store (open pages: their residual rows, exact); this step's own new keys are
  taken from the layer's keys, rounded through the residual rows' dtype as a later read would be.

    before = open_before(k_cache, v_cache, pages_sealed_this_step, q.dtype)  # before the store
    out = row_attention(q, k_cache, v_cache, plan, scale, softcap, k_scale, v_scale,
                        residual=R, before=before, new=(key, value), residual_dtype=dt)

`open_before(k_cache, v_cache, pages, dtype)` takes `before`: the pages the step seals, as they were.
Slow by design (a call per query row): the oracle of the mode, and its CPU implementation.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from kvlab.kernels.attention_plan import AttentionPlan
from kvlab.kernels.reference.attention_parts import attention_logits, plan_parts
from kvlab.kernels.reference.paged_attention import gather_blocks


def open_before(k_cache, v_cache, pages: set[int], dtype: torch.dtype):
    """(pages [P], K [P, bs, Hkv, D], V) of `pages` as the pool holds them now (before a store: an open
    page's full-precision residual row), or None when there are none."""
    if not pages:
        return None
    device = k_cache.device
    p = torch.tensor(sorted(pages), dtype=torch.int64, device=device)
    return p, k_cache.read_pages(p, dtype), v_cache.read_pages(p, dtype)


def row_attention(
    q: torch.Tensor,  # [T, Hq, D] packed queries
    k_cache, v_cache,  # pools (tensors or packed PageStores), after this step's store
    plan: AttentionPlan,
    scale: float,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    residual: int | None = None,  # the format's residual window in tokens (None: every key read as stored)
    before=None,  # open_before(...) of the pages this step seals, taken before the store
    new: tuple[torch.Tensor, torch.Tensor] | None = None,  # the step's (key, value) [T, Hkv, D] (with `residual`)
    residual_dtype: torch.dtype | None = None,  # dtype of the residual rows (full-precision reads round to it)
    base: AttentionPlan | None = None,  # the step's plan, when `plan` is a sparse read's reduction of it
    offsets: list[int] | None = None,  # [T] each query's offset in token time from its sequence's first new
    # token (a token tree's node: its depth, not its preorder slot; None: its place in the chunk)
) -> torch.Tensor:
    """Attention output [T, Hq, D], each row alone (see the module docstring)."""
    out = q.new_empty(q.shape)
    Hq, D = q.shape[1:]
    bs = plan.block_size
    for part in plan_parts(plan):
        k_now = gather_blocks(k_cache, part.blocks, k_scale, q.dtype)  # [B, Hkv, L, D]
        v_now = gather_blocks(v_cache, part.blocks, v_scale, q.dtype)
        Hkv = k_now.shape[1]
        g = Hq // Hkv
        if residual is not None:
            where = [in_sequence(part, plan, base or plan, r, b) for r, b in enumerate(part.seq_rows)]
            k_full, v_full = full_precision(k_now, v_now, part, bs, where, before, new, residual_dtype)
            k_now, v_now = quantised(k_cache, k_now, part, bs), quantised(v_cache, v_now, part, bs)
        for b_local, b in enumerate(part.seq_rows):
            token0 = plan.cu_seqlens_q[b]
            for qi in range(int(part.q_lens[b_local])):
                visible = part.mask[b_local, 0, qi].nonzero().view(-1)  # [n] gathered positions it reads
                k, v = k_now[b_local][:, visible], v_now[b_local][:, visible]  # [Hkv, n, D]
                if residual is not None:
                    keys, start, first_token = where[b_local]
                    t = token0 + qi  # the row's own cache index in its sequence, in token time
                    c = start + (t - first_token if offsets is None else offsets[t] - offsets[first_token])
                    stored = ((keys[visible] // bs + 1) * bs <= c + 1 - residual)[None, :, None]  # left the window at c
                    k = torch.where(stored, k, k_full[b_local][:, visible])
                    v = torch.where(stored, v, v_full[b_local][:, visible])
                qr = q[token0 + qi].view(1, Hkv, g, D)
                if softcap is not None:
                    s = attention_logits(qr.reshape(1, Hq, 1, D), k[None], k.new_ones(1, 1, 1, k.shape[1],
                                         dtype=torch.bool), scale, softcap)  # [1, Hkv, g, 1, n]
                    p = torch.softmax(s, dim=-1).view(1, Hkv, g, -1)
                    o = torch.matmul(p, v[None].float()).to(q.dtype)
                else:
                    o = F.scaled_dot_product_attention(qr, k[None], v[None], scale=scale)  # [1, Hkv, g, D]
                out[token0 + qi] = o.reshape(Hq, D)
    return out


def quantised(store, gathered: torch.Tensor, part, block_size: int) -> torch.Tensor:
    """The part's gathered K or V [B, Hkv, L, D] as stored codes read: pages still open (their tokens in a
    residual row) encoded and decoded as sealing them will (a row of this step that sees the page as left
    the window reads it so: the page is sealed once no drafted token can be rejected)."""
    open_ = (store.area.row_of.index_select(0, part.blocks.reshape(-1)) >= 0).view(part.blocks.shape)  # [B, NB]
    if not bool(open_.any()):
        return gathered
    B, Hkv, L, D = gathered.shape
    pages = gathered.view(B, Hkv, L // block_size, block_size, D).permute(0, 2, 3, 1, 4)  # [B, NB, bs, Hkv, D]
    rows = pages[open_].float()  # [P, bs, Hkv, D]
    valid = torch.ones(rows.shape[:2], dtype=torch.bool, device=rows.device)
    coded = store.codec.decode(store.codec.encode(rows, valid), gathered.dtype)
    out = pages.clone()
    out[open_] = coded
    return out.permute(0, 3, 1, 2, 4).reshape(B, Hkv, L, D)


def in_sequence(part, plan: AttentionPlan, base: AttentionPlan, b_local: int, b: int):
    """Where row `b_local` of a part of `plan` sits in its sequence of the step's `base` plan (the same plan,
    or the one a sparse read reduced, whose tables hold only the selected pages and whose verify rows are rows
    of their own) -> (cache index in the sequence of each gathered key [L] (-1: pads), the cache index of the
    sequence's first new token, its first packed query token)."""
    bs = plan.block_size
    if base is plan:
        return part.key_index[b_local], plan.seq_lens[b] - int(part.q_lens[b_local]), plan.cu_seqlens_q[b]
    token = plan.cu_seqlens_q[b]
    s = bisect.bisect_right(base.cu_seqlens_q, token) - 1  # the base sequence of the row's query
    table = base.block_tables[s]
    table = table.tolist() if isinstance(table, torch.Tensor) else list(table)
    position = {page: j for j, page in enumerate(table) if page >= 0}
    keys = part.key_index[b_local].clone()
    offsets = torch.arange(bs, device=keys.device)
    for col, page in enumerate(part.blocks[b_local].tolist()):
        cols = keys[col * bs:(col + 1) * bs]
        j = position.get(page)
        cols.copy_(torch.where(cols >= 0, j * bs + offsets, -1) if j is not None else torch.full_like(cols, -1))
    q_len = base.cu_seqlens_q[s + 1] - base.cu_seqlens_q[s]
    return keys, base.seq_lens[s] - q_len, base.cu_seqlens_q[s]


def full_precision(k_now, v_now, part, bs: int, where: list, before, new, residual_dtype):
    """The part's gathered K/V [B, Hkv, L, D] as full-precision reads see them: the pages this step seals
    as they were before it (`before`) and the step's own keys as a residual row returns them (`where`: each
    row's in_sequence())."""
    k_full, v_full = k_now.clone(), v_now.clone()
    if before is not None:
        pages, k_old, v_old = before
        at = {p: i for i, p in enumerate(pages.tolist())}
        for b_local, blocks in enumerate(part.blocks.tolist()):
            for col, page in enumerate(blocks):
                i = at.get(page)
                if i is not None and part.key_index[b_local, col * bs] >= 0:
                    k_full[b_local][:, col * bs:(col + 1) * bs] = k_old[i].transpose(0, 1)
                    v_full[b_local][:, col * bs:(col + 1) * bs] = v_old[i].transpose(0, 1)
    for b_local, (keys, start, first_token) in enumerate(where):
        fresh = (keys >= start).nonzero().view(-1)  # this step's keys
        if fresh.numel():
            tokens = first_token + keys[fresh] - start
            for full, x in ((k_full, new[0]), (v_full, new[1])):
                full[b_local][:, fresh] = x.index_select(0, tokens).float().to(residual_dtype).to(
                    full.dtype).transpose(0, 1)
    return k_full, v_full

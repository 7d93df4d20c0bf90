"""The attention implementation kvlab registers with transformers (`attn_implementation="kvlab_paged"`).

The model's own forward runs on one packed ragged batch ([1, T] tokens from
many sequences). Each attention layer hands us its new queries, keys and values
(RoPE applied); we write the keys/values into the paged pool and attend
through the block tables. Everything per step (slot mappings, attention plans)
is planned once by `plan_step` (from the block manager: per-group cached
lengths, tables and slot mappings) into a `StepMetadata` that travels to every
layer as the forward keyword `kvlab_meta`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from kvlab.kernels.attention_plan import AttentionPlan, plan_paged_attention
from kvlab.cache.block_manager import BlockManager
from kvlab.kernels import ops
from kvlab.kernels.reference.row_attention import open_before, row_attention
from kvlab.cache.kv_cache import KVCache
from kvlab.policies.sparse_read import SparseStep
from kvlab.speculation.tree_verifier import tree_depths

ATTN_IMPLEMENTATION = "kvlab_paged"


@dataclass
class StepMetadata:
    cache: KVCache
    slot_mapping: list[torch.Tensor]  # per layer group: [T] int64 slot of each new token
    plans: list[AttentionPlan]  # per layer group
    query_rows: torch.Tensor | None = None  # [W] packed tokens whose queries the cache policy needs
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [W, Hq, D], filled by the layers
    collect_stats: bool = False  # the cache policy accumulates attention statistics (H2O)
    stats: dict[int, torch.Tensor] = field(default_factory=dict)  # group -> [B, its KV heads (Hkv, or 1 with
    # per-head tables), its max cached], filled by the layers: one table's statistics each, so per-head tables
    # (a layer's KV heads holding different numbers of tokens) keep theirs apart
    sparse: SparseStep | None = None  # decode rows read only the pages a sparse-reading policy selects
    batch_invariant: bool = False  # every query row attends alone (kvlab.engine.batch_invariant)
    offsets: list[int] | None = None  # batch-invariant: [T] each token's offset in token time in its chunk (a tree
    # node: its depth), where plain decoding places the row (kernels/reference/row_attention.py)
    before: dict[tuple[int, int], tuple] = field(default_factory=dict)  # batch-invariant, residual window: (layer,
    # group) -> the pages
    # the step seals as they were before it (kernels/reference/row_attention.py open_before)


def plan_step(seqs: list, num_new_tokens: list[int], block_manager: BlockManager, cache: KVCache,
              device: torch.device, tree_mask: torch.Tensor | None = None,
              batch_invariant: bool = False) -> StepMetadata:
    """The step's attention metadata, once for every layer: per group, the slot of each new token
    and the attention plan over the group's cached slots (not the tokens' positions: a compacted
    group holds fewer slots than its sequence has tokens)."""
    bm = block_manager
    n = torch.tensor(num_new_tokens, dtype=torch.int64)  # [B]
    cu = [0]
    for k in num_new_tokens:
        cu.append(cu[-1] + k)
    seq_of = torch.repeat_interleave(torch.arange(len(seqs)), n)  # [T]
    local = torch.arange(cu[-1]) - torch.tensor(cu[:-1], dtype=torch.int64)[seq_of]  # [T] index within its chunk
    mappings, plans, seals = [], [], []
    drafted = [len(seq.draft_token_ids) for seq in seqs]  # batch-invariant mode: a draft's tokens seal nothing
    for g, group in enumerate(bm.groups):
        tables, lens = bm.block_tables(seqs, g), bm.cached_lens(seqs, g)
        index = (torch.tensor(lens, dtype=torch.int64) - n)[seq_of] + local  # [T] cache index of each new token
        mappings.append(slot_mapping(tables, seq_of, index, bm.block_size).to(device))
        plans.append(plan_paged_attention(cu, lens, tables, bm.block_size, group.sliding_window, device,
                                          tree_mask=tree_mask, null_block=cache.null_page))
        if cache.residual is not None and batch_invariant:
            seals.append(left_window(tables, lens, num_new_tokens, drafted, cache.residual, bm.block_size,
                                     cache.area.row))
        elif cache.residual is not None:
            held = [s.tree_slots(k) for s, k in zip(seqs, num_new_tokens)]
            seals.append(leaving_window(tables, lens, num_new_tokens, cache.residual, bm.block_size, held))
    before = sealed_before(cache, bm, seals) if batch_invariant and cache.residual is not None else {}
    cache.begin_step(mappings, seals if cache.residual is not None else None)
    sparse = cache.sparse_read.begin_step(seqs, num_new_tokens, plans) if cache.sparse_read is not None else None
    return StepMetadata(cache=cache, slot_mapping=mappings, plans=plans, sparse=sparse,
                        batch_invariant=batch_invariant, before=before,
                        offsets=token_offsets(seqs, num_new_tokens) if batch_invariant else None)


def token_offsets(seqs: list, num_new_tokens: list[int]) -> list[int]:
    """[T] each new token's offset from its chunk's first in token time: its place in the chunk, except a token
    tree's nodes (the last k of a verify chunk, in preorder), which sit at the root's offset plus their depth."""
    offsets = []
    for seq, n in zip(seqs, num_new_tokens):
        k = len(seq.draft_token_ids)
        if seq.draft_parents[:k] and n == 1 + k:
            depths = tree_depths([-1] + [p + 1 for p in seq.draft_parents[:k]])
            offsets += list(range(n - k)) + [n - k - 1 + d for d in depths[1:]]
        else:
            offsets += list(range(n))
    return offsets


def plan_view(tables: list[list[list[int]]], lens: list[list[int]], block_manager: BlockManager, cache: KVCache,
              device: torch.device) -> StepMetadata:
    """A self-speculating draft's pass (kvlab/speculation/drafts/self_compressed.py): one new token a sequence,
    per group g the draft's own tables[g][b] (view pages of the target's, then scratch pages) and cached slots
    lens[g][b] after the token, which goes to cache index lens - 1 of that table (a scratch slot). No step of
    the cache begins: the draft writes only scratch pages of an element-wise format."""
    bs, mappings, plans = block_manager.block_size, [], []
    for g, group in enumerate(block_manager.groups):
        slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables[g], lens[g])]
        mappings.append(torch.tensor(slots, dtype=torch.int64, device=device))  # [B]
        used = [t[:-(-n // bs)] for t, n in zip(tables[g], lens[g])]  # the pages up to the new token
        plans.append(plan_paged_attention(list(range(len(slots) + 1)), lens[g], used, bs, group.sliding_window,
                                          device, null_block=cache.null_page))
    return StepMetadata(cache=cache, slot_mapping=mappings, plans=plans)


def sealed_before(cache: KVCache, bm: BlockManager, seals: list[set[int]]) -> dict[tuple[int, int], tuple]:
    """(layer, group) -> the open pages the step seals (left the residual window), read before any layer's store
    seals them: what the batch-invariant rows before the seal point read in full precision."""
    before = {}
    for g, group in enumerate(bm.groups):
        pages = {p for p in seals[g] if cache.area.row(p) >= 0}
        for layer in group.layers:
            before[layer, g] = open_before(cache.k(layer), cache.v(layer), pages, cache.compute_dtype)
    return before


def leaving_window(tables: list[list[int]], lens: list[int], num_new: list[int], residual: int,
                   block_size: int, held: list[int] | None = None) -> set[int]:
    """Pages whose tokens all became older than the newest `residual` this step (a quantised
    format's residual window, kvlab.cache.quant.page_store): page j of a table holds cache indices
    [j * bs, (j + 1) * bs) and leaves once (j + 1) * bs <= len - residual. `held[b]`: the last that many
    of table b's slots are a token tree's tentative nodes, which the window does not count (their pages
    stay open until the accepted path is in place: kvlab.cache.paged_kv.PagedKV.move_path seals them)."""
    pages = set()
    for b, (table, length, n) in enumerate(zip(tables, lens, num_new)):
        first = max(0, length - n - residual) // block_size
        last = max(0, length - (held[b] if held else 0) - residual) // block_size
        pages.update(p for p in table[first:last] if p >= 0)
    return pages


def left_window(tables: list[list[int]], lens: list[int], num_new: list[int], drafted: list[int], residual: int,
                block_size: int, row_of: Callable[[int], int]) -> set[int]:
    """Batch-invariant mode: the pages open (`row_of(page) >= 0`) or written this step whose tokens are all older than the newest
    `residual` of the sequence's tokens before its drafted ones (token time: a drafted token that may be
    rejected seals nothing; the rows of the step that see such a page as left read it quantised on the fly,
    kernels/reference/row_attention.py). Pages seal in order, so each table is scanned back from its
    last page to leave until a page that is not open."""
    pages = set()
    for table, length, n, k in zip(tables, lens, num_new, drafted):
        first_written = (length - n) // block_size  # the first page this step writes
        j = max(0, length - k - residual) // block_size - 1
        while j >= 0 and table[j] >= 0 and (j >= first_written or row_of(table[j]) >= 0):
            pages.add(table[j])
            j -= 1
    return pages


def slot_mapping(tables: list[list[int]], seq_of: torch.Tensor, index: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of every new token: tables[b][index // block_size] * block_size + index % block_size -> [T] int64."""
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)  # [B, width]
    return padded[seq_of, index // block_size] * block_size + index % block_size


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kvlab_meta: StepMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if kvlab_meta is None:
        raise RuntimeError("kvlab_paged attention runs only inside the kvlab engine (no kvlab_meta given)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if softcap is None:
        softcap = getattr(module, "attn_logit_softcapping", None)
    out = paged_attention(kvlab_meta, module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                          value[0].transpose(0, 1), scaling, softcap)  # [T, Hq, D]
    return out.unsqueeze(0), None


def paged_attention(meta: StepMetadata, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scaling: float, softcap: float | None) -> torch.Tensor:
    """One layer's attention on packed rows: q [T, Hq, D], key / value [T, Hkv, D] (RoPE applied) -> [T, Hq, D].
    The new keys and values go into the pool first (kvlab/engine/lean_forward.py calls this directly)."""
    if meta.query_rows is not None:
        meta.queries[layer] = q.index_select(0, meta.query_rows)  # [W, Hq, D]
    entries = meta.cache.groups_of[layer]  # [(group, KV head)]: one, or one per KV head (per-head tables)
    outs = []
    for group, head in entries:
        meta.cache.store(layer, key, value, meta.slot_mapping[group], head)
        qh = q if head is None else q.unflatten(1, (key.shape[1], -1))[:, head]  # [T, Hq or g, D]
        plan = meta.plans[group] if meta.sparse is None else meta.sparse.plan(layer, qh, meta.plans[group], scaling)
        if meta.batch_invariant:
            base = meta.plans[group]  # the step's plan (`plan` may be a sparse read's reduction of it)
            outs.append(rows_alone(meta, layer, group, head, qh, key, value, plan, scaling, softcap, base))
            continue
        out = ops.run_paged_attention(qh, meta.cache.k(layer), meta.cache.v(layer), plan, scaling,
                                      softcap, *meta.cache.head_scales(layer, head),
                                      return_stats=meta.collect_stats)  # [T, Hq or g, D]
        if meta.collect_stats:  # attention mass each cached key received from this step's queries
            out, meta.stats[group] = out
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [T, Hq, D]


def rows_alone(meta: StepMetadata, layer: int, group: int, head: int | None, q, key, value, plan, scaling, softcap,
               base):
    """The batch-invariant attention of one layer (and KV head): each query row alone, in token time."""
    cache = meta.cache
    if head is not None:
        key, value = key[:, head : head + 1], value[:, head : head + 1]
    residual, scales = cache.residual, cache.head_scales(layer, head)
    out = row_attention(q, cache.k(layer), cache.v(layer), plan, scaling, softcap, *scales,
                        residual=residual, before=meta.before.get((layer, group)), new=(key, value),
                        residual_dtype=None if residual is None else cache.quant.residual_storage_dtype(q.dtype),
                        base=base, offsets=meta.offsets)
    if meta.collect_stats:  # the policy's statistics from the reference (their sums are not made row-invariant)
        from kvlab.kernels.reference.attention_stats import attention_stats_from_plan

        meta.stats[group] = attention_stats_from_plan(q, cache.k(layer), plan, scaling, softcap, scales[0], None)
    return out


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION

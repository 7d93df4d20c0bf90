"""Turns a scheduled batch into one packed forward pass of the model.

The batch's tokens are laid end to end ([1, T]); each sequence contributes the
next `n` of its uncomputed tokens, at RoPE positions taken from the sequence.
Where their keys and values go, and what they attend to, is planned once per
step from the block manager (`kvlab.engine.attention.plan_step`) and shared by every layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from kvlab.engine.attention import plan_step
from kvlab.engine.batch_invariant import BatchInvariantMode
from kvlab.engine.lean_forward import lean_forward
from kvlab.cache.paged_kv import PagedKV
from kvlab.engine.scheduler import ScheduledBatch
from kvlab.sequence import Sequence
from kvlab.speculation.tree_verifier import ancestor_mask, tree_depths


@dataclass
class StepOutput:
    logits: torch.Tensor  # [R, V] float32, one row per requested position
    sample_rows: list[tuple[Sequence, int]]  # sequences that sample a token, and their logits row
    score_rows: list[tuple[Sequence, list[int], list[int]]]  # scoring: (seq, rows, target token ids)
    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> per seq [W, Hq, D]
    stats: dict[int, torch.Tensor] = field(default_factory=dict)  # group -> [B, its KV heads, max cached] mass
    verify_rows: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # drafted: (seq, k + 1 rows)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: PagedKV, device: torch.device | str, batch_invariant: bool = False):
        self.model = model
        self.batch_invariant = batch_invariant  # every row computed alike (kvlab.engine.batch_invariant)
        self.kv = kv  # KV moves (copy-on-write copies) go through it; reads through the two below
        self.cache = kv.cache
        self.block_manager = kv.block_manager
        self.device = torch.device(device)
        # transformers' forward without its module stack, same ops (kvlab/engine/lean_forward.py); None: not this model
        self.lean = None if batch_invariant else lean_forward(model)

    def lean_for(self, model: torch.nn.Module):
        """The lean forward of another model that runs beside this one (a draft's early exit over the same
        layers), or None where this runner runs transformers' forward (batch-invariant mode, a model it cannot take)."""
        return None if self.lean is None else lean_forward(model)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, query_rows: list[int] | None = None, stats: bool = False) -> StepOutput:
        """One forward pass; `query_rows[i]`: keep the queries of the last that many tokens of
        sequence i's chunk in every layer (for the cache policy), 0 for none; `stats`: return the
        attention mass every cached key received in every table (layer, or per-head table)."""
        input_ids, positions, meta, keep, sample_rows, score_rows, verify_rows = self.prepare(batch)
        meta.collect_stats = stats
        counts = []
        if query_rows:
            rows, offset = [], 0
            for n, w in zip(batch.num_new_tokens, query_rows):
                counts.append(min(n, w))
                rows.extend(range(offset + n - counts[-1], offset + n))
                offset += n
            meta.query_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.kv.apply_copies()  # copy-on-write: before the forward writes into the copies
        logits = None if self.lean is None else self.lean(input_ids, positions, keep, meta)  # [R, V]
        if logits is None:
            with BatchInvariantMode() if self.batch_invariant else contextlib.nullcontext():
                logits = self.model(
                    input_ids=input_ids[None],
                    position_ids=positions[None],
                    use_cache=False,
                    logits_to_keep=keep,
                    kvlab_meta=meta,
                ).logits[0]
        queries = {layer: list(q.split(counts)) for layer, q in meta.queries.items()} if counts else {}
        return StepOutput(logits.float(), sample_rows, score_rows, queries=queries, stats=meta.stats,
                          verify_rows=verify_rows)

    def prepare(self, batch: ScheduledBatch):
        ids: list[int] = []
        positions: list[int] = []
        offset = 0
        keep: list[int] = []
        sample_rows: list[tuple[Sequence, int]] = []
        score_rows: list[tuple[Sequence, list[int], list[int]]] = []
        verify_rows: list[tuple[Sequence, list[int]]] = []
        trees: list[tuple[int, int, torch.Tensor]] = []  # token trees: (packed start, root's index in the chunk, mask)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            ids.extend(seq.draft_token_ids)  # tentative tokens after the last one (the scheduler fitted them)
            positions.extend(range(start, end))
            if seq.draft_token_ids:  # speculation: logits after the last token and after every draft token
                k = len(seq.draft_token_ids)
                if seq.draft_parents[:k]:  # a token tree: a node sits at the root's position + its depth
                    parents = [-1] + [i + 1 for i in seq.draft_parents[:k]]
                    positions[-k:] = [end - k - 1 + d for d in tree_depths(parents)[1:]]
                    trees.append((offset, n - k - 1, ancestor_mask(parents)))
                verify_rows.append((seq, list(range(len(keep), len(keep) + k + 1))))
                keep.extend(range(offset + n - k - 1, offset + n))
                offset += n
                continue
            if seq.is_scoring:  # rows whose next token is a target not scored yet (none twice after a preemption)
                lo = max(start, seq.score_from - 1 + seq.num_scored_tokens)
                hi = min(end, seq.num_tokens - 1)
                if hi > lo:
                    rows = list(range(len(keep), len(keep) + hi - lo))  # consecutive (read as a slice)
                    keep.extend(offset + p - start for p in range(lo, hi))
                    score_rows.append((seq, rows, seq.token_ids[lo + 1 : hi + 1]))
            elif end == seq.num_tokens:
                sample_rows.append((seq, len(keep)))
                keep.append(offset + n - 1)
            offset += n
        if not keep:  # no row is read this step (prefill chunks only): compute one, ignore it
            keep.append(0)
        dev = self.device
        mask = tree_mask(trees, max(batch.num_new_tokens), len(ids))
        meta = plan_step(batch.seqs, batch.num_new_tokens, self.block_manager, self.cache, dev, mask,
                         batch_invariant=self.batch_invariant)
        return (
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),  # [T] RoPE position of each new token
            meta,
            torch.tensor(keep, dtype=torch.int64, device=dev),
            sample_rows,
            score_rows,
            verify_rows,
        )




def tree_mask(trees: list[tuple[int, int, torch.Tensor]], width: int, num_tokens: int) -> torch.Tensor | None:
    """[T, width] bool mask over each sequence's new tokens (None without trees): every row sees
    everything (the causal rule still applies) except the nodes of a token tree, which see the
    tokens before their root and, of the tree, only their ancestors."""
    if not trees:
        return None
    mask = torch.ones(num_tokens, width, dtype=torch.bool)  # [T, width]
    for start, root, ancestors in trees:  # ancestors [k+1, k+1] over the root and the k drafted nodes
        size = ancestors.shape[0]
        mask[start + root:start + root + size, root:root + size] = ancestors
    return mask

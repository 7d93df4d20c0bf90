"""Turns a scheduled batch into one packed forward pass of the model.

The batch's tokens are laid end to end ([1, T]); each sequence contributes the
next `n` of its uncomputed tokens. The per-step plan (slot mapping and attention
plan per layer group) is built once here and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.attention import StepMetadata
from kvlab.block_manager import BlockManager
from kvlab.kernels import ops
from kvlab.kv_cache import KVCache
from kvlab.scheduler import ScheduledBatch
from kvlab.sequence import Sequence


@dataclass
class StepOutput:
    logits: torch.Tensor  # [R, V] float32, one row per requested position
    sample_rows: list[tuple[Sequence, int]]  # sequences that sample a token, and their logits row
    score_rows: list[tuple[Sequence, list[int], list[int]]]  # scoring: (seq, rows, target token ids)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, block_manager: BlockManager,
                 device: torch.device | str):
        self.model = model
        self.cache = cache
        self.block_manager = block_manager
        self.device = torch.device(device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        input_ids, positions, meta, keep, sample_rows, score_rows = self.prepare(batch)
        for group, pairs in enumerate(self.block_manager.take_copies()):
            self.cache.copy_blocks(group, pairs)
        out = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=keep,
            kvlab_meta=meta,
        )
        return StepOutput(out.logits[0].float(), sample_rows, score_rows)

    def prepare(self, batch: ScheduledBatch):
        bm = self.block_manager
        ids: list[int] = []
        positions: list[int] = []
        cu_seqlens = [0]
        seq_lens: list[int] = []
        keep: list[int] = []
        sample_rows: list[tuple[Sequence, int]] = []
        score_rows: list[tuple[Sequence, list[int], list[int]]] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            offset = cu_seqlens[-1]
            cu_seqlens.append(offset + n)
            seq_lens.append(end)
            if seq.is_scoring:  # rows whose next token is a target not scored yet (none twice after a preemption)
                lo = max(start, seq.score_from - 1 + seq.num_scored_tokens)
                hi = min(end, seq.num_tokens - 1)
                if hi > lo:
                    rows = list(range(len(keep), len(keep) + hi - lo))
                    keep.extend(offset + p - start for p in range(lo, hi))
                    score_rows.append((seq, rows, seq.token_ids[lo + 1 : hi + 1]))
            elif end == seq.num_tokens:
                sample_rows.append((seq, len(keep)))
                keep.append(offset + n - 1)
        tables = [[a.block_table(seq.seq_id) for seq in batch.seqs] for a in bm.allocators]  # per group
        plans = [
            ops.plan_paged_attention(cu_seqlens, seq_lens, tables[g], bm.block_size, group.sliding_window,
                                     self.device)
            for g, group in enumerate(bm.groups)
        ]
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.int64)  # [T] cache index of each new token
        seq_of = torch.repeat_interleave(torch.arange(len(batch.seqs)), torch.tensor(batch.num_new_tokens))  # [T]
        meta = StepMetadata(
            cache=self.cache,
            slot_mapping=[slot_mapping(t, seq_of, pos, bm.block_size).to(dev) for t in tables],
            plans=plans,
        )
        return (
            torch.tensor(ids, dtype=torch.int64, device=dev),
            pos.to(dev),
            meta,
            torch.tensor(keep, dtype=torch.int64, device=dev),
            sample_rows,
            score_rows,
        )


def slot_mapping(tables: list[list[int]], seq_of: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of every new token: tables[b][pos // block_size] * block_size + pos % block_size -> [T] int64."""
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)  # [B, width]
    return padded[seq_of, pos // block_size] * block_size + pos % block_size

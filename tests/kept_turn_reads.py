"""What a kept compressed turn holds and what a continuation's first forward reads of it
(EngineConfig.reuse_compressed): shared by the kept-turn tests (tests/engine/test_compressed_turns.py, test_compressed_turns_heads.py)."""

from __future__ import annotations

import torch

from kvlab import LLM


def held(llm: LLM, keys: list[int], lengths: list[int] | None = None) -> list[tuple]:
    """Per layer group, what tables `keys` hold in their first `lengths` slots (default: all): every layer's keys
    and values as read (dequantised; open pages from their residual rows), which pages are open, and (sparse
    reading) each page's key summary."""
    cache, bm, a = llm.engine.cache, llm.engine.block_manager, llm.engine.block_manager.allocator
    out = []
    for g, key in enumerate(keys):
        n = a.num_tokens(key) if lengths is None else lengths[g]
        slots = torch.tensor(a.slot_ids(key, 0, n), dtype=torch.int64)
        pages = a.block_table(key)[: -(-n // bm.block_size)]
        kv = [cache.read_slots(layer, slots, torch.float32) for layer in bm.groups[g].layers]
        opened = [cache.area.row(p) >= 0 for p in pages] if cache.area is not None else []
        sums = [cache.sparse_read.summaries.bounds[cache.slot_of[layer]][pages].clone()
                for layer in bm.groups[g].layers] if cache.sparse_read is not None else []
        out.append((n, kv, opened, sums))
    return out


def same(a: list[tuple], b: list[tuple]) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(eq(i, j) for i, j in zip(x, y))
        return x == y
    return eq(a, b)


def spy_turn_reads(llm: LLM) -> tuple[list, dict]:
    """(what each kept turn held when kept, seq id -> what its first forward reads of the slots its turn covers)."""
    kept, first, lengths, batch = [], {}, {}, {}
    bm, runner = llm.engine.block_manager, llm.engine.runner
    keep_turn, prepare, apply, allocate_turn = bm.keep_turn, runner.prepare, runner.kv.apply_copies, bm._allocate_turn

    def keeping(seq, state=None):
        done = keep_turn(seq, state)
        if done:
            kept.append(held(llm, next(reversed(bm.kept_turns.entries.values())).keys))
        return done

    def preparing(b):
        batch["seqs"] = list(b.seqs)
        return prepare(b)

    def applying():
        n = apply()  # the copies are in place: what the forward reads
        for seq in batch["seqs"]:
            if seq.seq_id in lengths:
                first[seq.seq_id] = held(llm, bm._keys(seq), lengths.pop(seq.seq_id))
        return n

    def allocating(seq, num_tokens, hit):  # the slots its turn covers
        allocate_turn(seq, num_tokens, hit)
        lengths[seq.seq_id] = [bm.allocator.num_tokens(k) - num_tokens for k in bm._keys(seq)]

    bm.keep_turn, runner.prepare, runner.kv.apply_copies, bm._allocate_turn = keeping, preparing, applying, allocating
    return kept, first

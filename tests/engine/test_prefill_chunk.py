"""The per-sequence prefill chunk (`max_prefill_chunk`) and admission on a compressed footprint.

A policy compressing after every chunk (`when="chunk"`) never lets a prompt hold more than what it keeps
of the prompt plus one chunk, so the block manager admits a prompt when that fits, not its whole length.
Torch-free scheduler cases first, then the engine on the tiny random Llama.
"""

from __future__ import annotations

import torch

from kvlab import LLM, SamplingParams
from kvlab.engine.scheduler import Scheduler

from helpers import manager, request, run_step


# -- torch-free: the scheduler and the block manager ------------------------------------
def test_each_prompt_chunk_is_capped_and_never_runs_past_the_prompt():
    a, b = request(0, 20, max_tokens=3), request(1, 20, max_tokens=3)
    s = Scheduler(manager(64, 8), max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=8)
    s.add(a), s.add(b)
    sizes = [run_step(s).num_new_tokens for _ in range(5)]
    assert sizes == [[8, 8], [8, 8], [4, 4], [1, 1], [1, 1]]  # 20 = 8 + 8 + 4, then decodes
    assert a.is_finished and b.is_finished


def test_a_recompute_chunks_its_prompt_then_its_outputs():
    seq = request(0, 10, max_tokens=8)
    seq.token_ids += [7] * 5  # preempted after 5 outputs: 15 tokens to recompute
    s = Scheduler(manager(64, 8), max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=8)
    s.add(seq)
    assert [run_step(s).num_new_tokens for _ in range(3)] == [[8], [2], [5]]  # the prompt's end is a chunk end


def test_admission_counts_the_kept_prompt_plus_one_chunk():
    """A 40-token prompt keeping a quarter (10 tokens) plus an 8-token chunk needs 18 slots: 5 pages of 4,
    not the 10 pages of its whole length."""
    seq = request(0, 40)
    for free in (5, 9):
        compressed = manager(free, 8, kept_tokens=lambda g, n: n // 4)
        assert compressed.can_allocate(seq)
        assert not manager(free, 8).can_allocate(seq)
    assert manager(4, 8, kept_tokens=lambda g, n: n // 4).can_allocate(seq) is False
    assert manager(10, 64, kept_tokens=lambda g, n: n // 4).can_allocate(seq)  # a chunk past the prompt: all of it
    assert not manager(9, 64, kept_tokens=lambda g, n: n // 4).can_allocate(seq)


# -- the engine ------------------------------------------------------------------------
def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length,), generator=g).tolist() for _ in range(n)]


GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SNAP_CHUNK = {"compression_ratio": 0.75, "when": "chunk", "window_size": 8}


def test_the_cap_alone_leaves_full_outputs_unchanged():
    ps = prompts(4, 70, seed=1)
    want = [o.token_ids for o in LLM("random:llama-tiny", max_num_batched_tokens=256).generate(ps, GREEDY)]
    llm = LLM("random:llama-tiny", max_num_batched_tokens=256, max_prefill_chunk=16)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want
    assert llm.engine.block_manager.kept_tokens is None  # full: admission still counts every token


def test_the_cap_admits_more_sequences_under_per_chunk_compression():
    """24 prompts of 200 tokens in a 512 KiB pool (128 pages of 16 tokens of one layer, 2 layers): per-chunk
    compression without a cap computes each prompt in one chunk and is admitted on all 200 tokens (9 at most
    ran together); capped at 32 it is admitted on 50 kept + 32 (16 ran together)."""
    ps = prompts(24, 200, seed=2)

    def peak(**engine):
        llm = LLM("random:llama-tiny", policy="snapkv", policy_args=SNAP_CHUNK, kv_cache_memory="512KiB",
                  max_num_batched_tokens=256, max_model_len=256, **engine)
        outs = llm.generate(ps, GREEDY)
        assert all(len(o.token_ids) == 6 for o in outs)
        return llm.stats()["max_concurrent_seqs"]

    uncapped, capped = peak(), peak(max_prefill_chunk=32)
    assert capped > uncapped, (capped, uncapped)


def test_preempted_sequences_under_per_chunk_compression_recompute_the_same_answer():
    """A pool too small for every admitted sequence to grow preempts some; recomputed with the same chunks
    (the cap, the prompt's end), they give what an ample pool gives."""
    ps = prompts(6, 120, seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def run(memory):
        llm = LLM("random:llama-tiny", policy="snapkv", policy_args=SNAP_CHUNK, kv_cache_memory=memory,
                  max_num_batched_tokens=512, max_model_len=256, max_prefill_chunk=32)
        outs = llm.generate(ps, params)
        return [o.token_ids for o in outs], llm.stats()["preemptions"]

    want, none = run("8MiB")
    got, preempted = run("160KiB")
    assert none == 0 and preempted > 0
    assert got == want

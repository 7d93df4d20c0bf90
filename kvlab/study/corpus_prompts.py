"""Prompts cut from the default corpus (WikiText-2) at evenly spaced offsets, of uniformly random lengths.

Used by experiments/bench_shared_pool.py, bench_policy_capacity.py and bench_sparse_decode.py.

    ps = corpus_prompts(tokenizer, n=16, min_len=64, max_len=512, seed=0)   # [16 lists of token ids]
"""

from __future__ import annotations

import random


def corpus_prompts(tokenizer, n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """`n` WikiText-2 cuts at evenly spaced offsets, lengths uniform in [min_len, max_len]."""
    from kvlab.study.tasks.data import corpus_tokens, evenly_spaced_windows
    from kvlab.study.workloads.azure import DEFAULT_CORPUS

    rng = random.Random(seed)
    windows = evenly_spaced_windows(corpus_tokens(DEFAULT_CORPUS, None, tokenizer), max_len, n)
    return [w[:rng.randint(min_len, max_len)] for w in windows]

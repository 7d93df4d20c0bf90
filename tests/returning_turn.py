"""A conversation whose first turn is pushed down a tier before it returns: shared by the tier tests."""

from __future__ import annotations

import torch

from kvlab import LLM, SamplingParams

ENGINE = dict(block_size=4, max_model_len=128, kv_cache_memory=24 * 1024, max_num_batched_tokens=32,
              enable_prefix_caching=True)
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


FIRST = tokens(20, 0)  # conversation A's first turn
FILLERS = [tokens(30, s) for s in (1, 2)]  # push A's pages out of the pool (12 pages of 4 tokens), down to the tier
OTHER = tokens(12, 9)  # an unrelated request arriving with A's return


def returning_turn(llm) -> list[int]:
    """A's first turn, then fillers (A's pages go down a tier); A's second prompt."""
    answer = llm.generate([FIRST], PARAMS)[0].token_ids
    for f in FILLERS:
        llm.generate([f], PARAMS)
    return FIRST + answer + tokens(7, 5)


_ref: list = []


def reference() -> list[list[int]]:
    if not _ref:
        llm = LLM("random:llama-tiny", **ENGINE)
        second = returning_turn(llm)
        _ref.append([o.token_ids for o in llm.generate([second, OTHER], PARAMS)])
    return _ref[0]

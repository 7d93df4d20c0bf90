"""The engine's waste figures (llm.stats()) against values worked out by hand from kvlab.metrics' definitions.

random:llama-tiny (2 layers, 2 KV heads, head_dim 16, float32) costs 2 * 2 * 2 * 16 * 4 = 512 bytes per token,
so 4-token blocks cost 2 KiB and a 32 KiB budget is a pool of 16 blocks (64 slots). Prompts are prefilled in
one step, then each step computes one token; a request finishes in the step that samples its last token, and
that token is never written, so its final length in the cache is prompt + max_tokens - 1.

Per step, for every running sequence (allocated slots a, written slots w, final length f):
    internal    += max(0, a - max(f, w))
    reservation += max(0, min(a, f) - w)
and each figure is the sum over steps / steps / pool slots.
"""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams

BLOCK, POOL_BLOCKS = 4, 16
POOL_SLOTS = BLOCK * POOL_BLOCKS

# One request: prompt 6, max_tokens 5, final length 6 + 5 - 1 = 10; written after each of the 5 steps: 6 7 8 9 10.
#   paged: blocks on demand, allocated 8 8 8 12 12
#       internal    0 0 0 2 2 = 4        reservation 2 1 0 1 0 = 4
#   contiguous, reserve="request": prompt + max_tokens = 11 tokens -> 3 blocks, allocated 12 every step
#       internal    2 2 2 2 2 = 10       reservation 4 3 2 1 0 = 10
#   contiguous, reserve="max_model_len" (32): 8 blocks, allocated 32 every step
#       internal    22 x 5 = 110         reservation 4 3 2 1 0 = 10
# Two requests on paged: the one above plus prompt 3, max_tokens 2 (final 4; written 3 4; allocated 4 4):
#       internal    4 + 0 = 4            reservation 4 + (1 + 0) = 5;  still 5 steps
CASES = {
    "paged": ("paged", {}, None, [(6, 5)], 5, 4, 4),
    "contiguous-request": ("contiguous", {"reserve": "request"}, None, [(6, 5)], 5, 10, 10),
    "contiguous-max_model_len": ("contiguous", {"reserve": "max_model_len"}, 32, [(6, 5)], 5, 110, 10),
    "paged-two-requests": ("paged", {}, None, [(6, 5), (3, 2)], 5, 4, 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_waste_matches_a_hand_computation(case):
    allocator, args, max_model_len, requests, steps, internal, reservation = CASES[case]
    llm = LLM("random:llama-tiny", block_size=BLOCK, kv_cache_memory=POOL_BLOCKS * 2048, allocator=allocator,
              allocator_args=args, max_model_len=max_model_len)
    prompts = [list(range(10, 10 + n)) for n, _ in requests]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in requests]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [m for _, m in requests]
    s = llm.stats()
    assert s["kv_blocks_total"] == POOL_BLOCKS
    assert s["num_steps"] == steps and s["preemptions"] == 0
    assert s["waste_internal"] == pytest.approx(internal / steps / POOL_SLOTS)
    assert s["waste_reservation"] == pytest.approx(reservation / steps / POOL_SLOTS)
    assert s["waste_external"] == 0  # nothing ever waits

"""The model-free trace replay (kvlab/study/workloads/bookkeeping.py): the pool breakdown per step against
hand computations, paging's analytic bound, and bad input. Torch-free and fast."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.study.workloads.bookkeeping import COLUMNS, TraceBookkeeping, TraceRequest, fit_requests, replay_bookkeeping


def rows(result, *names):
    return [tuple(r[COLUMNS.index(n)] for n in names) for r in result.steps]


def test_contiguous_max_reservation_by_hand():
    # 4 blocks of 4 slots; one request of 3 prompt + 2 output tokens (final length 4) reserves max_model_len = 8
    r = replay_bookkeeping([TraceRequest(0.0, 3, 2)], "contiguous", {"reserve": "max_model_len"}, block_size=4,
                           kv_tokens=16, max_model_len=8,
                           step_s=1.0, token_s=0.0)
    assert rows(r, "time_s", "running", "tokens", "reservation", "internal", "external", "free") == [
        (1.0, 1, 3, 1, 4, 0, 8),  # prefill: 3 written, 1 still to come, 8 - 4 never used
        (2.0, 1, 4, 0, 4, 0, 8),  # decode: the last sampled token is never written
    ]
    assert r.summary["waste_internal"] == pytest.approx((4 + 4) / 2 / 16)  # the engine's Metrics agree
    assert r.summary["waste_reservation"] == pytest.approx(1 / 2 / 16)
    assert r.summary["num_requests"] == 1 and r.summary["generated_tokens"] == 2


def test_external_fragmentation_is_the_hole_the_waiting_request_cannot_use():
    # reserve=request: each request (4 + 5) takes 3 of the 4 blocks; the second waits on a 1-block hole
    reqs = [TraceRequest(0.0, 4, 5), TraceRequest(0.0, 4, 5)]
    r = replay_bookkeeping(reqs, "contiguous", {"reserve": "request"}, block_size=4, kv_tokens=16, max_model_len=12,
                           step_s=1.0, token_s=0.0)
    first = rows(r, "running", "waiting", "tokens", "reservation", "internal", "external", "free")[0]
    assert first == (1, 1, 4, 4, 4 - 0, 4, 0)  # held 12: 4 written, 4 to come, 12 - 8 never; the free block is a hole
    assert r.summary["max_concurrent_seqs"] == 1 and r.summary["num_requests"] == 2


def test_paging_wastes_only_the_tail_of_the_last_page():
    r = replay_bookkeeping([TraceRequest(0.0, 5, 3)], "paged", {}, block_size=4, kv_tokens=16, max_model_len=8,
                           step_s=1.0, token_s=0.0)
    # final length 7 in 2 pages of 4: the 8th slot is never written (internal); the others come (reservation)
    assert rows(r, "tokens", "reservation", "internal") == [(5, 2, 1), (6, 1, 1), (7, 0, 1)]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.integers(1, 60), st.integers(1, 30)), min_size=1, max_size=25),
       st.sampled_from([1, 2, 8, 16]), st.sampled_from(["paged", "contiguous"]))
def test_breakdown_adds_up_and_paging_keeps_its_bound(trace, block_size, allocator):
    reqs = [TraceRequest(t, p, g) for t, p, g in trace]
    r = replay_bookkeeping(reqs, allocator, {}, block_size=block_size, kv_tokens=256, max_model_len=96,
                           max_num_batched_tokens=64, step_s=0.1, token_s=0.001)
    for row in r.steps:
        t, running, waiting, tokens, reservation, internal, external, free, bound = row
        assert tokens + reservation + internal + external + free == r.pool_slots
        assert min(tokens, reservation, internal, external, free) >= 0
        if allocator == "paged":
            assert reservation + internal <= bound and external == 0
    assert r.summary["num_requests"] == len(reqs)  # everyone finished, whatever the preemptions
    assert r.summary["generated_tokens"] == sum(g for _, _, g in trace)


def test_paging_holds_more_sequences_than_max_reservation():
    reqs = [TraceRequest(0.01 * i, 40, 20) for i in range(40)]
    paged = replay_bookkeeping(reqs, "paged", {}, 16, kv_tokens=1024, max_model_len=256)
    contiguous = replay_bookkeeping(reqs, "contiguous", {"reserve": "max_model_len"}, 16, kv_tokens=1024,
                                    max_model_len=256)
    assert contiguous.summary["max_concurrent_seqs"] == 4  # 1024 / 256
    assert paged.summary["max_concurrent_seqs"] > 3 * 4
    assert paged.summary["busy_token_share_of_used"] > 0.8 > 0.5 > contiguous.summary["busy_token_share_of_used"]


def test_fit_requests_cuts_the_prompt_to_the_context():
    reqs, cut = fit_requests([(0.0, 100, 10), (1.0, 3000, 500), (2.0, 10, 5000)], max_model_len=2048)
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [(100, 10), (1548, 500), (10, 1024)]
    assert cut == 2


def test_bad_input_is_refused_before_any_work():
    with pytest.raises(ValueError, match="kv_tokens"):
        TraceBookkeeping(kv_tokens=1024, max_model_len=2048)
    with pytest.raises(ValueError, match="num_requests"):
        TraceBookkeeping(num_requests=0)
    with pytest.raises(ValueError, match="step_s"):
        TraceBookkeeping(step_s=-1.0)
    with pytest.raises(ValueError, match="kv_tokens"):
        replay_bookkeeping([TraceRequest(0.0, 3, 2)], kv_tokens=8, max_model_len=16)


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_a_shared_system_prompt_buys_batch_when_pages_are_shared(cache):
    # a 64-token system prompt + 16 own tokens; the first request is computed before the others arrive
    reqs = [TraceRequest(0.0 if i == 0 else 0.05, 64 + 16, 8) for i in range(12)]
    alone = replay_bookkeeping(reqs, "paged", {}, 16, kv_tokens=512, max_model_len=128, system_prompt_tokens=64)
    shared = replay_bookkeeping(reqs, "paged", {}, 16, kv_tokens=512, max_model_len=128, system_prompt_tokens=64,
                                prefix_cache=cache)
    assert alone.summary["max_concurrent_seqs"] <= 512 // 96 + 1
    assert shared.summary["max_concurrent_seqs"] > alone.summary["max_concurrent_seqs"]
    assert shared.summary["prefix_hit_tokens"] >= 11 * 64  # every later request found the system prompt
    assert shared.summary["num_requests"] == 12 and shared.summary["generated_tokens"] == 12 * 8


def test_prefix_sharing_in_the_replay_needs_a_sharing_allocator():
    with pytest.raises(ValueError, match="prefix caching needs an allocator that shares cached pages"):
        replay_bookkeeping([TraceRequest(0.0, 8, 2)], "contiguous", {}, 4, kv_tokens=64, max_model_len=16,
                           prefix_cache="hash")
    with pytest.raises(ValueError, match="system_prompt_tokens"):
        TraceBookkeeping(system_prompt_tokens=4096, max_model_len=2048)

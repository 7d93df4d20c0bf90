"""Run metrics on hand-made numbers: the waste breakdown (Kwon et al. 2023, §3), percentiles, summary(). Torch-free."""

from __future__ import annotations

import math
import statistics

import pytest

from kvlab.metrics import Metrics, _percentile


def metrics(pool_slots: int = 200, num_blocks: int = 50) -> Metrics:
    m = Metrics(pool_slots=pool_slots, num_blocks=num_blocks)
    m.begin(now=1.0)
    return m


def same(a: dict, b: dict) -> bool:
    """Dict equality where nan == nan."""
    return a.keys() == b.keys() and all(
        (isinstance(a[k], float) and math.isnan(a[k]) and isinstance(b[k], float) and math.isnan(b[k]))
        or a[k] == b[k] for k in a)


# -- waste ---------------------------------------------------------------------------
def test_contiguous_like_reservation_splits_into_internal_and_reservation_waste():
    m = metrics(pool_slots=200)
    m.record_step(blocks_used=25, running=[(0, 100, 10)], external_free=0, num_preempted=0)
    m.record_finish(0, final_len=40, num_prompt=10, num_generated=30, ttft=None, tpot=None)
    s = m.summary()
    # 100 slots held, 10 written, 40 ever written: 60 never filled, 30 held for later
    assert s["waste_internal"] == pytest.approx(60 / 200)
    assert s["waste_reservation"] == pytest.approx(30 / 200)
    assert s["waste_external"] == 0


def test_waste_is_averaged_over_steps_as_the_sequence_fills_its_reservation():
    m = metrics(pool_slots=200)
    for written in (10, 20, 40):
        m.record_step(blocks_used=25, running=[(0, 100, written)], external_free=0, num_preempted=0)
    m.record_finish(0, final_len=40, num_prompt=10, num_generated=30, ttft=None, tpot=None)
    s = m.summary()
    assert s["waste_internal"] == pytest.approx((60 + 60 + 60) / 3 / 200)
    assert s["waste_reservation"] == pytest.approx((30 + 20 + 0) / 3 / 200)


def test_paged_like_tail_of_the_last_block_is_internal_waste():
    m = metrics(pool_slots=160)
    m.record_step(blocks_used=1, running=[(0, 16, 10)], external_free=0, num_preempted=0)
    m.record_finish(0, final_len=10, num_prompt=4, num_generated=6, ttft=None, tpot=None)
    s = m.summary()
    assert s["waste_internal"] == pytest.approx(6 / 160)
    assert s["waste_reservation"] == 0


def test_paged_like_slots_filled_later_are_reservation_waste():
    m = metrics(pool_slots=160)
    m.record_step(blocks_used=1, running=[(0, 16, 10)], external_free=0, num_preempted=0)  # final 14: 4 later, 2 never
    m.record_step(blocks_used=3, running=[(1, 48, 20)], external_free=0, num_preempted=0)  # final 100: all 28 later
    m.record_finish(0, final_len=14, num_prompt=4, num_generated=10, ttft=None, tpot=None)
    m.record_finish(1, final_len=100, num_prompt=20, num_generated=80, ttft=None, tpot=None)
    s = m.summary()
    assert s["waste_internal"] == pytest.approx(2 / 2 / 160)
    assert s["waste_reservation"] == pytest.approx((4 + 28) / 2 / 160)


def test_slots_written_beyond_the_final_length_are_not_internal_waste():
    """Rolled-back (speculative) tokens were written at the time: only slots never written count."""
    m = metrics(pool_slots=160)
    m.record_step(blocks_used=1, running=[(0, 16, 12)], external_free=0, num_preempted=0)
    m.record_finish(0, final_len=10, num_prompt=4, num_generated=6, ttft=None, tpot=None)
    s = m.summary()
    assert s["waste_internal"] == pytest.approx(4 / 160)
    assert s["waste_reservation"] == 0


def test_several_sequences_in_one_step_add_up():
    m = metrics(pool_slots=400)
    m.record_step(blocks_used=10, running=[(0, 100, 10), (1, 16, 10)], external_free=40, num_preempted=1)
    m.record_finish(0, final_len=40, num_prompt=10, num_generated=30, ttft=None, tpot=None)
    m.record_finish(1, final_len=10, num_prompt=4, num_generated=6, ttft=None, tpot=None)
    s = m.summary()
    assert s["waste_internal"] == pytest.approx((60 + 6) / 400)
    assert s["waste_reservation"] == pytest.approx(30 / 400)
    assert s["waste_external"] == pytest.approx(40 / 400)
    assert s["preemptions"] == 1


def test_unfinished_sequences_are_judged_by_their_length_so_far():
    m = metrics(pool_slots=200)
    m.record_step(blocks_used=25, running=[(0, 100, 10)], external_free=0, num_preempted=0)
    assert m.summary()["waste_internal"] == 0  # not finished, not passed as live: not counted yet
    s = m.summary(live_lengths={0: 30})
    assert s["waste_internal"] == pytest.approx(70 / 200)
    assert s["waste_reservation"] == pytest.approx(20 / 200)


# -- summary() is a read-only view -----------------------------------------------------
def test_summary_does_not_change_the_metrics():
    m = metrics(pool_slots=200)
    m.record_step(blocks_used=25, running=[(0, 100, 10), (1, 16, 5)], external_free=8, num_preempted=0)
    m.record_finish(1, final_len=5, num_prompt=2, num_generated=3, ttft=0.5, tpot=0.1)
    first = m.summary(live_lengths={0: 30})
    assert same(m.summary(live_lengths={0: 30}), first)
    assert same(m.summary(live_lengths={0: 30}), first)
    assert m._live == {0: [(100, 10)]}  # the live sequence's history is still there
    assert m.internal_sum == 11 and m.reservation_sum == 0  # only the finished one is settled
    # ...so finishing it later counts it once, with its real final length
    m.record_finish(0, final_len=40, num_prompt=10, num_generated=30, ttft=None, tpot=None)
    assert m.summary()["waste_internal"] == pytest.approx((11 + 60) / 200)
    assert m.summary()["waste_reservation"] == pytest.approx(30 / 200)


def test_summary_counts_and_block_usage():
    m = metrics(pool_slots=200, num_blocks=50)
    m.record_step(blocks_used=10, running=[(0, 16, 4)], external_free=0, num_preempted=0)
    m.record_step(blocks_used=30, running=[(0, 16, 5), (1, 16, 4), (2, 16, 4)], external_free=0, num_preempted=2)
    m.record_finish(0, final_len=6, num_prompt=4, num_generated=2, ttft=0.2, tpot=0.05)
    s = m.summary()
    assert s["num_steps"] == 2 and s["num_requests"] == 1
    assert s["prompt_tokens"] == 4 and s["generated_tokens"] == 2
    assert s["kv_blocks_total"] == 50 and s["kv_blocks_peak"] == 30 and s["kv_blocks_mean"] == 20
    assert s["max_concurrent_seqs"] == 3 and s["mean_concurrent_seqs"] == 2
    assert s["preemptions"] == 2
    assert s["ttft_median_s"] == 0.2 and s["tpot_median_s"] == 0.05
    assert s["elapsed_s"] > 0 and math.isnan(s["tokens_per_s"])  # no busy time recorded yet
    m.add_busy(0.5)
    assert m.summary()["tokens_per_s"] == pytest.approx(2 / 0.5)


def test_empty_metrics_summarise_without_dividing_by_zero():
    s = Metrics(pool_slots=64, num_blocks=4).summary()
    assert s["num_steps"] == 0 and s["waste_internal"] == 0 and s["kv_blocks_peak"] == 0
    assert math.isnan(s["ttft_median_s"]) and math.isnan(s["ttft_p90_s"]) and math.isnan(s["elapsed_s"])


# -- percentiles -----------------------------------------------------------------------
@pytest.mark.parametrize("values, q, expected", [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.9, 9.1),  # linear interpolation, as numpy's default
    ([10, 1, 9, 2, 8, 3, 7, 4, 6, 5], 0.9, 9.1),  # order of arrival does not matter
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.5, 5.5),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.0, 1),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 1.0, 10),
    ([4.0], 0.9, 4.0),
    ([0.0, 1.0], 0.9, 0.9),
])
def test_percentile(values, q, expected):
    assert _percentile(values, q) == pytest.approx(expected)


def test_percentile_of_nothing_is_nan_and_input_is_not_reordered():
    assert math.isnan(_percentile([], 0.9))
    values = [3.0, 1.0, 2.0]
    _percentile(values, 0.5)
    assert values == [3.0, 1.0, 2.0]


def test_summary_p90_uses_the_recorded_latencies():
    m = metrics()
    for i, ttft in enumerate([0.1, 0.5, 0.2, 0.4, 0.3]):
        m.record_finish(i, final_len=2, num_prompt=1, num_generated=1, ttft=ttft, tpot=None if i else 0.07)
    s = m.summary()
    assert s["ttft_median_s"] == pytest.approx(0.3)
    assert s["ttft_p90_s"] == pytest.approx(0.46)
    assert s["tpot_median_s"] == pytest.approx(0.07) and s["tpot_p90_s"] == pytest.approx(0.07)


def test_throughput_counts_busy_time_not_idle_time_between_calls():
    m = metrics()
    m.add_busy(1.0)
    m.record_finish(0, final_len=11, num_prompt=1, num_generated=10, ttft=None, tpot=None)
    m.end_time = m.start_time + 100.0  # a long pause, then a second call
    m.add_busy(1.0)
    m.record_finish(1, final_len=11, num_prompt=1, num_generated=10, ttft=None, tpot=None)
    s = m.summary()
    assert s["tokens_per_s"] == pytest.approx(20 / 2.0) and s["busy_s"] == pytest.approx(2.0)


def test_memory_stays_bounded_over_many_steps_and_requests():
    m = Metrics(pool_slots=64, num_blocks=4, window=100)
    m.begin(now=0.0)
    for i in range(5000):
        m.record_step(blocks_used=i % 4, running=[(i, 16, 4)], external_free=0, num_preempted=0)
        m.record_finish(i, final_len=5, num_prompt=4, num_generated=1, ttft=float(i), tpot=None)
    assert len(m.ttft) == 100 and not m._live  # a bounded window of latencies, no per-step lists
    s = m.summary()
    assert s["ttft_median_s"] == pytest.approx(statistics.median(range(4900, 5000)))
    assert s["kv_blocks_peak"] == 3 and s["kv_blocks_mean"] == pytest.approx(1.5)
    assert s["waste_internal"] == pytest.approx(11 / 64)

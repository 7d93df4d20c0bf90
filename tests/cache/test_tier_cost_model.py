"""Restore or recompute as a pure function of rates and page counts (kvlab/cache/tiers/placement/cost_model.py),
the cost-aware placement's fits of its measured rates, and what the engine measures for it: the wall time a
request waits on its reads ahead, and a start-up compute calibration that leaves the engine as it was.
Rates are injected: no timing is asserted except lower bounds the test itself imposes.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.cache.tiers.disk import DiskTier
from kvlab.cache.tiers.placement import cost_model as cm
from kvlab.cache.tiers.placement.cost_aware import CostAwarePlacement

pytestmark = pytest.mark.usefixtures("one_thread")

# recompute 1 ms a token; a disk restore 20 ms + 0.1 ms a page of 16 tokens: crossover near 20 tokens
RATES = cm.Rates(per_token_s=1e-3, restore={0: (0.02, 1e-4)}, demote={0: 0.0})


def test_restore_pays_only_above_the_crossover():
    cross = cm.crossover_tokens(RATES, 0, block_size=16)
    assert cross == pytest.approx(0.02 / (1e-3 - 1e-4 / 16))
    assert not cm.restore_pays(RATES, {0: 1}, 16)  # one page: the latency outweighs 16 ms of recompute
    assert cm.restore_pays(RATES, {0: 2}, 32)  # two pages: 20.2 ms against 32 ms
    assert not cm.restore_pays(RATES, {0: 2}, 32, margin=2.0)  # 20.2 ms against 32 ms is not 2x cheaper
    assert cm.restore_seconds(RATES, {0: 0}) == 0.0  # no page, no latency


def test_a_tier_is_used_only_where_its_demotion_and_restore_beat_recomputing():
    slow_write = cm.Rates(per_token_s=1e-4, restore={0: (0.0, 1e-4)}, demote={0: 2e-3})  # a file write inline
    behind = cm.Rates(per_token_s=1e-4, restore={0: (0.0, 1e-4)}, demote={0: 1e-5})  # a row copy
    assert not cm.worth(slow_write, 0, block_size=16)  # 2.1 ms against 1.6 ms of recompute
    assert cm.worth(behind, 0, block_size=16)


def placement(**args) -> CostAwarePlacement:
    p = CostAwarePlacement(**args)
    p.setup(["disk"], [8], page_bytes=4096, block_size=16)
    return p


def test_one_slow_step_does_not_swing_the_recompute_rate():
    p = placement()
    for n in (4, 8, 16, 32, 64, 4, 8, 16, 32, 64):
        p.observe_compute(n, 0.002 + n * 1e-4)  # 2 ms a step, 0.1 ms a token
    p.observe_compute(64, 0.2)  # a step a neighbour slowed down 25x
    p.observe_compute(4, 0.0001)  # and one timed short
    assert p.tokens_per_s() == pytest.approx(1e4, rel=0.05)
    assert cm.fit([*p.compute])[1] > 2e-4  # a least-squares slope doubles


def test_the_calibration_rate_is_the_fastest_forward_of_each_size():
    p = placement()
    for slow_short, slow_long in ((1, 3), (30, 1), (2, 5)):  # a loaded machine slows some forwards down
        p.observe_calibration(16, slow_short * (0.002 + 16 * 1e-4))
        p.observe_calibration(128, slow_long * (0.002 + 128 * 1e-4))
    for n in (4, 64, 4, 64):
        p.observe_compute(n, 0.5)  # noisy steps do not move a calibrated rate
    assert p.tokens_per_s() == pytest.approx(1e4)


def test_a_token_costing_nothing_measurable_makes_restoring_never_pay():
    p = placement(prefill_tokens_per_s=10.0)  # a prior that would make every restore pay
    for n in (4, 16, 64, 4, 16, 64):
        p.observe_compute(n, 0.003)  # the step's fixed cost only
    p.observe_restore(0, 1, 1e-4)
    p.observe_restore(0, 8, 8e-4)
    assert not p.restore_pays({0: 8}, 128)
    assert p.where("k") is None  # no tier worth a demotion: pages are dropped, as without tiers


def test_the_restore_line_and_demotions_come_from_what_was_observed():
    p = placement(disk_latency_s=1.0)
    for n in (1, 8, 1, 8):
        p.observe_restore(0, n, 0.003 + n * 2e-4)
    assert p.restore_line(0) == pytest.approx((0.003, 2e-4))
    for s in (1e-5, 3e-5, 9.0):  # one demotion that stalled
        p.observe_demote(0, 1, s)
    assert p.demote_seconds(0) == pytest.approx(3e-5)
    assert p.rates().demote[0] == pytest.approx(3e-5)


def test_calibration_rounds_stop_at_the_minimum_once_the_budget_is_spent():
    slow = placement(calibration_repeats=2, calibration_rounds=5, calibration_budget_s=1.0)
    fast = placement(calibration_repeats=2, calibration_rounds=5, calibration_budget_s=1.0)
    for p, seconds in ((slow, 0.4), (fast, 0.01)):
        while p.compute_sizes():
            for n in p.compute_sizes():
                p.observe_calibration(n, seconds)
    assert len(slow.calibration) == 2 * 3  # 2.4 s spent after two rounds (of three sizes): no more
    assert len(fast.calibration) == 5 * 3  # cheap forwards: up to the most rounds
    assert placement(measured=False).compute_sizes() == ()


def test_a_read_ahead_is_timed_as_the_request_waits_for_it(tmp_path):
    tier = DiskTier(4, 64, str(tmp_path / "t"), async_writes=False)
    tier.put("a", lambda r: r.fill_(7))
    tier.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-disk-tier")
    tier.worker.submit(time.sleep, 0.05)  # the worker is busy: the read waits in its queue
    tier.start_read("a")
    while not tier.ready("a"):
        tier.wait()
        tier.poll()
    assert tier.read_seconds(["a"]) >= 0.05  # the queue and the round trip, not only the file read
    got = torch.empty((1, 64), dtype=torch.uint8)
    tier.load("a", got.copy_)
    assert int(got.sum()) == 7 * 64
    tier.close()


def test_the_start_up_calibration_leaves_the_engine_as_it_was():
    engine = dict(block_size=4, max_model_len=128, kv_cache_memory=24 * 1024, max_num_batched_tokens=32,
                  enable_prefix_caching=True)
    prompt = torch.randint(3, 256, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    ref = LLM("random:llama-tiny", **engine)
    want = ref.generate([prompt], params)[0]
    llm = LLM("random:llama-tiny", offload="disk", offload_placement="cost_aware", **engine)
    p, bm = llm.engine.kv.places.placement, llm.engine.block_manager
    rounds = len(p.calibration) // 3  # a round: a short, a middle and a long forward (here cut to the step budget)
    assert len(p.calibration) % 3 == 0 and p.calibration_repeats <= rounds <= p.calibration_rounds
    assert {n for n, _ in p.calibration} == {4, 32}  # 4, 64 -> 32 and 256 -> 32 tokens (max_num_batched_tokens)
    assert bm.allocator.num_admissible_blocks == bm.num_blocks  # every page back
    assert not bm.prefix_cache.index or not any(bm.prefix_cache.index.values())  # nothing registered
    got = llm.generate([prompt], params)[0]
    assert (got.request_id, got.outputs[0].token_ids) == (want.request_id, want.outputs[0].token_ids)
    llm.close()
    ref.close()


@pytest.mark.parametrize("cold", [False, True])
def test_a_cold_calibration_reads_its_restores_from_the_device(monkeypatch, cold):
    """`cold_calibration`: the start-up restores read files dropped from the page cache first (histories written
    long ago), every timed run; without it they read what the writes left in memory."""
    dropped = []
    real = DiskTier.drop_cached
    monkeypatch.setattr(DiskTier, "drop_cached", lambda self, keys=None: dropped.append(len(keys)) or real(self, keys))
    llm = LLM("random:llama-tiny", block_size=4, kv_cache_memory=24 * 1024, enable_prefix_caching=True,
              offload="disk", offload_placement="cost_aware", offload_placement_args={"cold_calibration": cold})
    p = llm.engine.kv.places.placement
    assert dropped == ([1, 1, 8, 1, 8, 1, 8] if cold else [])  # the warm-up run, then 3 x (1, 8) pages
    assert len(p.samples[0]) == 6  # the timed runs observed either way
    llm.close()


# a prefill of n tokens: 2 ms + 50 us a token + 1 us a token squared (attention); a disk restore 1 ms + 1 ms a
# page of 16 tokens: per token it costs more than the linear part of recomputing, so only the quadratic part
# makes restoring pay, above a history of ~38 tokens
CURVED = cm.Rates(per_token_s=5e-5, restore={0: (1e-3, 1e-3)}, demote={0: 0.0}, per_token2_s=1e-6)


def test_a_superlinear_prefill_makes_long_histories_worth_restoring():
    assert cm.recompute_seconds(CURVED, 16) == pytest.approx(16 * 5e-5 + 256e-6)
    assert cm.recompute_seconds(CURVED, 16, start=64) == pytest.approx(16 * 5e-5 + (80 ** 2 - 64 ** 2) * 1e-6)
    cross = cm.crossover_tokens(CURVED, 0, block_size=16)
    assert 35 < cross < 42
    assert cm.restore_seconds(CURVED, {0: 2}) == pytest.approx(3e-3)
    assert not cm.restore_pays(CURVED, {0: 2}, 32)  # 3 ms against 2.6 ms of recompute
    assert cm.restore_pays(CURVED, {0: 4}, 64)  # 5 ms against 7.3 ms
    assert cm.restore_pays(CURVED, {0: 2}, 32, start=64)  # the same two pages behind 64 kept tokens: 8.3 ms
    line = cm.Rates(per_token_s=5e-5, restore={0: (1e-3, 1e-3)}, demote={0: 0.0})
    assert cm.crossover_tokens(line, 0, block_size=16) == float("inf")  # linear: restoring never pays


def test_the_prefill_curve_is_the_fastest_forward_of_each_of_three_sizes():
    p = placement()
    assert p.compute_sizes() == (16, 128, 512)
    for slow in ((1, 3, 1), (4, 1, 1), (1, 1, 2)):  # a loaded machine slows some forwards down
        for k, n in zip(slow, (16, 128, 512)):
            p.observe_calibration(n, k * (2e-3 + n * 5e-5 + n * n * 1e-6))
    per_token, per_token2 = p.compute_curve()
    assert (per_token, per_token2) == (pytest.approx(5e-5), pytest.approx(1e-6))
    assert p.rates().per_token2_s == pytest.approx(1e-6)
    assert p.recompute_seconds(64, start=64) == pytest.approx(64 * 5e-5 + (128 ** 2 - 64 ** 2) * 1e-6)
    straight = placement()
    for n in (16, 128, 512):
        straight.observe_calibration(n, 2e-3 + n * 5e-5)  # no bend: the straight line, no quadratic part
    assert straight.compute_curve() == (pytest.approx(5e-5), 0.0)

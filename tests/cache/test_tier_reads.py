"""Reads ahead from a slow tier, restore vs recompute (kvlab/cache/tiers/, docs/design.md "Tiers below the pool").

A request whose hit needs pages still being read is not scheduled (others run) and no step reads a page that has
not arrived (a manual tier whose reads complete on command: kvlab.testing.tiers); outputs equal the synchronous
path's and those without tiers; the placement decides whether the reads start when the request is added
(prefetch); a read that fails late (a page file truncated or deleted after the page was demoted, found out on the
worker thread or at once) is recomputed with a warning; the cost-aware placement recomputes below its crossover
and restores above it.
"""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM
from kvlab.cache.tiers.placement.cost_aware import CostAwarePlacement, fit
from kvlab.sequence import SequenceStatus
from kvlab.testing.tiers import manual_tier

from returning_turn import ENGINE, FILLERS, FIRST, OTHER, PARAMS, reference, returning_turn, tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def run_to_end(engine) -> dict:
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out.outputs[0].token_ids
    return outs


def test_a_request_whose_pages_are_in_flight_waits_while_others_run():
    want = reference()
    llm = LLM("random:llama-tiny", offload="disk", **ENGINE)
    tier = manual_tier(llm)
    second = returning_turn(llm)
    assert len(tier) > 0
    engine = llm.engine
    a = engine.add_request(second, PARAMS)
    assert tier.started, "the returning request's pages were not read ahead when it was added"
    assert llm.stats()["tier_prefetched"] == len(tier.started)
    b = engine.add_request(OTHER, PARAMS)
    tier.hold = True  # nothing arrives until the test says so
    seqs = {s.seq_id: s for s in engine.scheduler.waiting}
    outs = {}
    for _ in range(3):
        for out in engine.step():
            outs[out.request_id] = out.outputs[0].token_ids
        assert seqs[a].status is SequenceStatus.WAITING and seqs[a].num_computed_tokens == 0
        assert seqs[b].status is not SequenceStatus.WAITING  # the other request runs meanwhile
    assert llm.stats()["tier_waits"] >= 3
    tier.complete()
    tier.hold = False
    outs.update(run_to_end(engine))
    assert [outs[a], outs[b]] == want
    assert llm.stats()["tier_restored"] > 0
    llm.close()


def test_the_engine_waits_for_a_read_when_nothing_else_can_run():
    want = reference()
    llm = LLM("random:llama-tiny", offload="disk", **ENGINE)
    tier = manual_tier(llm)
    second = returning_turn(llm)
    got = [o.token_ids for o in llm.generate([second, OTHER], PARAMS)]  # the manual tier arrives on wait()
    assert got == want and llm.stats()["tier_restored"] > 0 and tier.started
    llm.close()


def test_without_prefetch_the_reads_start_when_the_request_is_scheduled():
    llm = LLM("random:llama-tiny", offload="disk", offload_placement_args={"prefetch_ahead": False}, **ENGINE)
    tier = manual_tier(llm)
    second = returning_turn(llm)
    a = llm.engine.add_request(second, PARAMS)
    assert not tier.started and llm.stats()["tier_prefetched"] == 0
    llm.engine.add_request(OTHER, PARAMS)  # runs while a waits
    tier.hold = True
    llm.engine.step()
    assert tier.started and llm.stats()["tier_fetched"] == len(tier.started)
    tier.hold = False
    assert a in run_to_end(llm.engine)
    llm.close()


def test_a_failed_read_in_flight_is_recomputed_and_loses_nothing():
    want = reference()
    llm = LLM("random:llama-tiny", offload="disk", **ENGINE)
    tier = manual_tier(llm)
    second = returning_turn(llm)
    a = llm.engine.add_request(second, PARAMS)
    b = llm.engine.add_request(OTHER, PARAMS)
    tier.hold = True
    llm.engine.step()
    with pytest.warns(RuntimeWarning, match="recomputed"):
        tier.complete(fail=True)
        outs = run_to_end(llm.engine)
    assert [outs[a], outs[b]] == want
    stats = llm.stats()
    assert stats["tier_failed_reads"] > 0 and stats["tier_restored"] == 0
    llm.close()


@pytest.mark.parametrize("async_reads", [True, False])
@pytest.mark.parametrize("damage", ["truncate", "delete", "grow"])
def test_a_page_file_damaged_after_demotion_is_recomputed_at_read_time(async_reads, damage):
    want = reference()
    llm = LLM("random:llama-tiny", offload="disk", offload_args={"async_reads": async_reads}, **ENGINE)
    second = returning_turn(llm)
    tier = llm.engine.kv.tiers[0]
    tier.flush()  # the writes behind have landed: the damage is to written files
    files = sorted(tier.folder.glob("*.page"))
    assert files
    for f in files:
        {"truncate": lambda: f.write_bytes(f.read_bytes()[:7]), "delete": f.unlink,
         "grow": lambda: f.write_bytes(f.read_bytes() + b"x")}[damage]()
    with pytest.warns(RuntimeWarning, match="recomputed"):
        got = [o.token_ids for o in llm.generate([second, OTHER], PARAMS)]
    assert got == want
    assert llm.stats()["tier_failed_reads"] > 0
    llm.close()


def conversations(**engine) -> tuple[list[list[int]], dict]:
    g = torch.Generator().manual_seed(3)
    users = [[torch.randint(3, 256, (n,), generator=g).tolist() for n in (20, 9, 11)] for _ in range(4)]
    llm = LLM("random:llama-tiny", **{**ENGINE, "kv_cache_memory": 40 * 1024, **engine})
    history, outs = [[] for _ in users], []
    for turn in range(3):
        for c, conv in enumerate(users):
            history[c] += conv[turn]
        got = [o.token_ids for o in llm.generate(list(history), PARAMS)]
        for c, out in enumerate(got):
            history[c] += out
        outs += got
    stats = llm.stats()
    llm.close()
    return outs, stats


def test_reads_on_the_worker_give_the_synchronous_path_s_outputs():
    want, _ = conversations()
    sync, sync_stats = conversations(offload="disk", offload_args={"async_reads": False})
    got, stats = conversations(offload="disk")
    both, both_stats = conversations(offload="host_disk", offload_args={"memory": "4KiB"})
    assert got == sync == both == want
    assert stats["tier_restored"] > 0 and sync_stats["tier_restored"] > 0 and both_stats["tier_disk_hits"] > 0


# -- restore or recompute: the cost model -------------------------------------------------
def cost_model(**args) -> CostAwarePlacement:
    p = CostAwarePlacement(**args)
    p.setup(["host", "disk"], [8, 8], page_bytes=4096, block_size=16)
    return p


def test_cost_aware_recomputes_below_its_crossover_and_restores_above():
    # recompute at 1,000 tok/s = 1 ms a token; a disk restore = 20 ms + 4.1 us a page: crossover near 20 tokens
    p = cost_model(prefill_tokens_per_s=1000.0, disk_latency_s=0.02, disk_bytes_per_s=1e9, measured=False)
    cross = p.crossover_tokens(1)
    assert 19 < cross < 21
    assert not p.restore_pays({1: 1}, 16)  # one page of 16 tokens: recompute
    assert p.restore_pays({1: 2}, 32)  # two pages of 16: restore
    assert p.restore_pays({0: 1}, 16)  # the host tier's prior latency is 0.2 ms: restore


def test_cost_aware_measures_its_rates_from_the_engine():
    p = cost_model(prefill_tokens_per_s=10.0)  # a prior far from what is observed
    for n in (1, 8, 32, 64):
        p.observe_compute(n, 0.005 + n * 1e-3)  # a 5 ms step cost and 1 ms a token
    assert p.tokens_per_s() == pytest.approx(1000.0)
    for n in (1, 4):
        p.observe_restore(1, n, 0.002 + n * 1e-4)
    assert p.restore_line(1) == pytest.approx((0.002, 1e-4))
    assert fit([(1, 1.0)]) is None and fit([(1, 1.0), (2, 3.0)]) == pytest.approx((0.0, 2.0))


@pytest.mark.parametrize("latency, restores", [(10.0, False), (0.0, True)])
def test_cost_aware_in_the_engine_chooses_recompute_or_restore(latency, restores):
    want = reference()
    llm = LLM("random:llama-tiny", offload="disk", offload_placement="cost_aware",
              offload_placement_args={"measured": False, "disk_latency_s": latency, "disk_bytes_per_s": 1e12,
                                      "prefill_tokens_per_s": 1e3}, **ENGINE)
    second = returning_turn(llm)
    assert len(llm.engine.kv.tiers[0]) > 0
    got = [o.token_ids for o in llm.generate([second, OTHER], PARAMS)]
    stats = llm.stats()
    assert got == want
    assert (stats["tier_restored"] > 0) == restores and (stats["tier_recomputed"] > 0) == (not restores)
    assert stats["tier_prefetched"] == (stats["tier_restored"] if restores else 0)  # nothing read to be recomputed
    llm.close()


def test_restore_or_recompute_is_asked_with_the_tokens_the_hit_keeps_before_its_tier_blocks(monkeypatch):
    """The quadratic part of recomputing depends on where the blocks sit: `restore_pays` hears how many tokens
    of the hit stay before its first tier block (`start`), here a partly evicted history (resident head)."""
    calls = []
    real = CostAwarePlacement.restore_pays
    monkeypatch.setattr(CostAwarePlacement, "restore_pays", lambda self, pages, tokens, start=0:
                        calls.append((pages, tokens, start)) or real(self, pages, tokens, start))
    llm = LLM("random:llama-tiny", offload="disk", offload_placement="cost_aware",
              offload_placement_args={"measured": False, "disk_latency_s": 0.0}, **ENGINE)
    answer = llm.generate([FIRST], PARAMS)[0].token_ids
    llm.generate([FILLERS[0]], PARAMS)  # one filler: only part of A's history goes down
    llm.generate([FIRST + answer + tokens(7, 5)], PARAMS)
    assert llm.stats()["tier_restored"] > 0
    llm.close()
    assert calls and all(start % ENGINE["block_size"] == 0 for _, _, start in calls)
    assert any(start > 0 for _, _, start in calls), calls  # the resident head counted, not recomputed as if at 0

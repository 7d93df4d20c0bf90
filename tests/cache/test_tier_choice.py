"""The cost-aware placement's two choices, torch-free and fast (kvlab/cache/tiers/placement/cost_aware.py, with
the bookkeeping that feeds it, kvlab/cache/tiers/places.py): restore a hit's pages or recompute them, on both sides
of the crossover its rates imply; and keep a page in a tier at all only where its demotion, priced as the step pays
it (the `put` and the tier's work behind the step), plus its restore beat recomputing it. Rates are injected; the
one wall-clock figure asserted is a lower bound the test itself sleeps.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvlab.cache.tiers.placement import cost_model as cm
from kvlab.cache.tiers.placement.cost_aware import CostAwarePlacement
from kvlab.cache.tiers.places import Places

BLOCK = 16


def placement(**args) -> CostAwarePlacement:
    """Recompute: 2 ms a step + 1 ms a token (calibrated, no bend); a disk restore 10 ms + 0.2 ms a page."""
    p = CostAwarePlacement(**args)
    p.setup(["disk"], [64], page_bytes=4096, block_size=BLOCK)
    for n in (16, 128, 512):
        p.observe_calibration(n, 2e-3 + n * 1e-3)
    for n in (1, 8, 1, 8):
        p.observe_restore(0, n, 0.01 + n * 2e-4)
    return p


def test_the_choice_flips_at_the_crossover_and_is_right_on_both_sides():
    p = placement()
    cross = p.crossover_tokens(0)
    assert cross == pytest.approx(0.01 / (1e-3 - 2e-4 / BLOCK))  # ~10.1 tokens
    for tokens in (4, 8, 16, 32, 64, 256, 1024):  # whole pages of history behind no kept token
        pages = -(-tokens // BLOCK)
        restore, recompute = p.restore_seconds(0, pages), p.recompute_seconds(tokens)
        assert p.restore_pays({0: pages}, tokens) == (restore <= recompute)  # the faster side, whichever it is
        assert p.restore_pays({0: pages}, tokens) == (tokens >= cross)
    assert not p.restore_pays({0: 1}, 4) and p.restore_pays({0: 4}, 64)  # both sides are reached


def test_a_cheaper_restore_wins_and_a_dearer_one_loses_whatever_the_order_observed():
    fast, slow = placement(), placement()
    for _ in range(8):  # the restore line moves: 1 ms latency (restore pays at 16 tokens), 40 ms (it does not)
        fast.observe_restore(0, 1, 1e-3 + 2e-4)
        fast.observe_restore(0, 8, 1e-3 + 8 * 2e-4)
        slow.observe_restore(0, 1, 0.04 + 2e-4)
        slow.observe_restore(0, 8, 0.04 + 8 * 2e-4)
    assert fast.restore_pays({0: 1}, 16)  # 1.2 ms against 16 ms
    assert not slow.restore_pays({0: 1}, 16)  # 40.2 ms against 16 ms
    assert slow.restore_pays({0: 4}, 64)  # 40.8 ms against 64 ms


def test_the_demotion_price_holds_the_work_behind_the_step():
    p = placement()  # a page: restore 0.2 ms, recompute 16 ms
    p.observe_demote(0, 1, 3e-5)  # the step's put: a row copy
    assert p.worth(0) and p.where("k") == 0
    p.observe_behind(0, 0.02)  # the file write and removal behind it: 20 ms of CPU on the writer thread
    assert p.demote_seconds(0) == pytest.approx(0.02003)
    assert not p.worth(0) and p.where("k") is None  # 20.2 ms a page kept against 16 ms recomputed: dropped
    free_core = placement(behind_share=0.0)  # a core free for the writer: the step pays the put only
    free_core.observe_demote(0, 1, 3e-5)
    free_core.observe_behind(0, 0.02)
    assert free_core.worth(0)
    with pytest.raises(ValueError, match="behind_share"):
        CostAwarePlacement(behind_share=-1.0)


class Mover:
    """A tier as a dict; each demotion leaves `behind` seconds of work behind the step; a restore takes
    `restore_s` as the mover times it (its copies)."""

    def __init__(self, behind: float = 0.0, restore_s: float = 1e-4):
        self.tier, self.behind, self.restore_s = {}, behind, restore_s

    def movable(self, page):
        return True

    def demote(self, page, tier, key):
        self.tier[key] = page

    def behind_seconds(self, tier):
        return self.behind

    def restore_many(self, items):
        for key, _, _ in items:
            self.tier.pop(key)
        return {tier: self.restore_s for _, tier, _ in items}

    def discard(self, key, tier):
        self.tier.pop(key)

    def tier_len(self, tier):
        return len(self.tier)

    def ready(self, key, tier):
        return True

    def poll(self):
        return []


def test_places_prices_a_demotion_with_the_tiers_work_behind_it():
    p = placement()
    places = Places(["disk"], [64], p, 4096, BLOCK, Mover(behind=0.05))
    assert places.demote("a", 1)  # no demotion seen yet: worth it
    assert p.demote_seconds(0) >= 0.05  # the mover's work behind the step came with it
    assert not places.demote("b", 2)  # now 50 ms a page against 16 ms: refused, dropped as without tiers
    assert places.stats.refused == 1 and len(places) == 1


def test_a_restore_is_observed_as_long_as_the_request_waited_for_it():
    p = placement()
    places = Places(["disk"], [64], p, 4096, BLOCK, Mover(restore_s=1e-4))
    for key in ("a", "b"):
        places.demote(key, 1)
    assert places.fetch(["a"])  # the scheduler asks for a's page ...
    time.sleep(0.03)  # ... and the request waits (reads ahead, the engine's wake-up)
    places.restore_many([("a", 5)])
    assert p.samples[0][-1][1] >= 0.03  # the wait, not the mover's 0.1 ms
    assert places.fetch(["b"])
    places.observe_compute(16, 0.01)  # a step ran in between: the reads were hidden behind it
    time.sleep(0.03)
    places.restore_many([("b", 6)])
    assert p.samples[0][-1] == (1, 1e-4)


def test_the_choice_logic_imports_no_torch():
    code = ("import sys, kvlab.cache.tiers.placement.cost_aware, kvlab.cache.tiers.places; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"

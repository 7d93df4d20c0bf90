"""The bookkeeping of the tiers below the pool, model-free (kvlab/cache/tiers/places.py and the placements):
spills go down the tiers, claimed pages are never victims, ARC keeps returning pages over one-off ones, the
cost-aware placement restores only where copying back beats recomputing."""

from __future__ import annotations

import pytest

from kvlab.cache.tiers.places import Places
from kvlab.registry import PLACEMENTS
from kvlab.testing.placements import FakeMover, check_bookkeeping


def places(name: str, capacities=(2, 3), **args) -> tuple[Places, dict, list]:
    pool: dict = {}
    p = Places(["host", "disk"], list(capacities), PLACEMENTS.build(name, **args), 4096, 16,
               FakeMover(len(capacities), pool))
    dropped: list = []
    p.on_drop = dropped.append
    return p, pool, dropped


def demote(p: Places, pool: dict, key, page: int) -> bool:
    pool[page] = key
    return p.demote(key, page)


@pytest.mark.parametrize("name", ["lru", "arc", "cost_aware"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_events_keep_every_page_in_one_place(name, seed):
    check_bookkeeping(name, steps=1500, seed=seed, capacities=(2, 4))


def test_lru_spills_the_oldest_host_page_to_disk_then_drops_the_oldest_disk_page():
    p, pool, dropped = places("lru", capacities=(2, 2))
    for i in range(5):
        assert demote(p, pool, f"k{i}", i)
    assert {k for k, t in p.tier_of.items() if t == 0} == {"k3", "k4"}
    assert {k for k, t in p.tier_of.items() if t == 1} == {"k1", "k2"}
    assert dropped == ["k0"] and p.stats.spilled == 3 and p.stats.dropped == 1
    p.check()


def test_a_claimed_page_is_never_a_victim():
    p, pool, dropped = places("lru", capacities=(1, 1))
    demote(p, pool, "a", 0)
    demote(p, pool, "b", 1)  # a spills to disk
    p.claim(["a", "b"])
    assert not demote(p, pool, "c", 2)  # no victim may leave: c goes nowhere
    p.restore("a", 10)
    p.restore("b", 11)
    assert pool[10] == "a" and pool[11] == "b" and not dropped
    assert p.stats.hits == {"disk": 1, "host": 1}


def test_arc_keeps_a_returning_page_over_one_off_pages():
    p, pool, _ = places("arc", capacities=(2, 1))
    demote(p, pool, "conv", 0)
    p.claim(["conv"])
    p.restore("conv", 1)  # the conversation came back once
    demote(p, pool, "conv", 1)  # ... and leaves again: in T2
    for i in range(2, 6):  # one-off prompts pass through
        demote(p, pool, f"once{i}", i)
    assert p.tier_of["conv"] == 0
    lru, pool2, _ = places("lru", capacities=(2, 1))
    demote(lru, pool2, "conv", 0)
    lru.claim(["conv"])
    lru.restore("conv", 1)
    demote(lru, pool2, "conv", 1)
    for i in range(2, 6):
        demote(lru, pool2, f"once{i}", i)
    assert "conv" not in lru.tier_of  # LRU lost it


def test_cost_aware_restores_only_where_copying_beats_recomputing():
    # a 4096-byte page of 16 tokens: recompute at 1,000 tok/s = 16 ms; host at 1 MB/s = 4.1 ms, disk at 100 KB/s = 41 ms
    p, pool, _ = places("cost_aware", host_bytes_per_s=1e6, disk_bytes_per_s=1e5, prefill_tokens_per_s=1000.0)
    assert p.placement.where("x") == 0 and p.placement.spill("x", 0) is None
    demote(p, pool, "a", 0)
    demote(p, pool, "b", 1)
    demote(p, pool, "c", 2)  # host full: a is dropped, not spilled to the slow disk
    assert set(p.tier_of) == {"b", "c"} and p.stats.spilled == 0 and p.stats.dropped == 1
    slow, pool2, _ = places("cost_aware", host_bytes_per_s=1e5, disk_bytes_per_s=1e5, prefill_tokens_per_s=1000.0)
    assert not demote(slow, pool2, "a", 0)  # recomputing beats every tier: nothing is kept
    fast, pool3, _ = places("cost_aware", host_bytes_per_s=1e6, disk_bytes_per_s=1e6, prefill_tokens_per_s=1000.0)
    for i in range(3):
        demote(fast, pool3, f"k{i}", i)
    assert fast.tier_of["k0"] == 1  # a fast disk takes the host's victim


def test_cost_aware_checks_its_parameters():
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be > 0"):
        PLACEMENTS.build("cost_aware", prefill_tokens_per_s=0)

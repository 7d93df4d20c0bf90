"""Prefix-cache eviction policies (kvlab/cache/prefix_eviction/), torch-free: the order each one's paper
defines on small scripted traces of park / unpark / hit / register / forget. (tests/cache/test_prefix_cache.py
runs them inside the prefix cache.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvlab.registry import PREFIX_EVICTIONS


def drain(policy) -> list[int]:
    return [policy.evict() for _ in range(len(policy))]


def test_lru_evicts_a_requests_tail_first_and_older_requests_first():
    lru = PREFIX_EVICTIONS.build("lru")
    lru.park([1, 2, 3])
    lru.park([4, 5])
    lru.unpark(2)
    assert [lru.evict() for _ in range(len(lru))] == [3, 1, 5, 4]


def test_lfu_evicts_the_least_used_page_first():
    lfu = PREFIX_EVICTIONS.build("lfu")
    lfu.hit(1)
    lfu.hit(1)
    lfu.hit(3)
    lfu.park([1, 2, 3])
    assert [lfu.evict() for _ in range(3)] == [2, 3, 1]


def test_slru_keeps_pages_that_were_hit():
    slru = PREFIX_EVICTIONS.build("slru", protected_fraction=0.5)
    slru.hit(1)
    slru.park([1, 2])
    slru.park([3, 4])
    assert [slru.evict() for _ in range(4)] == [2, 4, 3, 1]
    with pytest.raises(ValueError, match="protected_fraction must be in"):
        PREFIX_EVICTIONS.build("slru", protected_fraction=2)


def test_arc_grows_its_recent_list_after_a_recent_ghost_returns():
    arc = PREFIX_EVICTIONS.build("arc")
    for page, key in [(1, 101), (2, 102), (3, 103)]:
        arc.register(page, key)
    arc.hit(3)
    arc.park([1, 2, 3])
    assert arc.evict() == 2  # T1 (pages 1, 2; tail first) above its target 0
    arc.forget(2)
    arc.register(4, 102)  # block 102 comes back: T1 was too small
    assert arc._p == 1.0
    arc.park([4])
    assert [arc.evict() for _ in range(3)] == [3, 4, 1]  # T1 holds 1 page = its target: T2 goes first


def test_lru_a_page_freed_again_goes_to_the_back():
    lru = PREFIX_EVICTIONS.build("lru")
    lru.park([1, 2])
    lru.unpark(2)  # a hit takes it back ...
    lru.park([3])
    lru.park([2])  # ... and frees it again: now the most recently freed
    assert drain(lru) == [1, 3, 2]


def test_lfu_ties_go_least_recently_freed_first_and_a_request_tail_before_its_head():
    lfu = PREFIX_EVICTIONS.build("lfu")
    lfu.park([1, 2, 3])
    lfu.park([4])
    assert drain(lfu) == [3, 2, 1, 4]


def test_lfu_counts_a_hit_taken_back_and_freed_again_and_skips_its_stale_entry():
    lfu = PREFIX_EVICTIONS.build("lfu")
    lfu.park([1])
    lfu.park([2])
    lfu.unpark(1)  # its first entry, ahead of page 2's, is stale now
    lfu.hit(1)  # a second request used page 1
    lfu.park([1])
    assert drain(lfu) == [2, 1]


def test_lfu_forgets_the_count_of_an_unregistered_page():
    lfu = PREFIX_EVICTIONS.build("lfu")
    for _ in range(3):
        lfu.hit(5)
    lfu.forget(5)  # evicted and reused for other content: a count of one again
    lfu.park([6, 5])
    assert drain(lfu) == [5, 6]


def test_slru_demotes_the_least_recently_freed_protected_page_when_protected_overflows():
    """protected_fraction 0.5: two hit pages freed together leave one in protected (the head, freed last);
    the other is demoted to probation, behind which a page never hit is queued."""
    slru = PREFIX_EVICTIONS.build("slru", protected_fraction=0.5)
    slru.hit(1)
    slru.hit(2)
    slru.park([1, 2])
    slru.park([3])
    assert drain(slru) == [2, 3, 1]


def test_slru_with_no_protected_share_is_lru():
    slru = PREFIX_EVICTIONS.build("slru", protected_fraction=0.0)
    slru.hit(1)
    slru.park([1, 2])
    slru.park([3])
    assert drain(slru) == [2, 1, 3]


def test_slru_a_forgotten_page_starts_on_probation_and_a_protected_page_can_be_taken_back():
    slru = PREFIX_EVICTIONS.build("slru", protected_fraction=1.0)
    slru.hit(1)
    slru.hit(4)
    slru.forget(1)  # unregistered: its next contents were never hit
    slru.park([2, 1])
    slru.park([4])
    slru.unpark(4)  # a hit takes the protected page back
    assert drain(slru) == [1, 2]


def test_arc_a_frequent_ghost_shrinks_the_recent_target_and_comes_back_frequent():
    """T1 = {1, 2}, T2 = {3, 4}: evicting 2 and 1 (T1 above its target 0) then 4 (T1 empty) leaves ghosts
    101, 102 in B1 and 104 in B2. Block 101 returning grows the target of T1 to 1; block 104 returning
    shrinks it to 0 again, and both pages start in T2 (behind page 3)."""
    arc = PREFIX_EVICTIONS.build("arc")
    for page in (1, 2, 3, 4):
        arc.register(page, 100 + page)
    arc.hit(3)
    arc.hit(4)
    arc.park([1, 2, 3, 4])
    for want in (2, 1, 4):
        assert arc.evict() == want
        arc.forget(want)
    arc.register(5, 101)
    assert arc._p == 1.0
    arc.register(6, 104)
    assert arc._p == 0.0
    arc.register(7, 107)  # new content: recent
    arc.park([5, 6, 7])
    assert drain(arc) == [7, 3, 6, 5]  # T1 above its target 0 first, then T2 least recently freed first


def test_arc_ghost_lists_hold_no_more_entries_than_there_are_registered_pages():
    arc = PREFIX_EVICTIONS.build("arc")
    for page, key in ((1, 101), (2, 102)):
        arc.register(page, key)
        arc.park([page])
        assert arc.evict() == page
        arc.forget(page)  # one page registered at a time: B1 keeps only the newest ghost
    arc.register(3, 101)  # 101 fell out of B1: a miss, the target stays
    assert arc._p == 0.0
    arc.register(4, 102)  # 102 is still a ghost
    assert arc._p == 1.0


def test_the_policies_import_no_torch():
    code = "import sys, kvlab.cache.prefix_eviction as p; p.ARC(); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)

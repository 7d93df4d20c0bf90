"""The draft, allocator and placement conformance suites (kvlab.testing) on the built-in plugins, and each suite
catching a plugin that breaks its contract."""

from __future__ import annotations

import pytest

from kvlab.registry import PLACEMENTS
from kvlab.testing import check_allocator, check_draft, check_placement
from kvlab.testing.placements import check_bookkeeping

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "random:llama-tiny"


@pytest.mark.parametrize("name, args", [  # the drafts of tests/speculation/ (NGRAM, SAME, LAYERSKIP, SELF there)
    ("ngram", {"num_tokens": 4}),
    ("model", {"model": MODEL, "num_tokens": 3}),
    ("layerskip", {"layers": 1, "num_tokens": 3}),
    ("tree", {"layers": 1, "width": 2, "depth": 3}),
    ("self_compressed", {"policy": "streaming_llm", "policy_args": {"budget": 16}, "num_tokens": 3}),
])
def test_builtin_drafts_conform(name, args):
    """Greedy identity with plain decoding, again under preemption (a pool that preempts every draft's
    requests; 4-token pages, so drafts and rollbacks cross page boundaries), seeded sampling, and
    nothing left after finishing or aborting. tests/speculation/ runs the cases this does not: drafts
    that are nearly always rejected, stops inside accepted runs, sliding windows, other batch shapes."""
    check_draft(name, args, model=MODEL, small_pool="40KiB", block_size=4)


@pytest.mark.parametrize("name", ["paged", "contiguous"])
def test_builtin_allocators_conform(name):
    check_allocator(name, model=MODEL)


def test_a_draft_whose_tokens_leak_into_the_output_fails_the_suite(monkeypatch):
    from kvlab.speculation.speculator import Speculator

    verify = Speculator.verify

    def accept_everything(self, out, generators):  # a lossy verifier: the draft's first token always wins
        verified, rejected = verify(self, out, generators)
        return [(seq, [t + 1 if i == 0 else t for i, t in enumerate(toks)]) for seq, toks in verified], rejected

    monkeypatch.setattr(Speculator, "verify", accept_everything)
    with pytest.raises(AssertionError, match="greedy output differs from plain decoding"):
        check_draft("ngram", {"num_tokens": 3}, model=MODEL)


def test_a_draft_that_never_proposes_fails_the_suite_rather_than_passing_vacuously():
    from dataclasses import dataclass

    from kvlab.registry import DRAFTS
    from kvlab.speculation.drafts.base import DraftModel, Proposal

    @DRAFTS.register("test-silent")
    @dataclass
    class Silent(DraftModel):
        def propose(self, seqs, lengths, generators):
            return [Proposal([]) for _ in seqs]

    try:
        with pytest.raises(AssertionError, match="draft 'test-silent' proposed nothing, so the check did not run"):
            check_draft("test-silent", model=MODEL)
    finally:
        DRAFTS._classes.pop("test-silent", None)


def test_an_allocator_that_loses_pages_fails_the_suite():
    from kvlab.cache.allocators.paged import PagedAllocator
    from kvlab.registry import ALLOCATORS

    @ALLOCATORS.register("test-losing")
    class Losing(PagedAllocator):
        def free(self, seq_id):  # forgets to give back the last page of every table longer than one
            table = self.tables[seq_id]
            if len(table) > 1:
                self.tables[seq_id] = table[:-1]
            super().free(seq_id)

    try:
        with pytest.raises(AssertionError, match="allocator 'test-losing'"):
            check_allocator("test-losing", model=MODEL)
    finally:
        ALLOCATORS._classes.pop("test-losing", None)


@pytest.mark.parametrize("name", PLACEMENTS.names())  # every registered placement, built-in or plugin
def test_builtin_placements_conform(name):
    check_placement(name)


def test_every_builtin_placement_is_covered():
    assert {"lru", "arc", "cost_aware"} <= set(PLACEMENTS.names())


def test_a_placement_that_names_pages_it_no_longer_holds_fails_the_suite():
    from kvlab.cache.tiers.placement.lru import LRUPlacement

    @PLACEMENTS.register("test-forgetful")
    class Forgetful(LRUPlacement):
        def removed(self, key):  # forgets nothing: a restored page stays its tier's victim
            pass

    try:
        with pytest.raises(ValueError, match="which that tier does not hold"):
            check_bookkeeping("test-forgetful")
    finally:
        PLACEMENTS._classes.pop("test-forgetful", None)


def test_a_placement_that_never_demotes_fails_the_suite_rather_than_passing_vacuously():
    from kvlab.cache.tiers.placement.lru import LRUPlacement

    @PLACEMENTS.register("test-nowhere")
    class Nowhere(LRUPlacement):
        def where(self, key):
            return None

    try:
        with pytest.raises(AssertionError, match="no page went down a tier"):
            check_placement("test-nowhere")
    finally:
        PLACEMENTS._classes.pop("test-nowhere", None)


def test_places_that_lose_a_tier_copy_fail_the_suite(monkeypatch):
    from kvlab.testing.placements import FakeMover

    monkeypatch.setattr(FakeMover, "discard", lambda self, key, tier: None)  # a dropped page's copy stays behind
    with pytest.raises(AssertionError, match="stores .* pages, records say"):
        check_bookkeeping("lru")

"""The `self_compressed` draft: the target drafting through a page-granular view of its own cache
(kvlab/speculation/drafts/self_compressed.py; the copied views: test_self_compressed_copies.py). Lossless by
construction (the exact verifier); what these tests hold is that the draft reads the right pages, never writes
the target's, and that what it cannot do is refused with what it can.

Tiny random Llama (2 layers, vocab 256). The full view with every layer is the target itself: every draft
is accepted, which only holds if the view, the scratch copy of the partial last page, positions and slots
are right."""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.registry import DRAFTS, POLICIES, load_plugins
from kvlab.speculation.drafts.page_view import PageView, page_view
from kvlab.testing import check_combination, check_draft
from kvlab.testing.drafts import check_nothing_left

from helpers import MODEL, plain, prompts

pytestmark = pytest.mark.usefixtures("one_thread")
STREAMING = {"policy": "streaming_llm", "policy_args": {"budget": 32}, "num_tokens": 3}
ITSELF = {"policy": "full", "policy_args": {}, "num_tokens": 3}  # every page, every layer: the target itself


def long_prompts(n: int) -> list[list[int]]:
    """Prompts longer than STREAMING's 32-token view (the view then leaves pages out)."""
    from kvlab.testing.policies import prompts as policy_prompts

    return policy_prompts(256, lengths=(61, 40, 23, 50, 45))[:n]


def speculative(draft_args, batch, max_tokens, model=MODEL, **engine):
    llm = LLM(model, draft="self_compressed", draft_args=draft_args,
              **{"block_size": 16, "kv_cache_memory": "4MiB", **engine})
    outs = llm.generate(batch, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    check_nothing_left(llm, "self_compressed")
    return [o.token_ids for o in outs], llm.stats(), llm


# -- the view (torch-free) -------------------------------------------------------------
def test_streaming_view_reads_the_sink_pages_and_the_most_recent_ones():
    view = PageView("streaming_llm", sink_tokens=4, budget=64)  # 64 tokens: 4 pages of 16, the partial one included
    assert view.full_pages(40, 16) == [0, 1]  # everything fits
    assert view.full_pages(200, 16) == [0, 10, 11]  # 200 = 12 full pages + 8: sink page, 2 recent, the partial one
    assert view.full_pages(192, 16) == [0, 9, 10, 11]  # no partial page: 4 full ones
    assert PageView("streaming_llm", sink_tokens=0, budget=64).full_pages(200, 16) == [9, 10, 11]
    assert PageView("streaming_llm", sink_tokens=20, budget=64).full_pages(200, 16) == [0, 1, 11]
    assert PageView("streaming_llm", budget=16).full_pages(200, 16) == []  # the partial page alone
    assert PageView("streaming_llm", ratio=0.5).full_pages(320, 16) == list(range(10, 20))
    assert PageView("full").full_pages(200, 16) == list(range(12))


def test_policies_that_are_no_page_granular_view_are_refused_naming_what_is():
    load_plugins()
    for name, args in [("snapkv", {"budget": 32}), ("quest", {"budget": 64}), ("h2o", {"budget": 32})]:
        with pytest.raises(ValueError, match="supported views: streaming_llm, full"):
            page_view(POLICIES.build(name, **args))
    with pytest.raises(ValueError, match="needs policy_args.budget"):
        DRAFTS.build("self_compressed", policy="streaming_llm", policy_args={})
    with pytest.raises(ValueError, match="query-aware page selection"):
        DRAFTS.build("self_compressed", policy="quest", policy_args={"budget": 64})
    with pytest.raises(ValueError, match="layers must be an integer >= 1"):
        DRAFTS.build("self_compressed", layers=0)


def test_a_packed_target_format_runs_through_a_copy():
    """Refused before the copied views (its scratch would have opened and sealed packed pages); now exact
    (tests/speculation/test_self_compressed_copies.py holds the rest)."""
    assert check_combination(draft="self_compressed", draft_args=STREAMING, quant="int4", batch_invariant=True) == "exact"


# -- the engine ------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_the_full_view_with_every_layer_is_the_target_itself(batch_size, block_size):
    batch = prompts(batch_size)
    got, stats, _ = speculative(ITSELF, batch, 12, block_size=block_size)
    assert got == plain(batch, 12, ignore_eos=True)
    assert stats["spec_drafted_tokens"] > 0 and stats["spec_acceptance_rate"] == 1.0


@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_streaming_view_is_exact_and_accepts_less(batch_size):
    batch = long_prompts(batch_size)
    got, stats, _ = speculative(STREAMING, batch, 16)
    assert got == plain(batch, 16, ignore_eos=True)
    assert stats["spec_drafted_tokens"] > 0 and 0 < stats["spec_acceptance_rate"] < 1


def test_a_shallower_draft_over_the_target_cache_and_more_sequences_than_one_round():
    batch = long_prompts(5)
    got, stats, _ = speculative({**STREAMING, "layers": 1, "max_batch": 2}, batch, 12)
    assert got == plain(batch, 12, ignore_eos=True) and stats["spec_drafted_tokens"] > 0


def test_sliding_window_model_matches_plain():
    """Gemma 3 tiny (window 8 on 5 of 6 layers, 1-token pages): window groups keep their cache indices."""
    gemma, batch = "random:gemma3-tiny", prompts(4)
    got, stats, _ = speculative(STREAMING, batch, 12, model=gemma, block_size=1)
    assert got == plain(batch, 12, model=gemma, ignore_eos=True) and stats["spec_drafted_tokens"] > 0


def test_the_draft_never_writes_the_target_pages(monkeypatch):
    """Every pool page (all but the scratch) is bit-for-bit what it was before the draft proposed."""
    from kvlab.speculation.drafts.self_compressed import SelfCompressedDraft

    propose, checked = SelfCompressedDraft.propose, []

    def watched(self, seqs, lengths, generators):
        pool = slice(0, self._cache.scratch_pages[0])
        before = [t[pool].clone() for t in self._cache.page_tensors()]
        out = propose(self, seqs, lengths, generators)
        assert all(torch.equal(b, t[pool]) for b, t in zip(before, self._cache.page_tensors())), \
            "the draft wrote into the target's pages"
        checked.append(len(seqs))
        return out

    monkeypatch.setattr(SelfCompressedDraft, "propose", watched)
    batch = long_prompts(3)
    got, _, _ = speculative(STREAMING, batch, 10)
    assert got == plain(batch, 10, ignore_eos=True) and checked


def test_conformance_suite_with_preemption():
    """check_draft: greedy at batch 4 as plain decoding, again in a pool that preempts (4-token pages, so the
    partial last page and the drafts cross page boundaries), seeded sampling reproducible, nothing left."""
    check_draft("self_compressed", STREAMING, model=MODEL, small_pool="40KiB", block_size=4)


def test_sampled_outputs_follow_the_plain_distribution():
    """1,000 seeded sampled requests (temperature 1, top-k 4) with a one-layer draft over a 16-token view (most
    drafts rejected, some accepted): the 2nd and 3rd output tokens are distributed as plain sampling's
    (two-sample chi-square at 99.9%)."""
    from helpers import chi2_critical, two_sample_chi_square

    n, prompt = 1000, [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 1, 2]
    engine = dict(block_size=4, kv_cache_memory="64MiB", max_num_seqs=n, max_num_batched_tokens=n * 16)
    sp = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=i, ignore_eos=True) for i in range(n)]
    plain_out = [o.token_ids for o in LLM(MODEL, **engine).generate([prompt] * n, sp)]
    args = {"policy": "streaming_llm", "policy_args": {"budget": 16}, "layers": 1, "num_tokens": 2, "max_batch": 256}
    llm = LLM(MODEL, draft="self_compressed", draft_args=args, **engine)
    spec_out = [o.token_ids for o in llm.generate([prompt] * n, sp)]
    stats = llm.stats()
    assert stats["spec_drafted_tokens"] >= n and 0 < stats["spec_acceptance_rate"] < 1
    assert [o[0] for o in spec_out] == [o[0] for o in plain_out]
    for index in (1, 2):
        stat, df = two_sample_chi_square([o[index] for o in plain_out], [o[index] for o in spec_out])
        assert stat < chi2_critical(df), f"output token {index}: chi2 {stat:.1f} >= {chi2_critical(df):.1f}"

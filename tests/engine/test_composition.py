"""Plugins that meet (kvlab.testing.check_combination): a draft over a compressed cache, with prefix caching
and with parallel samples gives what the same cache gives without it; what cannot meet is refused (or runs
under a deviation the capability table declares)."""

from __future__ import annotations

import pytest

from kvlab.cache.block_manager import BlockManager, LayerGroup
from kvlab.sampling_params import SamplingParams
from kvlab.sequence import Sequence
from kvlab.testing import check_combination
from kvlab.testing.builtin_args import DRAFT_ARGS, POLICY_ARGS, TINY

pytestmark = pytest.mark.usefixtures("one_thread")
COMPACTING = sorted(p for p in POLICY_ARGS if p != "rocketkv")  # rocketkv reads sparsely: its drafts in the next file
# (tests/policies/test_sparse_read.py) and below


def combo(draft: str | None = None, policy: str = "full", **kw) -> dict:
    args = dict(kw)
    if draft is not None:
        args.update(draft=draft, draft_args=DRAFT_ARGS[draft])
    if policy != "full":
        args.update(policy=policy, policy_args=POLICY_ARGS[policy])
    return args


@pytest.mark.parametrize("policy", COMPACTING)
def test_ngram_speculation_over_every_compressed_cache_is_exact(policy):
    assert check_combination(**combo("ngram", policy)) == "exact"


@pytest.mark.parametrize("draft", sorted(DRAFT_ARGS))
@pytest.mark.parametrize("n", [1, 2])
def test_every_draft_over_snapkv_is_exact_also_with_parallel_samples(draft, n):
    assert check_combination(n=n, **combo(draft, "snapkv")) == "exact"


@pytest.mark.parametrize("draft", sorted(DRAFT_ARGS))
@pytest.mark.parametrize("index", ["hash", "radix"])
def test_every_draft_with_prefix_caching_is_exact(draft, index):
    assert check_combination(n=2, **combo(draft, enable_prefix_caching=True, prefix_cache=index)) == "exact"


@pytest.mark.heavy
@pytest.mark.parametrize("policy", COMPACTING)
@pytest.mark.parametrize("draft", sorted(set(DRAFT_ARGS) - {"ngram"}))
def test_every_draft_over_every_compressed_cache_is_exact(draft, policy):
    assert check_combination(**combo(draft, policy)) == "exact"


def test_declared_deviations_run_and_say_so():
    """Both differ where their deviation says they may (and only there: any other check still raises)."""
    got = check_combination(**combo("ngram", "snapkv", enable_prefix_caching=True))
    assert got == ("runs outside the contract: prefix caching with a compressing policy keeping shared pages whole; "
                   "differed: prefix hits, schedule")
    got = check_combination(**combo("layerskip", "snapkv", quant="int4"))
    assert got == "runs outside the contract: a rounding format under a changing schedule; differed: schedule"


def test_chain_and_tree_drafts_over_sparse_reading_are_exact():
    """Each verify row reads the pages plain decoding selects at its position (kvlab.policies.sparse_read), a
    token tree's node at its root + depth with its ancestors before it (once refused;
    tests/policies/test_sparse_read.py runs the rest of the matrix)."""
    assert check_combination(**combo("model", "rocketkv")) == "exact"
    assert check_combination(**combo("tree", "rocketkv")) == "exact"


def test_the_suite_catches_a_draft_that_changes_the_output(monkeypatch):
    from kvlab.speculation.speculator import Speculator

    verify = Speculator.verify

    def off_by_one(self, out, generators):  # every accepted run's last token shifted: a lossy verifier
        verified, rejected = verify(self, out, generators)
        return [(seq, run[:-1] + [(run[-1] + 1) % self.vocab_size]) for seq, run in verified], rejected

    monkeypatch.setattr(Speculator, "verify", off_by_one)
    with pytest.raises(AssertionError, match="differs from the same cache without the draft"):
        check_combination(**combo("ngram", "snapkv"))


def test_only_appended_tokens_are_hashed_after_a_verify_step():
    """After a verify step the accepted drafts are computed (num_computed_tokens) before the engine appends
    them: committing must hash full pages of appended tokens only, and register the rest once appended."""
    from kvlab.cache.allocators import PagedAllocator
    from kvlab.cache.block_manager import LayerGroup
    from kvlab.cache.prefix_cache import PrefixCache
    from kvlab.registry import PREFIX_EVICTIONS

    cache = PrefixCache(4, PREFIX_EVICTIONS.build("lru"), b"model")
    bm = BlockManager([LayerGroup((0,))], PagedAllocator(), 16, 4, 64, prefix_cache=cache)
    seq = Sequence(0, list(range(10, 16)), SamplingParams(max_tokens=8), 4, 0.0)  # 6 tokens
    bm.allocate(seq, 6, bm.lookup(seq))
    bm.append(seq, 3)
    seq.num_computed_tokens = 9  # 6 + 3 accepted drafts, not yet appended
    bm.commit(seq)
    assert [n.tokens for n in cache.chains[0]] == [(10, 11, 12, 13)]  # the page of tokens 4..7 waits
    seq.token_ids += [16, 17, 18]
    bm.commit(seq)
    assert [n.tokens for n in cache.chains[0]] == [(10, 11, 12, 13), (14, 15, 16, 17)]


def test_every_registered_draft_is_in_the_combination_tests_or_said_why():
    from kvlab.registry import DRAFTS, load_plugins

    load_plugins()
    cross_vocabulary = {"slem", "tli", "slrs"}  # they need two real tokenizers: tests/speculation/test_cross_vocab.py
    assert set(DRAFTS.names()) == set(DRAFT_ARGS) | cross_vocabulary


def test_parallel_samples_wait_when_a_reserving_allocator_cannot_fork_them():
    """The contiguous allocator copies a parent's whole reservation for each sample: in a small pool a fork
    that does not fit defers the sample (it computes its tokens itself) instead of failing the step."""
    assert check_combination(n=2, allocator="contiguous") == "exact"


def test_a_bad_argument_is_an_error_not_a_refusal():
    with pytest.raises(ValueError, match="budget"):
        check_combination(draft="ngram", policy="snapkv", policy_args={"budget": -3})


@pytest.mark.parametrize("policy", sorted(POLICY_ARGS))
def test_prefix_caching_that_copies_a_hits_pages_compresses_every_policy_exactly(policy):
    """prefix_keep_shared=False: a hit's pages are copied at admission and compressed as without caching, so
    prefix hits, preemption and batching change nothing (the default keeps shared pages whole: a deviation)."""
    args = combo(policy=policy, enable_prefix_caching=True, prefix_keep_shared=False)
    assert check_combination(**args) == "exact"


@pytest.mark.parametrize("extra", [dict(prefix_cache="radix"), combo("ngram"), dict(n=2)])
def test_prefix_caching_that_copies_a_hits_pages_is_exact_with_radix_drafts_and_samples(extra):
    assert check_combination(**combo(policy="snapkv", enable_prefix_caching=True, prefix_keep_shared=False),
                             **extra) == "exact"


def test_privatize_copies_every_shared_page_and_leaves_the_originals_findable():
    from kvlab.cache.allocators import NULL_BLOCK, PagedAllocator
    from kvlab.cache.prefix_cache import PrefixCache
    from kvlab.registry import PREFIX_EVICTIONS

    cache = PrefixCache(4, PREFIX_EVICTIONS.build("lru"), b"model")
    alloc = PagedAllocator()
    bm = BlockManager([LayerGroup((0,))], alloc, 8, 4, 64, prefix_cache=cache)
    first = Sequence(0, list(range(10, 19)), SamplingParams(max_tokens=4), 4, 0.0)  # 9 tokens: 2 full pages
    bm.allocate(first, 9, bm.lookup(first))
    first.num_computed_tokens = 9
    bm.commit(first)
    pages = alloc.block_table(bm.key(first, 0))[:2]
    bm.free(first)  # both full pages parked, findable
    assert all(cache.is_registered(p) for p in pages) and alloc.num_free_blocks == 8
    bm.keep_shared = False
    again = Sequence(1, list(range(10, 19)) + [40], SamplingParams(max_tokens=4), 4, 0.0)
    hit = bm.lookup(again)
    assert hit.tokens == 8 and bm.can_allocate(again, hit)
    again.num_computed_tokens = hit.tokens
    bm.allocate(again, again.num_tokens - hit.tokens, hit)
    table = alloc.block_table(bm.key(again, 0))
    assert not set(table[:2]) & set(pages) and NULL_BLOCK not in table  # its own copies
    assert sorted(alloc.take_copies()) == sorted(zip(pages, table[:2]))  # filled from the cached originals
    assert all(cache.is_registered(p) and alloc.num_owners(p) == 0 for p in pages)  # parked again, findable
    assert bm.protected_slots(again, 0) == 0


# every packed built-in -> its arguments (int4 with residual 0: every tree node lies past the window)
PACKED = {"int8": {}, "fp8_e4m3": {}, "fp8_e5m2": {}, "int4": {"residual": 0}, "int2": {}}
ROUNDING = "runs outside the contract: a rounding format under a changing schedule; "
TREE_OVER_PACKED = [("int8", "plain"), ("int4", "prefix+snapkv")]  # the rest: heavy


def tree_over(quant: str, extra: str) -> dict:
    args = combo("tree", quant=quant, quant_args=PACKED[quant])
    if extra == "prefix+snapkv":  # hits' pages copied: compressed as without caching (exact for full formats)
        args.update(combo(policy="snapkv"), enable_prefix_caching=True, prefix_keep_shared=False)
    return args


def test_every_packed_format_is_in_the_tree_tests():
    from kvlab.registry import QUANT_FORMATS, load_plugins

    load_plugins()
    assert {name for name in QUANT_FORMATS.names() if QUANT_FORMATS.build(name).packed} == set(PACKED)


@pytest.mark.parametrize("quant,extra", [
    *TREE_OVER_PACKED,
    *[pytest.param(q, e, marks=pytest.mark.heavy) for q in PACKED for e in ("plain", "prefix+snapkv")
      if (q, e) not in TREE_OVER_PACKED]])
def test_a_token_tree_over_packed_pages_changes_nothing_the_draft_could(quant, extra):
    """The tree's nodes stay in full-precision rows (or token-local codes) until the path is moved: the output
    with the tree equals the output without it; only the rounding deviation's schedule and prefix-hit
    checks may differ, as they do for the same format without a draft."""
    got = check_combination(**tree_over(quant, extra))
    assert got.startswith(ROUNDING) and "draft" not in got[len(ROUNDING):], got


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_per_chunk_compression_does_not_depend_on_the_step_budget(policy):
    """when="chunk" compresses every max_prefill_chunk prompt tokens (512 unset), in token time: the suite's
    32-token step budget cuts the prompts into other steps and the kept tokens stay the same."""
    args = {**POLICY_ARGS[policy], "when": "chunk"}
    assert check_combination(policy=policy, policy_args=args) == "exact"
    assert check_combination(policy=policy, policy_args=args, max_prefill_chunk=24) == "exact"

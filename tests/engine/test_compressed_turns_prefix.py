"""Kept compressed turns with prefix caching (reuse_compressed + enable_prefix_caching, hash and radix): one rule
(a kept turn whose tokens start the prompt wins; else the prefix index's hit), and each path gives what it gives
alone: a kept-turn hit what the same kept turn gives with prefix caching off, a prefix hit what it gives with
reuse_compressed off. A continuation registers nothing; a kept turn holds the shared prefix pages it was built
on; the pool drains.

The conversation: A and B share a 48-token system prompt (three pages); B hits A's cached pages (and H2O the
attention mass kept at A's page boundary 48); C continues A's kept turn, D continues B's, whose leading pages are
the shared cached ones. The reference with prefix caching off pins B's first 48 tokens (what its hit protects:
tests/cache/test_prefix_compression.py), so that it keeps the turn B keeps here."""

from __future__ import annotations

import random

import pytest

from kvlab import LLM, SamplingParams
from kvlab.testing.drafts import check_nothing_left

POLICIES = {"snapkv": {"compression_ratio": 0.5, "window_size": 8}, "h2o": {"compression_ratio": 0.5, "recent": 8}}
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
R = random.Random(7)
SYS = [R.randrange(3, 200) for _ in range(48)]
A, B = SYS + [R.randrange(3, 200) for _ in range(10)], SYS + [R.randrange(3, 200) for _ in range(10)]
NEW_C, NEW_D = [R.randrange(3, 200) for _ in range(20)], [R.randrange(3, 200) for _ in range(20)]


def make(policy: str, reuse: bool, prefix: str | None, **kw) -> LLM:
    index = dict(enable_prefix_caching=True, prefix_cache=prefix) if prefix else {}
    return LLM("random:llama-tiny", policy=policy, policy_args=POLICIES[policy], reuse_compressed=reuse,
               kv_cache_memory="1MiB", **index, **kw)


def spy_chunks(llm: LLM) -> dict[tuple, list[int]]:
    """prompt -> the chunk sizes its sequence computed."""
    seen: dict[tuple, list[int]] = {}
    prepare = llm.engine.runner.prepare

    def recording(batch):
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seen.setdefault(tuple(seq.token_ids[:seq.num_prompt_tokens]), []).append(n)
        return prepare(batch)

    llm.engine.runner.prepare = recording
    return seen


def kept_lengths(llm: LLM) -> dict[tuple, list[int]]:
    """tokens of each kept turn -> its tables' cached slots."""
    a = llm.engine.block_manager.allocator
    return {t.tokens: [a.num_tokens(k) for k in t.keys] for t in llm.engine.block_manager.kept_turns.entries.values()}


def run(llm: LLM, pin: int = 0) -> list[list[int]]:
    """A, B (its first `pin` tokens kept in place, as a prefix hit keeps them), C (continues A), D (continues B)."""
    gen = lambda prompt: list(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids)  # noqa: E731
    a = gen(A)
    bm = llm.engine.block_manager
    if pin:
        protected = bm.protected_slots
        bm.protected_slots = lambda seq, g: min(pin, bm.cached_lens([seq], g)[0])
    b = gen(B)
    if pin:
        bm.protected_slots = protected
    return [a, b, gen(A + a + NEW_C), gen(B + b + NEW_D)]


def drained(llm: LLM, name: str) -> None:
    check_nothing_left(llm, name)
    bm = llm.engine.block_manager
    while bm.kept_turns:
        bm.allocator.drop_kept_turn()
    pc = bm.prefix_cache
    assert not bm.allocator.tables
    assert len(bm.allocator.free_blocks) + (pc.num_parked if pc else 0) == bm.num_blocks


# 8-token steps: a continuation's later chunks must not stop where the prefix statistics of a prompt would be kept
CASES = [(p, i, 512) for p in sorted(POLICIES) for i in ("hash", "radix")] + [("h2o", "hash", 8)]


@pytest.mark.parametrize("policy, prefix, budget", CASES)
def test_each_path_gives_what_it_gives_alone(policy, prefix, budget):
    both = make(policy, True, prefix, max_num_batched_tokens=budget)
    chunks = spy_chunks(both)
    out = run(both)
    st = both.engine.stats()
    assert st["turn_reuse_hits"] == 2 and st["turns_kept"] == 4
    assert st["prefix_hit_tokens"] == 48  # B on A's cached pages; C and D took their kept turns
    turn_b = next(t for t in both.engine.block_manager.kept_turns.entries.values() if t.tokens[:len(B)] == tuple(B))
    a, pc = both.engine.block_manager.allocator, both.engine.block_manager.prefix_cache
    for key in turn_b.keys:  # B's turn holds the shared cached pages of the system prompt it was built on
        assert all(pc.is_registered(p) and a.num_owners(p) >= 1 for p in a.block_table(key)[:3])

    # the prefix path alone: A (no hit), B (a hit on A's pages)
    prefix_only = make(policy, False, prefix, max_num_batched_tokens=budget)
    assert run(prefix_only)[:2] == out[:2]
    # the kept-turn path alone: C and D on the same kept turns
    turns_only = make(policy, True, None, max_num_batched_tokens=budget)
    chunks_alone = spy_chunks(turns_only)
    assert run(turns_only, pin=48) == out
    assert kept_lengths(turns_only) == kept_lengths(both)  # a continuation recompresses its history: nothing protected
    for prompt in (A + out[0] + NEW_C, B + out[1] + NEW_D):  # a continuation's chunks are those it gets alone
        assert chunks[tuple(prompt)] == chunks_alone[tuple(prompt)]
    drained(both, f"{policy}/{prefix}")


@pytest.mark.parametrize("prefix", ["hash", "radix"])
def test_a_continuation_registers_nothing(prefix):
    """C's pages after A's kept history hold K/V that attended to a compressed cache: once the turns are gone, C's
    prompt (and more) finds only the 48 tokens A computed uncompressed, and gives what it gives without kept turns."""
    both = make("snapkv", True, prefix)
    a = both.generate([A], GREEDY)[0].outputs[0].token_ids
    both.generate([A + list(a) + NEW_C], GREEDY)
    assert both.engine.stats()["turn_reuse_hits"] == 1
    while both.engine.block_manager.kept_turns:
        both.engine.block_manager.allocator.drop_kept_turn()
    again = A + list(a) + NEW_C + NEW_D
    assert both.engine.block_manager.num_cached_tokens(both.engine.make_sequence(again, GREEDY)) == 48
    alone = make("snapkv", False, prefix)  # the same cached pages: A's
    alone.generate([A], GREEDY)
    out = [llm.generate([again], GREEDY)[0].outputs[0].token_ids for llm in (both, alone)]
    assert out[0] == out[1]
    drained(both, prefix)


@pytest.mark.parametrize("quant, prefix", [("int4", "hash"), ("int4", "radix"), ("fp8_e4m3", "hash")])
def test_a_packed_format_keeps_both_rules(quant, prefix):
    """int4's residual window (32 tokens): a prefix hit stops 32 tokens before the prompt's end, a kept-turn hit only
    before the policy's observation window (C's 20 new tokens: the turn is still hit); fp8 with per-token scales,
    no window. C equals the kept-turn path alone, B the prefix path alone (each request runs alone, in the chunks it
    gets in every run, so a rounding format stores the same bits: no batch-invariant mode needed)."""
    both = make("snapkv", True, prefix, quant=quant)
    out = run(both)
    assert both.engine.stats()["turn_reuse_hits"] == 2
    assert run(make("snapkv", False, prefix, quant=quant))[:2] == out[:2]
    assert run(make("snapkv", True, None, quant=quant))[2] == out[2]
    drained(both, f"{quant}/{prefix}")
    assert both.engine.stats().get("residual_early_seals", 0) == 0


def test_the_table_runs_it_under_the_two_deviations_it_has():
    """No refusal applies; it runs under the kept-turn deviation and (with prefix_keep_shared) the shared-pages one."""
    from kvlab.testing.combinations import verdict

    for index in ("hash", "radix"):
        why, deviating = verdict(policy="snapkv", policy_args=POLICIES["snapkv"], reuse_compressed=True,
                                 enable_prefix_caching=True, prefix_cache=index)
        assert why is None
        assert {d.name for d in deviating} == {"reusing compressed turns",
                                               "prefix caching with a compressing policy keeping shared pages whole"}


@pytest.mark.heavy
@pytest.mark.parametrize("index", ["hash", "radix"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_combination_suite_runs_it(policy, index):
    """kvlab.testing.check_combination: the checks its deviations do not excuse hold (drafts exact, nothing left)."""
    from kvlab.testing import check_combination

    got = check_combination(policy=policy, policy_args=POLICIES[policy], reuse_compressed=True,
                            enable_prefix_caching=True, prefix_cache=index, draft="ngram", draft_args={"num_tokens": 3})
    assert got.startswith("runs outside the contract: prefix caching with a compressing policy keeping shared pages "
                          "whole; reusing compressed turns; "), got


FILLS = [[R.randrange(3, 200) for _ in range(200)] for _ in range(3)]


def conversation_with_evictions(llm: LLM) -> list[list[int]]:
    """A, D on A's kept turn; the turns dropped, then three 200-token fillers (a 40-page pool parks and evicts the
    system prompt's pages); B hits them again (restored from a tier when one is on), C and E on kept turns."""
    gen = lambda prompt: list(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids)  # noqa: E731
    a = gen(A)
    out = [a, gen(A + a + NEW_D)]
    bm = llm.engine.block_manager
    while bm.kept_turns:
        bm.allocator.drop_kept_turn()
    for fill in FILLS:
        gen(fill)
    b = gen(B)
    return out + [b, gen(A + a + NEW_C), gen(B + b + NEW_D)]


@pytest.mark.parametrize("offload, prefix", [("host", "hash"), ("disk", "radix")])
def test_tiers_below_the_pool_with_kept_turns_and_prefix_caching(offload, prefix, tmp_path):
    """offload + reuse_compressed + prefix caching: a 40-page pool with a tier gives what a pool that evicts nothing
    gives (the same prefix hits and kept-turn hits; the tier restores the system prompt's evicted pages)."""
    kw = dict(policy="snapkv", policy_args=POLICIES["snapkv"], reuse_compressed=True, enable_prefix_caching=True,
              prefix_cache=prefix)
    ample = LLM("random:llama-tiny", kv_cache_memory="1MiB", **kw)
    args = {"path": str(tmp_path)} if offload == "disk" else {}
    tiered = LLM("random:llama-tiny", kv_cache_memory="160KiB", offload=offload, offload_args=args, **kw)
    assert conversation_with_evictions(tiered) == conversation_with_evictions(ample)
    st = tiered.engine.stats()
    assert st["tier_demoted"] > 0 and st[f"tier_{offload}_hits"] > 0 and st["turn_reuse_hits"] == 2
    assert st["prefix_hit_tokens"] == ample.engine.stats()["prefix_hit_tokens"] == 96
    drained(tiered, f"{offload}/{prefix}")

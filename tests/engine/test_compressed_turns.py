"""Kept compressed turns (EngineConfig.reuse_compressed, kvlab/cache/kept_turns.py): a conversation's next turn
continues from the previous turn's compressed cache, the kept pages are evicted under pool pressure, nothing
leaks, and with the option off nothing changes."""

from __future__ import annotations

import random

import pytest

from kvlab import LLM, SamplingParams
from kvlab.testing.builtin_args import DRAFT_ARGS
from kvlab.testing.drafts import check_nothing_left
from kept_turn_reads import held, same, spy_turn_reads

POLICIES = {"snapkv": {"compression_ratio": 0.5, "window_size": 8}, "h2o": {"compression_ratio": 0.5, "recent": 8}}
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
R = random.Random(0)
P1 = [R.randrange(3, 200) for _ in range(70)]
NEW = [R.randrange(3, 200) for _ in range(20)]


def make(policy: str, reuse: bool = True, memory: str = "1MiB") -> LLM:
    return LLM("random:llama-tiny", policy=policy, policy_args=POLICIES[policy], reuse_compressed=reuse,
               kv_cache_memory=memory)


def two_turns(llm: LLM, second=None):
    first = llm.generate([P1], GREEDY)[0].outputs[0].token_ids
    prompt = second(first) if second else P1 + list(first) + NEW
    return first, llm.generate([prompt], GREEDY)[0].outputs[0].token_ids


def spy_first_chunks(llm: LLM) -> dict[int, tuple[int, int]]:
    """seq id -> (first position computed, cache slots before it in group 0) of each sequence's first chunk."""
    seen: dict[int, tuple[int, int]] = {}
    runner, bm, prepare = llm.engine.runner, llm.engine.block_manager, llm.engine.runner.prepare

    def recording(batch):
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seen.setdefault(seq.seq_id, (seq.num_computed_tokens, bm.cached_lens([seq], 0)[0] - n))
        return prepare(batch)

    runner.prepare = recording
    return seen


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_second_turn_continues_from_the_first_turns_compressed_cache(policy):
    llm = make(policy)
    seen = spy_first_chunks(llm)
    first, _ = two_turns(llm)
    st = llm.engine.stats()
    covered = len(P1) + len(first) - 1  # the last sampled token of turn 1 was never written
    assert st["turn_reuse_hits"] == 1 and st["turn_reuse_tokens"] == covered and st["turns_kept"] == 2
    (_, (start1, cached1)), (_, (start2, cached2)) = sorted(seen.items())
    assert (start1, cached1) == (0, 0)
    # turn 2 computes only its new tokens, at their RoPE positions, after the kept (fewer) cache slots
    assert start2 == covered and 0 < cached2 < covered
    check_nothing_left(llm, policy)


def test_h2o_keeps_the_accumulated_attention_of_every_kept_key():
    llm = make("h2o")
    llm.generate([P1], GREEDY)
    bm = llm.engine.block_manager
    (turn,) = bm.kept_turns.entries.values()
    assert turn.state is not None and set(turn.state) == set(llm.engine.compressor.layers)
    for g, key in enumerate(turn.keys):
        layer = bm.groups[g].layers[0]
        assert turn.state[layer].shape[0] == bm.allocator.num_tokens(key)
    seeded = {}
    seed = llm.engine.compressor.seed_turn
    llm.engine.block_manager.on_turn_hit = lambda seq, state: (seeded.setdefault(seq.seq_id, state), seed(seq, state))
    llm.generate([P1 + list(turn.tokens[len(P1):]) + [5] + NEW], GREEDY)
    assert list(seeded.values()) == [turn.state]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_with_the_option_off_nothing_changes(policy):
    off_first, off_second = two_turns(make(policy, reuse=False))
    alone = make(policy, reuse=False).generate([P1 + list(off_first) + NEW], GREEDY)[0].outputs[0].token_ids
    assert off_second == alone  # the second turn recomputes and compresses its whole prompt
    llm = make(policy, reuse=False)
    two_turns(llm)
    assert not any(k.startswith("turn") for k in llm.engine.stats())
    on_first, _ = two_turns(make(policy))
    assert on_first == off_first  # keeping a turn does not change it


def test_a_prompt_that_only_partly_matches_does_not_reuse():
    llm = make("snapkv")
    seen = spy_first_chunks(llm)
    first = llm.generate([P1], GREEDY)[0].outputs[0].token_ids
    changed = list(P1)
    changed[40] = changed[40] % 190 + 4  # another token inside the history
    for prompt in (P1 + list(first[:-3]) + NEW, changed + list(first) + NEW, P1[:50] + NEW):
        llm.generate([prompt], GREEDY)
    assert llm.engine.stats()["turn_reuse_hits"] == 0
    assert all(start == 0 for start, _ in seen.values())
    check_nothing_left(llm, "partial")


@pytest.mark.parametrize("quant, memory", [("auto", "64KiB"), ("int4", "64KiB")])
def test_kept_turns_are_evicted_under_pool_pressure_and_requests_complete(quant, memory):
    """int4: a kept turn's open pages hold leased residual rows, given back when the turn goes."""
    llm = LLM("random:llama-tiny", policy="snapkv", policy_args=POLICIES["snapkv"], reuse_compressed=True,
              kv_cache_memory=memory, quant=quant)
    bm = llm.engine.block_manager
    r = random.Random(1)
    prompts = [[r.randrange(3, 200) for _ in range(70)] for _ in range(6)]
    for p in prompts:  # one at a time: each finished turn stays kept until the pool needs its pages
        assert len(llm.generate([p], GREEDY)[0].outputs[0].token_ids) == 8
    st = llm.engine.stats()
    assert st["turns_kept"] == 6 and st["turn_evictions"] > 0 and 0 < st["turns_held"] < 6
    outs = llm.generate([[r.randrange(3, 200) for _ in range(100)] for _ in range(2)], GREEDY)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert bm.allocator.num_kept_only <= bm.num_blocks
    check_nothing_left(llm, "pressure")
    assert llm.engine.stats().get("residual_early_seals", 0) == 0  # every lease the claims promised was had


def test_the_store_keeps_at_most_its_capacity_and_drains():
    llm = LLM("random:llama-tiny", policy="snapkv", policy_args=POLICIES["snapkv"], reuse_compressed=True,
              reuse_compressed_max_turns=2, kv_cache_memory="1MiB")
    r = random.Random(2)
    llm.generate([[r.randrange(3, 200) for _ in range(60)] for _ in range(4)], GREEDY)
    turns, a = llm.engine.block_manager.kept_turns, llm.engine.block_manager.allocator
    assert len(turns) == 2 and turns.stats.evictions == 2
    while turns:
        a.drop_kept_turn()
    assert not a.tables and a.num_free_blocks == len(a.free_blocks) == a.num_blocks


@pytest.mark.parametrize("draft", sorted(DRAFT_ARGS))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_draft_over_a_kept_turn_changes_nothing(policy, draft):
    """Each draft keeps what it reads in its own state (a model draft's shadow sequences, synced on the request's
    tokens, not on the target's cache; self_compressed reads the kept pages through its view), so a hit on a
    kept turn with a draft gives the tokens the same hit gives without one; H2O's totals keep accumulating
    over the verified rows after the prompt (a kept turn's totals run to its end)."""
    plain = two_turns(make(policy))
    llm = LLM("random:llama-tiny", policy=policy, policy_args=POLICIES[policy], reuse_compressed=True,
              kv_cache_memory="1MiB", draft=draft, draft_args=DRAFT_ARGS[draft])
    assert two_turns(llm) == plain
    assert llm.engine.stats()["turn_reuse_hits"] == 1
    check_nothing_left(llm, policy)


# -- packed formats and sparse reading over a kept turn ---------------------------------------------------------
# What a continuing request reads from a kept turn must be what the finished request's cache held: the same codes,
# the same open pages' full-precision residual rows, the same page summaries (sparse reading), whatever requests
# continued from the turn before it. int4 / int2 keep a residual window (rows leased from the pool); int8 and fp8
# (per-token scales) are packed without one.
PACKED = ("int8", "int4", "int2", "fp8_e4m3")
LONGER = SamplingParams(max_tokens=24, ignore_eos=True)
READERS = {**POLICIES, "rocketkv": {"budget": 32, "window_size": 8, "kernel_size": 5}}


@pytest.mark.parametrize("quant", PACKED)
@pytest.mark.parametrize("policy", sorted(READERS))
def test_a_continuation_reads_exactly_what_the_kept_turn_held(policy, quant):
    """Two requests continue from one kept turn, one after the other: each one's first forward reads, in the slots
    the turn covers, exactly what the finished request held (codes, open rows, summaries). The first continuation
    seals and compacts its own copies; the turn keeps its open pages open for the second. The pool drains."""
    llm = LLM("random:llama-tiny", policy=policy, policy_args=READERS[policy], reuse_compressed=True,
              kv_cache_memory="1MiB", quant=quant, batch_invariant=True)
    kept, first = spy_turn_reads(llm)
    out = llm.generate([P1], LONGER)[0].outputs[0].token_ids  # decodes past a page after compaction
    other = [R.randrange(3, 200) for _ in range(30)]
    for new in (other, NEW):  # the first pushes the turn's open pages out of its window at its first step
        llm.generate([P1 + list(out) + new], GREEDY)
    assert llm.engine.stats()["turn_reuse_hits"] == 2 and len(first) == 2
    if quant in ("int4", "int2"):  # the turn has a full page open (its residual row), not only its last one
        assert any(sum(opened) > 1 for _, _, opened, _ in kept[0])
    if policy == "rocketkv":
        assert kept[0][0][3]  # page summaries compared
    for reads in first.values():
        assert same(reads, kept[0])
    check_nothing_left(llm, f"{policy}/{quant}")
    a = llm.engine.block_manager.allocator
    while llm.engine.block_manager.kept_turns:
        a.drop_kept_turn()
    assert not a.tables and len(a.free_blocks) == a.num_blocks  # the turns' rows went back with them


@pytest.mark.parametrize("quant", ["int4", "fp8_e4m3"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_draft_over_a_kept_turn_of_a_packed_format_changes_nothing(policy, quant):
    """Batch-invariant mode: a verify pass rounds each row as a decode pass would, so over a kept turn's codes and
    open rows the ngram draft gives the tokens the same hit gives without one, and the pool drains."""
    def run(**draft):
        llm = LLM("random:llama-tiny", policy=policy, policy_args=POLICIES[policy], reuse_compressed=True,
                  kv_cache_memory="1MiB", quant=quant, batch_invariant=True, **draft)
        turns = two_turns(llm)
        assert llm.engine.stats()["turn_reuse_hits"] == 1
        check_nothing_left(llm, f"{policy}/{quant}")
        return turns

    assert run(draft="ngram", draft_args=DRAFT_ARGS["ngram"]) == run()

"""Kept compressed turns (EngineConfig.reuse_compressed) with per-head budgets (AdaKV, Feng et al. 2024,
arXiv:2407.11550): a kept turn's KV heads hold different numbers of tokens, and the request continuing it
compresses again at its prompt's end over each head's own tokens (kvlab.policies.adakv.AdaKV.select_heads).

Here: the continuation's first forward reads exactly what the finished turn held, head by head; its compression
keeps, per head, what a reference written out over that head's tokens alone keeps (the scorer on the head's own
keys, query heads and totals, then AdaKV's sharing of the layer's budget, no head keeping more than it holds);
what it keeps does not depend on the schedule (a 8-token step budget, other requests beside it); and where no
turn is hit the output is that of reuse_compressed=False. The model is the tiny random Llama with one KV head's
attention sharp and the other's flat (tests/head_models.py) for H2O, one head's 4x sharper than the
other's for SnapKV and the key norms (whose scores lie below 0, as the padding of a shorter head must never
rank), so the heads keep different counts.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.testing import check_combination
from kvlab.testing.builtin_args import DRAFT_ARGS, POLICY_ARGS
from kvlab.testing.drafts import check_nothing_left
from head_models import sharp_and_flat, sharper
from kept_turn_reads import held, same, spy_turn_reads

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BUDGET, ALPHA = 24, 0.2
SCORERS = {  # scorer -> (AdaKV's arguments, the model whose heads it ranks apart)
    "snapkv": ({"budget": BUDGET, "alpha_safeguard": ALPHA, "scorer_args": {"window_size": 8}}, "sharper"),
    "h2o": ({"budget": BUDGET, "alpha_safeguard": ALPHA, "scorer": "h2o", "scorer_args": {"recent": 8}},
            "sharp_and_flat"),
    "knorm": ({"budget": BUDGET, "alpha_safeguard": ALPHA, "scorer": "knorm"}, "sharper"),  # scores below 0
}
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
R = random.Random(0)
P1 = [R.randrange(3, 200) for _ in range(70)]
NEW = [R.randrange(3, 200) for _ in range(20)]
OTHERS = [[R.randrange(3, 200) for _ in range(k)] for k in (33, 51)]


@pytest.fixture(scope="module")
def model():
    loaded = {"sharper": sharper(), "sharp_and_flat": sharp_and_flat()}
    return lambda scorer: loaded[SCORERS[scorer][1]]


def make(model, scorer: str, **kw) -> LLM:
    args = {"reuse_compressed": True, "kv_cache_memory": "1MiB", **kw}
    return LLM("random:llama-tiny", loaded=copy.deepcopy(model(scorer)), policy="adakv",
               policy_args=SCORERS[scorer][0], **args)


def first_turn(llm: LLM) -> list[int]:
    return list(llm.generate([P1], GREEDY)[0].outputs[0].token_ids)


def kept_lengths(llm: LLM) -> list[int]:
    turns, a = llm.engine.block_manager.kept_turns, llm.engine.block_manager.allocator
    return [a.num_tokens(k) for k in next(reversed(turns.entries.values())).keys]


def spy_continuation(llm: LLM) -> list[dict]:
    """Per compression of a sequence whose heads hold different counts: per layer, each head's tokens and totals
    read from its own table before it, the layer's recorded queries, and each head's tokens and totals after."""
    comp, seen = llm.engine.compressor, []
    compress = comp.compress

    def recording(seq, queries, mass=None):
        mass = mass if mass is not None else {}
        before = {layer: [(comp.gather(seq, g, layer), mass.get(g)) for g in groups]
                  for layer, groups in comp.layers.items()}
        ragged = any(len({k.shape[0] for (k, _), _ in heads}) > 1 for heads in before.values())
        freed = compress(seq, queries, mass)
        if ragged:
            after = {layer: [(comp.gather(seq, g, layer), mass.get(g)) for g in groups]
                     for layer, groups in comp.layers.items()}
            seen.append({"seq_len": seq.num_computed_tokens, "queries": dict(queries), "before": before,
                         "after": after})
        return freed

    comp.compress = recording
    return seen


def reference_keep(llm: LLM, layer: int, seq_len: int, heads: list, queries: torch.Tensor | None) -> list[list[int]]:
    """AdaKV over heads of different lengths, written out: head h scored by the scorer over its own keys alone
    (a one-KV-head layer: its L_h tokens, its query heads h*g .. h*g + g - 1, its own totals), each head's best
    min(L_h, max(1, int(budget * alpha))) kept, then the best remaining (head, token) pairs of the layer up to
    budget x Hkv; a head keeps at most what it holds."""
    policy = llm.engine.compressor.policy
    scorer, n_heads = policy._inner, len(heads)
    scorer.begin(seq_len)
    score = []
    for h, ((keys, values), mass) in enumerate(heads):
        g = 0 if queries is None else queries.shape[1] // n_heads  # query heads per KV head
        q = None if queries is None else queries[:, h * g:(h + 1) * g]
        score.append([float(s) for s in scorer.score(layer, keys, values, q, mass)[:, 0]])
    keep = min(BUDGET, seq_len)
    safe = max(1, int(keep * ALPHA))
    kept = set()
    for h, s in enumerate(score):
        kept |= {(h, j) for j in sorted(range(len(s)), key=lambda j: (-s[j], j))[:safe]}
    rest = sorted(((s[j], h, j) for h, s in enumerate(score) for j in range(len(s)) if (h, j) not in kept),
                  key=lambda t: -t[0])
    kept |= {(h, j) for _, h, j in rest[: keep * n_heads - len(kept)]}
    return [sorted(j for g, j in kept if g == h) for h in range(n_heads)]


@pytest.mark.parametrize("scorer", sorted(SCORERS))
def test_the_continuation_compresses_each_head_over_its_own_tokens(model, scorer):
    llm = make(model, scorer)
    seen = spy_continuation(llm)
    out = first_turn(llm)
    assert len(set(kept_lengths(llm))) > 1, "the kept turn's heads hold as many tokens: nothing here is per head"
    llm.generate([P1 + out + NEW], GREEDY)
    assert llm.engine.stats()["turn_reuse_hits"] == 1 and len(seen) == 1
    (call,) = seen
    comp = llm.engine.compressor
    ragged = [layer for layer, heads in call["before"].items() if len({k.shape[0] for (k, _), _ in heads}) > 1]
    assert ragged, "no layer's heads differed when the continuation compressed"
    for layer, heads in call["before"].items():  # a layer whose heads happen to hold as many: the same reference
        want = reference_keep(llm, layer, call["seq_len"], heads, call["queries"].get(layer))
        assert sum(map(len, want)) == BUDGET * len(heads)
        for h, (((keys, values), mass), ((k_after, v_after), m_after)) in enumerate(zip(heads, call["after"][layer])):
            assert torch.equal(k_after[:, 0], keys[want[h], 0]) and torch.equal(v_after[:, 0], values[want[h], 0]), \
                f"layer {layer} head {h}: other tokens than the reference keeps ({k_after.shape[0]} vs {len(want[h])})"
            if mass is not None:  # H2O: each head's totals follow its own kept tokens
                assert torch.equal(m_after, mass[want[h]])
        assert scorer != "h2o" or all(m is not None for _, m in heads)
    check_nothing_left(llm, f"adakv/{scorer}")
    assert comp.num_tracked() == 0


@pytest.mark.parametrize("scorer", sorted(SCORERS))
def test_the_continuation_reads_exactly_what_the_kept_turn_held_head_by_head(model, scorer):
    llm = make(model, scorer)
    kept, first = spy_turn_reads(llm)
    out = first_turn(llm)
    llm.generate([P1 + out + NEW], GREEDY)
    assert llm.engine.stats()["turn_reuse_hits"] == 1 and len(first) == 1
    (reads,) = first.values()
    assert len({n for n, *_ in kept[0]}) > 1 and same(reads, kept[0])  # every head's own count, as kept


@pytest.mark.parametrize("scorer", sorted(SCORERS))
def test_what_the_continuation_keeps_does_not_depend_on_the_schedule(model, scorer):
    """The same two turns in one step each, then with an 8-token step budget (the new tokens in chunks, the
    compression at the prompt's end all the same) beside two other requests: the same tokens, and the second
    turn's kept tables hold the same keys and values, head by head (bit for bit: batch_invariant=True, without
    which a pass of another shape computes K/V that differ in their last bits)."""
    def run(**kw):
        llm = make(model, scorer, **kw)
        out = first_turn(llm)
        others = OTHERS if "max_num_batched_tokens" in kw else []
        second = llm.generate([P1 + out + NEW] + others, GREEDY)[0].outputs[0].token_ids
        turns = llm.engine.block_manager.kept_turns
        (mine,) = [t for t in turns.entries.values() if t.tokens[: len(P1) + len(out)] == tuple(P1 + out)
                   and len(t.tokens) > len(P1) + len(out)]
        assert llm.engine.stats()["turn_reuse_hits"] == 1
        check_nothing_left(llm, f"adakv/{scorer}")
        return out, list(second), held(llm, mine.keys)

    alone, chunked = run(batch_invariant=True), run(batch_invariant=True, max_num_batched_tokens=8)
    assert alone[:2] == chunked[:2] and same(alone[2], chunked[2])
    assert len({n for n, *_ in alone[2]}) > 1


@pytest.mark.parametrize("scorer", sorted(SCORERS))
def test_without_a_hit_the_output_is_that_of_reuse_off(model, scorer):
    """A turn dropped before its continuation arrives: the continuation computes and compresses its whole prompt,
    as with reuse_compressed=False (and keeping the first turn changed nothing of it)."""
    off = make(model, scorer, reuse_compressed=False)
    off_first = first_turn(off)
    off_second = off.generate([P1 + off_first + NEW], GREEDY)[0].outputs[0].token_ids
    llm = make(model, scorer)
    assert first_turn(llm) == off_first
    llm.engine.block_manager.allocator.drop_kept_turn()
    assert llm.generate([P1 + off_first + NEW], GREEDY)[0].outputs[0].token_ids == off_second
    assert llm.engine.stats()["turn_reuse_hits"] == 0
    check_nothing_left(llm, f"adakv/{scorer}")


@pytest.mark.parametrize("draft", ["ngram", "self_compressed"])
@pytest.mark.parametrize("scorer", ["snapkv", "h2o"])
def test_a_draft_over_a_kept_per_head_turn_changes_nothing(model, scorer, draft):
    """A draft (its own state; self_compressed reads the per-head tables through its view) gives, over the kept
    turn and through the continuation's per-head compression, the tokens the same two turns give without it."""
    def two_turns(llm):
        out = first_turn(llm)
        second = llm.generate([P1 + out + NEW], GREEDY)[0].outputs[0].token_ids
        assert llm.engine.stats()["turn_reuse_hits"] == 1
        check_nothing_left(llm, f"adakv/{scorer} {draft}")
        return out, list(second)

    assert two_turns(make(model, scorer, draft=draft, draft_args=DRAFT_ARGS[draft])) == two_turns(make(model, scorer))


TINY_POOLS = {"random:llama-tiny": {}, "random:gemma3-tiny": {  # one KV head, 6 layer groups: 4 KiB pages
    "small_pools": ("112KiB", "128KiB", "144KiB", "160KiB", "192KiB", "256KiB")}}


@pytest.mark.heavy
@pytest.mark.parametrize("model_name", sorted(TINY_POOLS))
@pytest.mark.parametrize("args", [POLICY_ARGS["adakv"], {"budget": 32, "scorer": "h2o", "scorer_args": {"recent": 8}}],
                         ids=["snapkv", "h2o"])
def test_adakv_with_kept_turns_passes_the_combination_checks(model_name, args):
    """kvlab.testing.check_combination (~20-45 s each on two shared cores): it runs under the declared deviation
    "reusing compressed turns", and every check holds on these prompts."""
    got = check_combination(model=model_name, policy="adakv", policy_args=args, reuse_compressed=True,
                            **TINY_POOLS[model_name])
    assert got == "runs outside the contract: reusing compressed turns; held", got

"""Adaptive draft lengths and the confidence stop (kvlab/speculation/draft_length.py).

The rules are pure Python (first block). In the engine (tiny random Llama, vocab 256): a length rule or a
confidence threshold changes only how many tokens are drafted, never the output -- greedy output is
token-identical to plain decoding for every draft with a model, both rules, batched -- and a threshold of 1
(no draft is ever that sure) drafts exactly one token per verification."""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams
from kvlab.speculation.draft_length import RULES, check_threshold, confident, length_rule

from helpers import MODEL, plain, prompts

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the rules (torch-free) -------------------------------------------------------------------
def walk(rule: str, outcomes, start: int = 2, longest: int = 8) -> list[int]:
    """Lengths after each (drafted, accepted, capped) verification outcome."""
    lengths, n = [], start
    for drafted, accepted, capped in outcomes:
        n = RULES[rule].next_length(n, drafted, accepted, capped, longest)
        lengths.append(n)
    return lengths


def test_step_grows_by_one_and_heuristic_by_two_both_shrink_by_one_within_bounds():
    full, miss, capped = (2, 2, False), (2, 0, False), (2, 2, True)
    assert walk("step", [full, full, miss, capped, miss, miss, miss]) == [3, 4, 3, 3, 2, 1, 1]
    assert walk("heuristic", [full, full, full, full, miss, capped]) == [4, 6, 8, 8, 7, 7]


def test_a_full_accept_of_a_chain_shorter_than_asked_still_grows():
    """A confidence stop (or slem's re-tokenisation) proposes fewer tokens than the length: all accepted grows it."""
    assert RULES["heuristic"].next_length(5, 2, 2, False, 8) == 7


def test_bad_rules_and_thresholds_are_refused_naming_what_is_allowed():
    with pytest.raises(ValueError, match=r"draft model: length_rule must be one of \['heuristic', 'step'\]"):
        length_rule("dynamic", "model")
    for bad in (-0.1, 1.5, "0.4", True):
        with pytest.raises(ValueError, match="confidence_threshold must be None or a probability"):
            check_threshold("model", bad)
    check_threshold("model", None)
    assert confident(0.3, None) and confident(0.4, 0.4) and not confident(0.39, 0.4)


def test_drafts_without_a_model_refuse_a_confidence_threshold():
    with pytest.raises(ValueError, match="draft ngram: confidence_threshold needs a draft that draws"):
        LLM("does-not-exist", draft="ngram", draft_args={"confidence_threshold": 0.4})
    with pytest.raises(ValueError, match="draft ngram: length_rule must be one of"):
        LLM("does-not-exist", draft="ngram", draft_args={"adaptive": True, "length_rule": "fast"})


# -- in the engine: lossless, and the threshold does stop chains --------------------------------
TOY = {"tokenizer": "toy-b", "target_tokenizer": "toy-a"}
DRAFTS = {  # draft -> its arguments (the target's weights, so chains are accepted and lengths grow)
    "model": {"model": MODEL},
    "layerskip": {"layers": 1},
    "self_compressed": {"policy": "streaming_llm", "policy_args": {"budget": 32}},
    "slem": {"model": MODEL, **TOY},
    "tli": {"model": MODEL, **TOY},
}
CASES = [(d, rule, threshold) for d in DRAFTS for rule, threshold in (("step", 0.05), ("heuristic", None))]


def speculative(name, args, batch, max_tokens):
    llm = LLM(MODEL, draft=name, draft_args=args, block_size=16, kv_cache_memory="4MiB")
    outs = llm.generate(batch, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs], llm.stats()


@pytest.mark.parametrize("draft,rule,threshold", CASES, ids=[f"{d}-{r}-{t}" for d, r, t in CASES])
def test_adaptive_lengths_and_confidence_stops_keep_greedy_output(draft, rule, threshold):
    batch = prompts(6)
    args = {**DRAFTS[draft], "num_tokens": 2, "adaptive": True, "max_num_tokens": 6, "length_rule": rule,
            "confidence_threshold": threshold}
    got, stats = speculative(draft, args, batch, 14)
    assert got == plain(batch, 14, ignore_eos=True)
    assert stats["spec_verifications"] > 0 and stats["spec_drafted_tokens"] >= stats["spec_verifications"]


@pytest.mark.parametrize("draft", ["model", "layerskip", "self_compressed", "slem"])
def test_a_threshold_no_draft_reaches_drafts_one_token_per_verification(draft):
    """slem: one draft token, re-tokenised, may be more than one target token; its chains still shorten."""
    batch = prompts(4)
    args = {**DRAFTS[draft], "num_tokens": 4, "confidence_threshold": 1.0}
    got, stats = speculative(draft, args, batch, 12)
    assert got == plain(batch, 12, ignore_eos=True) and stats["spec_verifications"] > 0
    per = stats["spec_drafted_tokens"] / stats["spec_verifications"]
    assert per == 1.0 or (draft == "slem" and per < 2)
    _, free = speculative(draft, {**args, "confidence_threshold": None}, batch, 12)
    assert free["spec_drafted_tokens"] / free["spec_verifications"] > max(per, 2)  # without it the chains are longer


def test_heuristic_lengths_grow_faster_than_step_lengths():
    """The target's own weights as the draft: every chain accepted, so the heuristic rule reaches the longest
    chain in fewer verifications and drafts more tokens per verification."""
    batch = prompts(4)
    per = {}
    for rule in ("step", "heuristic"):
        args = {"model": MODEL, "num_tokens": 1, "adaptive": True, "max_num_tokens": 7, "length_rule": rule}
        got, stats = speculative("model", args, batch, 24)
        assert got == plain(batch, 24, ignore_eos=True) and stats["spec_acceptance_rate"] == 1.0
        per[rule] = stats["spec_drafted_tokens"] / stats["spec_verifications"]
    assert per["heuristic"] > per["step"]

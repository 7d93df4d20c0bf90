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


# -- sampled: adaptive lengths and confidence stops keep the target's distribution ------------------------
# 1,000 seeded sampled requests (temperature 1, top-k 4), 8 tokens each, with a one-layer draft (an early exit, or
# the target's first layer reading an 8-token SnapKV view of its own cache): the 2nd to 8th output tokens are
# distributed as plain sampling's (two-sample chi-square at 99.9%) while the chain lengths move (a length rule) or
# chains stop early (a confidence threshold). The drafts are close enough to the target that rejections are
# neither rare nor near-certain, so the residual distribution carries weight.
SAMPLED_N, SAMPLED_TOKENS = 1000, 8
SAMPLED_PROMPT = [5, 6, 7, 8, 9] * 4 + [1, 2]
SAMPLED_ENGINE = dict(block_size=4, kv_cache_memory="64MiB", max_num_seqs=SAMPLED_N,
                      max_num_batched_tokens=SAMPLED_N * 16)
SAMPLED_DRAFTS = {
    "layerskip": {"layers": 1},
    "self_compressed": {"policy": "snapkv", "policy_args": {"budget": 8, "window_size": 4}, "refresh": 8,
                        "layers": 1, "max_batch": 256},
}
SAMPLED_LENGTHS = {  # how the chain length moves
    "step": {"num_tokens": 1, "adaptive": True, "max_num_tokens": 4, "length_rule": "step"},
    "heuristic": {"num_tokens": 1, "adaptive": True, "max_num_tokens": 5, "length_rule": "heuristic"},
    "threshold": {"num_tokens": 4, "confidence_threshold": 0.006},  # about the median top probability here
}


def sampled_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=SAMPLED_TOKENS, temperature=1.0, top_k=4, seed=i, ignore_eos=True)
            for i in range(SAMPLED_N)]


_PLAIN_SAMPLED: list = []


def plain_sampled() -> list[list[int]]:
    if not _PLAIN_SAMPLED:
        llm = LLM(MODEL, **SAMPLED_ENGINE)
        _PLAIN_SAMPLED.extend(o.token_ids for o in llm.generate([SAMPLED_PROMPT] * SAMPLED_N, sampled_params()))
    return _PLAIN_SAMPLED


@pytest.mark.heavy  # 5-30 s each on two busy cores
@pytest.mark.parametrize("length", sorted(SAMPLED_LENGTHS))
@pytest.mark.parametrize("draft", sorted(SAMPLED_DRAFTS))
def test_sampled_outputs_keep_the_plain_distribution_under_adaptive_lengths(draft, length):
    from helpers import chi2_critical, two_sample_chi_square

    args = {**SAMPLED_DRAFTS[draft], **SAMPLED_LENGTHS[length]}
    llm = LLM(MODEL, draft=draft, draft_args=args, **SAMPLED_ENGINE)
    spec = [o.token_ids for o in llm.generate([SAMPLED_PROMPT] * SAMPLED_N, sampled_params())]
    stats, plain_out = llm.stats(), plain_sampled()
    assert 0.1 < stats["spec_acceptance_rate"] < 0.9, stats["spec_acceptance_rate"]  # rejections carry weight
    per = stats["spec_drafted_tokens"] / stats["spec_verifications"]
    if length == "threshold":  # chains stop early: shorter than the 4 asked for, longer than one token
        assert 1.2 < per < 3.0, per
    else:  # lengths move from the starting 1
        assert per > 1.1, per
    assert [o[0] for o in spec] == [o[0] for o in plain_out]  # the prefill's token: the same stream
    for index in range(1, SAMPLED_TOKENS):
        stat, df = two_sample_chi_square([o[index] for o in plain_out], [o[index] for o in spec])
        assert stat < chi2_critical(df), f"output token {index}: chi2 {stat:.1f} >= {chi2_critical(df):.1f}"

"""Parity of the `kvlab` lm-eval model with lm-eval's own `hf` backend on the same fp32 weights, full cache,
on kvlab's offline tasks with a small per-task limit: every per-request log-likelihood within 1e-3, the same
is_greedy flags and accuracies, rolling perplexity within 0.1%, identical greedy generations.

Each model's two evaluations run once (a module fixture, several minutes on two shared cores): `model` and
`heavy` (make test-heavy)."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is an extra: pip install -e .[lm_eval]")

from kvlab.study.lm_eval.parity import compare, evaluate_both  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.heavy]

LIMITS = {"kvlab_lambada_wikitext": 6, "kvlab_lambada_wikitext_gen": 4, "kvlab_wikitext2": 1, "kvlab_niah": 2}
MAX_MODEL_LEN = 513  # windows of 512 tokens: the WikiText-2 article spans several


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def comparison(request):
    kv, hf = evaluate_both(request.param, list(LIMITS), LIMITS, max_model_len=MAX_MODEL_LEN)
    return {c.task: c for c in compare(kv, hf)}


def test_every_loglikelihood_and_greedy_flag_matches(comparison):
    c = comparison["kvlab_lambada_wikitext"]
    assert c.samples == LIMITS["kvlab_lambada_wikitext"]
    assert c.max_abs_loglik_diff < 1e-3 and c.greedy_mismatches == 0
    assert c.metrics["acc,none"][0] == c.metrics["acc,none"][1]


def test_rolling_perplexity_matches_within_a_tenth_of_a_percent(comparison):
    c = comparison["kvlab_wikitext2"]
    assert c.max_rel_ppl_diff < 1e-3 and c.max_abs_loglik_diff < 1e-1  # a whole article's sum of log-probs


def test_greedy_generations_are_identical(comparison):
    for task in ("kvlab_lambada_wikitext_gen", "kvlab_niah"):
        c = comparison[task]
        assert c.samples == LIMITS[task] and c.generation_mismatches == 0
        assert all(a == b for a, b in c.metrics.values())

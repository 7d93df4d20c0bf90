"""The combination suite on a real model (heavy): a sample of meetings on SmolLM2, each expected exact.

The tiny random models of tests/engine/test_composition.py run every pair fast; a real model's sharper
distributions make a wrong cache change its greedy tokens more readily, so a sample is checked here too.
`make test-heavy` runs it (about a minute a case on two cores)."""

from __future__ import annotations

import pytest

from kvlab.testing.builtin_args import DRAFT_ARGS
from kvlab.testing.combinations import check_combination

pytestmark = [pytest.mark.heavy, pytest.mark.usefixtures("one_thread")]

MODEL = "smollm2-135m"
POOLS = dict(pool="64MiB", small_pools=("3MiB", "4MiB", "5MiB", "6MiB", "8MiB"))  # 46 KB a token in fp32

CASES = {
    "int4 + ngram, batch-invariant": dict(quant="int4", draft="ngram", draft_args=DRAFT_ARGS["ngram"],
                                          batch_invariant=True),
    "snapkv + layerskip": dict(policy="snapkv", policy_args={"budget": 48, "window_size": 8}, draft="layerskip",
                               draft_args={"layers": 12, "num_tokens": 3}),
    "snapkv every 8 at decode + ngram": dict(policy="snapkv", policy_args={"budget": 48, "window_size": 8,
                                                                           "when": "decode", "every": 8},
                                             draft="ngram", draft_args=DRAFT_ARGS["ngram"]),
    "h2o + radix prefix caching, copied": dict(policy="h2o", policy_args={"budget": 48, "recent": 8},
                                               enable_prefix_caching=True, prefix_cache="radix",
                                               prefix_keep_shared=False),
    "int8 + tree, batch-invariant": dict(quant="int8", draft="tree", draft_args={"layers": 12, "width": 2, "depth": 2},
                                         batch_invariant=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_real_model_meets_exactly(name, fresh_model):
    assert check_combination(MODEL, loaded=fresh_model(MODEL), **POOLS, **CASES[name]) == "exact"

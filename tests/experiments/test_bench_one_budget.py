"""experiments/bench_one_budget.py's bookkeeping, without a model: the configurations it runs, the engine
options of each, and the words it gives a combination's gain against the product of its singles' gains.
(The script itself is smoked on random:llama-tiny by hand: ~25 s, too slow for this suite.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "bench_one_budget.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_one_budget", SCRIPT)  # its helpers: kvlab.study.bench_io
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configurations_are_full_singles_pairs_and_all_four(bench):
    configs = bench.configurations(all_subsets=False)
    assert configs[0] == () and len(configs) == 12 == len(set(configs))
    assert [c for c in configs if len(c) == 1] == [(t,) for t in bench.TECHNIQUES]
    assert sum(len(c) == 2 for c in configs) == 6 and configs[-1] == bench.TECHNIQUES
    every = bench.configurations(all_subsets=True)
    assert len(every) == 16 == len(set(every)) and set(configs) < set(every)


def test_every_configuration_is_a_valid_engine_config(bench):
    from kvlab.engine_config import EngineConfig

    args = bench.parse_args([])
    for config in bench.configurations(all_subsets=True):
        engine = EngineConfig(model="random:llama-tiny", **bench.engine_args(config, args))
        assert engine.enable_prefix_caching == ("prefix" in config)
        assert engine.quant == ("int4" if "int4" in config else "fp32")
        assert (engine.policy, engine.policy_args.get("compression_ratio")) == \
            (("snapkv", 0.5) if "snapkv" in config else ("full", None))
        draft = ("ngram", 4) if "ngram" in config else (None, None)
        assert (engine.draft, engine.draft_args.get("num_tokens")) == draft


@pytest.mark.parametrize("gain, singles, word", [
    (2.9, [2.0, 1.5], "multiply"),              # 0.97 of the product 3.0
    (4.0, [2.0, 1.5], "more than multiply"),    # 1.33 of the product
    (2.1, [2.0, 1.5], "overlap"),               # within 10% of the larger single
    (2.5, [2.0, 1.5], "partly"),                # between the larger single and the product
    (1.6, [2.0, 1.5], "interfere (below the larger single)"),
    (2.0, [2.0, 1.02], "multiply = overlap (the other gains ~1x)"),
    (1.2, [1.5, 0.8], "multiply"),             # a slowdown multiplies the other gain
    (1.0, [1.5, 0.8], "interfere (below the larger single)"),
    (1.8, [1.0, 1.0], "more than multiply"),    # neither alone gains, together they do
])
def test_verdict_words(bench, gain, singles, word):
    of_product, said = bench.verdict(gain, singles)
    assert said == word and of_product == pytest.approx(gain / (singles[0] * singles[1]))


def test_verdicts_name_each_combination_and_the_ceiling(bench):
    def row(techniques, seqs, tok_s, max_seqs=4, pool=1.0):
        return {"config": bench.label(techniques), "techniques": techniques, "mean_seqs_x_full": seqs,
                "tok_s_x_full": tok_s, "max_concurrent_seqs": max_seqs, "num_requests": 8, "pool_use_peak": pool}

    rows = [row((), 1.0, 1.0), row(("prefix",), 2.0, 1.5, max_seqs=8), row(("int4",), 3.0, 0.8, pool=0.5),
            row(("ngram",), 1.0, 1.4, max_seqs=8), row(("prefix", "int4"), 2.2, 1.2),
            row(("prefix", "ngram"), 2.0, 2.1)]
    out = {(v["config"], v["metric"]): v for v in bench.verdicts(rows)}
    assert set(out) == {(c, m) for c in ("prefix + int4", "prefix + ngram") for m in ("mean seqs", "tok/s")}
    assert out["prefix + int4", "mean seqs"]["verdict"] == "interfere (below the larger single)"
    assert out["prefix + int4", "tok/s"]["verdict"] == "multiply"
    assert out["prefix + ngram", "tok/s"]["verdict"] == "multiply"
    assert out["prefix + int4", "mean seqs"]["ceiling"] == ("prefix alone already runs all 8 requests at once; int4 "
                                                             "alone fills at most 50% of the pool (memory no longer "
                                                             "limits it)")
    assert out["prefix + ngram", "mean seqs"]["ceiling"] == "prefix alone already runs all 8 requests at once"
    assert out["prefix + int4", "tok/s"]["ceiling"] == ""

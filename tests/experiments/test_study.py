"""Searches with hydra-optuna-sweeper: the study objectives (kvlab.study.study), an objective no task produces
refused before any job starts, and the budget search / multi-objective study end to end on a tiny model."""

from __future__ import annotations

import subprocess

import pandas as pd
import pytest
import yaml
from exp_helpers import kvlab_cmd, needs_data, run_env

from kvlab.study.analysis import largest_ratio_kept, load_runs
from kvlab.study.study import RATIO_KEPT, Outcome, Study, check_objectives

TINY = ["model=random-llama-tiny", "task.num_prompts=2", "task.prompt_length=96", "task.max_new_tokens=4",
        "engine.kv_cache_memory=2MiB", "logger=none", "progress=false"]


def optuna_installed() -> bool:
    try:
        import hydra_plugins.hydra_optuna_sweeper  # noqa: F401
    except ImportError:
        return False
    return True


needs_optuna = pytest.mark.skipif(not optuna_installed(),
                                  reason="hydra-optuna-sweeper not installed (pip install -e '.[sweeps]')")


def test_ratio_kept_ranks_every_kept_ratio_above_every_shortfall():
    study = Study([RATIO_KEPT], quality="q", keep=0.9, reference=1.0)
    assert study.ratio_kept(0.95, 0.7) == 0.7 and study.ratio_kept(0.9, 0.8) == 0.8
    assert study.ratio_kept(0.8, 0.9) < 0 < study.ratio_kept(1.0, 0.05)
    assert study.ratio_kept(0.85, 0.9) > study.ratio_kept(0.5, 0.9)  # closer to the target: higher
    ppl = Study([RATIO_KEPT], quality="perplexity/ppl", keep=0.9, reference=20.0, higher_is_better=False)
    assert ppl.ratio_kept(22.0, 0.5) == 0.5 and ppl.ratio_kept(23.0, 0.5) < 0  # 20 / 0.9 = 22.2 allowed


def test_study_values_and_outcome():
    study = Study(["agreement/top1_match", "workload/kv_bytes_mean"])
    values = study.values({"policy": {"name": "snapkv", "compression_ratio": 0.5}},
                          {"agreement/top1_match": 0.75, "workload/kv_bytes_mean": 1024})
    assert values == [0.75, 1024.0]
    out = Outcome("finished", None, values)
    assert list(out) == values and float(out) == 0.75 and out.get("status") == "finished"
    with pytest.raises(TypeError, match="no objective value"):
        float(Outcome("failed", "boom"))
    with pytest.raises(KeyError, match="produced no"):
        study.values({}, {"agreement/top1_match": 1.0})
    full = Study([RATIO_KEPT], quality="q", reference=1.0).values({"policy": {"name": "full"}}, {"q": 1.0})
    assert full == [0.0]  # the full cache removes nothing


def test_check_objectives_knows_what_each_task_produces():
    agreement = {"_target_": "kvlab.study.tasks.agreement.Agreement"}
    replay = {"_target_": "kvlab.study.workloads.synthetic.SharedPrefix"}
    ppl = {"_target_": "kvlab.study.tasks.perplexity.Perplexity"}
    check_objectives({"task": agreement, "workload": replay,
                      "study": {"objectives": ["agreement/top1_match", "workload/kv_bytes_mean", "run/elapsed_s"]}})
    check_objectives({"task": ppl, "workload": None, "study": {"objectives": ["perplexity/ppl@512"]}})
    with pytest.raises(ValueError, match="'ruler/score' is not a metric of task kvlab.study.tasks.agreement.Agreement"):
        check_objectives({"task": agreement, "workload": replay, "study": {"objectives": ["ruler/score"]}})
    with pytest.raises(ValueError, match="'workload/tokens_per_s' is not a metric"):
        check_objectives({"task": agreement, "workload": None, "study": {"objectives": ["workload/tokens_per_s"]}})
    with pytest.raises(ValueError, match="study/ratio_kept needs study.quality"):
        check_objectives({"task": agreement, "study": {"objectives": [RATIO_KEPT]}})


def test_replay_metrics_cover_what_the_engine_reports(tiny_llm):
    """A workload's declared METRICS (what study objectives are checked against) match real llm.stats()."""
    import fnmatch

    from kvlab import LLM
    from kvlab.study.workloads.replay import Request, replay, replay_metrics

    tiny = dict(model="random:llama-tiny", kv_cache_memory="4MiB", block_size=8, seed=0)
    snap = LLM(**tiny, policy="snapkv", policy_args={"budget": 16})
    # every optional family: kept compressed turns, a packed format's residual rows, prefix caching with a tier
    # below the pool, a draft
    turns = LLM(**tiny, policy="snapkv", policy_args={"budget": 16, "window_size": 4}, reuse_compressed=True)
    packed = LLM(**tiny, quant="int4", quant_args={"group_size": 8, "residual": 8})
    tiered = LLM(**tiny, enable_prefix_caching=True, offload="host", offload_args={"memory": "1MiB"})
    drafted = LLM(**tiny, draft="ngram", draft_args={"num_tokens": 2})
    seen: set[str] = set()
    for llm in (tiny_llm, snap, turns, packed, tiered, drafted):
        result = replay(llm, [Request(list(range(1, 40)), 4), Request(list(range(5, 30)), 4)])
        undeclared = [m for m in result.metrics if not any(fnmatch.fnmatchcase(m, p) for p in replay_metrics())]
        assert not undeclared, undeclared
        seen |= set(result.metrics)
    for family in ("policy_pages_freed", "turns_kept", "residual_early_seals", "prefix_hit_tokens", "tier_*",
                   "spec_*"):  # each optional family was reported, so its declaration was checked
        assert fnmatch.filter(seen, f"workload/{family}"), family


def test_largest_ratio_kept_per_policy():
    runs = pd.DataFrame({"status": "finished", "policy.name": ["a", "a", "a", "b"],
                         "policy.compression_ratio": [0.3, 0.6, 0.8, 0.5], "q": [1.0, 0.92, 0.7, 0.5]})
    out = largest_ratio_kept(runs, "q", keep=0.9, reference=1.0).set_index("method")
    assert out.loc["a", "ratio kept"] == 0.6 and out.loc["a", "q"] == 0.92 and out.loc["a", "runs"] == 3
    assert pd.isna(out.loc["b", "ratio kept"])


@needs_optuna
def test_an_objective_no_task_produces_is_refused_before_any_job(tmp_path):
    sweep = tmp_path / "sweep"
    out = subprocess.run(kvlab_cmd("-m", "experiment=budget_search", *TINY, "study.objectives=[ruler/score]",
                                   f"hydra.sweep.dir={sweep}"), cwd=tmp_path, env=run_env(), capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "sweep refused before any job started: study objective 'ruler/score' is not a metric of task" in out.stderr
    assert "agreement/top1_match" in out.stderr  # what the task does produce
    assert not list(sweep.rglob("run.jsonl"))


@needs_data("wikitext-2-raw")
@needs_optuna
@pytest.mark.heavy
def test_budget_search_runs_end_to_end_on_a_tiny_model(tmp_path):
    sweep = tmp_path / "sweep"
    out = subprocess.run(kvlab_cmd("-m", "experiment=budget_search", *TINY, "hydra.sweeper.n_trials=4",
                                   f"hydra.sweep.dir={sweep}"), cwd=tmp_path, env=run_env(), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = load_runs(sweep)
    assert len(runs) == 4 and (runs["status"] == "finished").all()
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    answer = largest_ratio_kept(runs, "agreement/top1_match", keep=0.9, reference=1.0).set_index("method")
    # Optuna's best trial is the largest ratio among the runs that kept 90% top-1 agreement
    assert best["best_value"] == pytest.approx(answer.loc["snapkv", "ratio kept"])
    assert best["best_params"]["policy.compression_ratio"] == pytest.approx(best["best_value"])


@needs_data("wikitext-2-raw")
@needs_optuna
@pytest.mark.heavy
def test_multi_objective_study_returns_a_pareto_front(tmp_path):
    sweep = tmp_path / "sweep"
    out = subprocess.run(kvlab_cmd("-m", "experiment=pareto_study", *TINY, "hydra.sweeper.n_trials=4",
                                   "workload.num_requests=2", "workload.prefix_length=64", "workload.suffix_length=32",
                                   "workload.max_tokens=4", f"hydra.sweep.dir={sweep}"), cwd=tmp_path, env=run_env(),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = load_runs(sweep)
    assert len(runs) == 4 and (runs["status"] == "finished").all()
    front = yaml.safe_load((sweep / "optimization_results.yaml").read_text())["solutions"]
    measured = {(float(r["agreement/top1_match"]), float(r["workload/kv_bytes_mean"])) for _, r in runs.iterrows()}
    assert front and all(tuple(s["values"]) in measured for s in front)

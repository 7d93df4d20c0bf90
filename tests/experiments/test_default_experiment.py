"""The default experiment (`make run` / `kvlab-run`) on SmolLM2-135M, end to end (heavy: ~1 minute)."""

from __future__ import annotations

import subprocess

import pytest
from exp_helpers import kvlab_cmd, needs_data, run_env

from kvlab.study.analysis import load_runs


@pytest.mark.heavy
@pytest.mark.model
@needs_data("wikitext-2-raw")
@needs_data("azure-llm-trace-2023")
def test_default_experiment_prints_quality_and_throughput(tmp_path):
    out = subprocess.run(kvlab_cmd("progress=false", f"hydra.run.dir={tmp_path / 'run'}"), cwd=tmp_path,
                         env=run_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "perplexity/ppl@256" in out.stdout and "workload/tokens_per_s" in out.stdout
    [run] = load_runs(tmp_path / "run").to_dict("records")
    assert run["status"] == "finished" and run["model.name"] == "smollm2-135m"
    assert 5 < run["perplexity/ppl"] < 100  # SmolLM2-135M on WikiText-2 at 256 tokens of context: ~21
    assert run["workload/num_requests"] == 16 and run["workload/tokens_per_s"] > 0


@pytest.mark.heavy
@pytest.mark.model
@needs_data("paul-graham-essays")
def test_niah_on_smollm2_finds_some_needles(tmp_path):
    out = subprocess.run(kvlab_cmd("task=niah", "workload=none", "logger=none", "progress=false",
                                   "task.context_lengths=[256]", "task.depths=[0.0,0.5,1.0]",
                                   f"hydra.run.dir={tmp_path / 'run'}"),
                         cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    [run] = load_runs(tmp_path / "run").to_dict("records")
    # the CLI's numbers are those of the same task run directly on a full-cache engine (same prompts, greedy)
    from exp_helpers import DATA

    from kvlab import LLM
    from kvlab.study.tasks.base import RunContext
    from kvlab.study.tasks.niah import NeedleInAHaystack

    task = NeedleInAHaystack(context_lengths=[256], depths=[0.0, 0.5, 1.0])
    direct = task.run(LLM("smollm2-135m"), RunContext(data_dir=DATA, seed=0, progress=False)).metrics
    assert set(direct) == {"niah/accuracy", "niah/needle/accuracy", "niah/passkey/accuracy", "niah/multikey/accuracy"}
    assert {k: run[k] for k in direct} == direct
    assert run["niah/accuracy"] > 0  # some needles found

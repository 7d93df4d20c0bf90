"""Multirun end to end: the smoke sweep, skipping finished jobs, failed jobs, the joblib launcher."""

from __future__ import annotations

import itertools
import subprocess

from exp_helpers import kvlab_cmd, needs_data, run_env

from kvlab.analysis import load_runs

TINY = ["model=random-llama-tiny", "task=agreement", "workload=none", "task.num_prompts=2",
        "task.prompt_length=32", "task.max_new_tokens=4", "engine.kv_cache_memory=2MiB", "progress=false"]


def kvlab_run(cwd, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run(kvlab_cmd(*args), cwd=cwd, env=run_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@needs_data("wikitext-2-raw")
def test_smoke_sweep_is_read_back_and_a_rerun_skips_it(tmp_path):
    sweep = tmp_path / "sweep"
    first = kvlab_run(tmp_path, "-m", "experiment=smoke", f"hydra.sweep.dir={sweep}", "progress=false")
    assert first.stdout.count("agreement/greedy_match") == 4  # each job printed its results table
    runs = load_runs(sweep)
    assert len(runs) == 4 and (runs["status"] == "finished").all()
    combos = set(zip(runs["engine.block_size"], runs["engine.allocator"]))
    assert combos == set(itertools.product([8, 16], ["paged", "contiguous"]))
    assert (runs["agreement/greedy_match"] == 1.0).all() and (runs["agreement/kl"] == 0.0).all()
    assert runs["workload/tokens_per_s"].gt(0).all() and runs["meta.git_commit"].notna().all()
    assert (runs["engine.allocator_args.reserve"].dropna() == "max_model_len").all()  # defaults filled in
    assert len(list(sweep.rglob("offline-run-*"))) == 4  # and each job has its W&B offline run

    again = kvlab_run(tmp_path, "-m", "experiment=smoke", f"hydra.sweep.dir={sweep}", "progress=false")
    assert again.stdout.count("skipped ") == 4 and "agreement/greedy_match" not in again.stdout
    assert len(load_runs(sweep)) == 4


@needs_data("wikitext-2-raw")
def test_a_failed_job_is_recorded_and_the_parallel_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    # joblib launcher, 2 processes; prompt_length 600 does not fit random:llama-tiny's 512 positions:
    # that job fails and is recorded as failed, the other one finishes
    kvlab_run(tmp_path, "-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2", *TINY, "logger=none",
              "task.prompt_length=600,32", f"hydra.sweep.dir={sweep}")
    runs = load_runs(sweep).set_index("task.prompt_length")
    assert runs.loc[600, "status"] == "failed" and "512 positions" in runs.loc[600, "error"]
    assert runs.loc[32, "status"] == "finished" and runs.loc[32, "agreement/greedy_match"] == 1.0
    assert len(load_runs(sweep, include_failed=False)) == 1

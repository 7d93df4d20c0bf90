"""Multirun end to end: the smoke sweep, skipping finished jobs, failed jobs, fail_fast, the joblib launcher."""

from __future__ import annotations

import itertools
import subprocess

import pytest
from exp_helpers import kvlab_cmd, needs_data, run_env

from kvlab.study.analysis import load_runs
from kvlab.study.sweep_ledger import read_ledger

pytestmark = pytest.mark.process  # another Python process: in the default suite, out of `make test-unit`

TINY = ["model=random-llama-tiny", "task=agreement", "workload=none", "task.num_prompts=2",
        "task.prompt_length=32", "task.max_new_tokens=4", "engine.kv_cache_memory=2MiB", "progress=false"]


PARALLEL = ["hydra/launcher=parallel", "hydra.launcher.n_jobs=2"]


def kvlab_run(cwd, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """`python -m kvlab <args>`; asserts exit status 0 if `ok`, else non-zero."""
    out = subprocess.run(kvlab_cmd(*args), cwd=cwd, env=run_env(), capture_output=True, text=True, timeout=300)
    assert (out.returncode == 0) == ok, f"exit status {out.returncode}\n" + out.stdout[-3000:] + out.stderr[-3000:]
    return out


def summary_lines(out: subprocess.CompletedProcess) -> list[str]:
    """The end-of-sweep summary: its head line and the lines below it."""
    lines = out.stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("sweep ") and " jobs: " in line)
    return lines[start:]


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
    assert (runs["engine.allocator_args.reserve"].dropna() == "request").all()  # defaults filled in (issue 21 item 14: contiguous reserves the request by default)
    assert len(list(sweep.rglob("offline-run-*"))) == 4  # and each job has its W&B offline run

    assert summary_lines(first) == [f"sweep {sweep}: 4 jobs: 4 finished, 0 failed, 0 skipped"]

    again = kvlab_run(tmp_path, "-m", "experiment=smoke", f"hydra.sweep.dir={sweep}", "progress=false")
    assert again.stdout.count("skipped ") == 4 and "agreement/greedy_match" not in again.stdout
    assert summary_lines(again) == [f"sweep {sweep}: 4 jobs: 0 finished, 0 failed, 4 skipped"]
    assert len(load_runs(sweep)) == 4


@needs_data("wikitext-2-raw")
def test_a_failed_job_is_recorded_and_the_parallel_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    # joblib launcher, 2 processes; prompt_length 600 does not fit random:llama-tiny's 512 positions:
    # that job fails and is recorded as failed, the other one finishes
    # that job fails and is recorded as failed, the other one finishes; the sweep reports it and exits 1
    out = kvlab_run(tmp_path, "-m", *PARALLEL, *TINY, "logger=none", "task.prompt_length=600,32",
                    f"hydra.sweep.dir={sweep}", ok=False)
    runs = load_runs(sweep).set_index("task.prompt_length")
    assert runs.loc[600, "status"] == "failed" and "512 positions" in runs.loc[600, "error"]
    assert runs.loc[32, "status"] == "finished" and runs.loc[32, "agreement/greedy_match"] == 1.0
    assert len(load_runs(sweep, include_failed=False)) == 1
    head, failure = summary_lines(out)
    assert head == f"sweep {sweep}: 2 jobs: 1 finished, 1 failed, 0 skipped"
    assert failure.startswith("  failed ") and "task.prompt_length=600" in failure
    assert failure.endswith("ValueError: prompt_length + max_new_tokens = 604 tokens exceeds the model's 512 positions")
    assert "sweep failed: 1 of 2 jobs failed" in out.stderr


@needs_data("wikitext-2-raw")
@pytest.mark.parametrize("fail_fast", [False, True])
def test_basic_launcher_reports_a_failed_job_and_fail_fast_stops_the_sweep(tmp_path, fail_fast):
    sweep = tmp_path / "sweep"
    # one job after the other in this process; the first fails at run time (600 > 512 positions)
    out = kvlab_run(tmp_path, "-m", *TINY, "logger=none", "task.prompt_length=600,32", f"fail_fast={fail_fast}",
                    f"hydra.sweep.dir={sweep}", ok=False)
    lines = summary_lines(out)
    runs = load_runs(sweep)
    if fail_fast:
        assert lines[0] == f"sweep {sweep}: 1 jobs: 0 finished, 1 failed, 0 skipped"
        assert lines[2] == "  sweep stopped at the first failure (fail_fast=true); later jobs did not run"
        assert list(runs["task.prompt_length"]) == [600]  # the second job never started
        assert "agreement/greedy_match" not in out.stdout
    else:
        assert lines[0] == f"sweep {sweep}: 2 jobs: 1 finished, 1 failed, 0 skipped" and len(lines) == 2
        assert sorted(runs["task.prompt_length"]) == [32, 600]
    assert lines[1].startswith("  failed ") and "task.prompt_length=600" in lines[1] and "512 positions" in lines[1]
    assert "Traceback" in out.stderr + out.stdout  # the job's own error is logged in full, once
    assert "sweep failed: 1 of" in out.stderr


@needs_data("wikitext-2-raw")
def test_fail_fast_with_joblib_starts_no_job_after_a_failure(tmp_path):
    sweep = tmp_path / "sweep"
    # 2 workers, 3 jobs: prompt_length=0 fails at config validation, before the others have loaded torch;
    # the job running beside it finishes, the third starts after the failure is recorded and does not run
    out = kvlab_run(tmp_path, "-m", *PARALLEL, *TINY, "logger=none", "task.prompt_length=0,32,16", "fail_fast=true",
                    f"hydra.sweep.dir={sweep}", ok=False)
    head, failure = summary_lines(out)
    assert head == f"sweep {sweep}: 3 jobs: 1 finished, 1 failed, 0 skipped, 1 not run (fail_fast)"
    assert "task.prompt_length=0" in failure and "config error: task: Agreement rejects its parameters" in failure
    outcomes = {row["job"].split("task.prompt_length=")[1].split(",")[0]: row["status"] for row in read_ledger(sweep)}
    assert outcomes == {"0": "failed", "32": "finished", "16": "not run"}
    assert sorted(load_runs(sweep)["task.prompt_length"]) == [0, 32]  # no record: the third job did not run

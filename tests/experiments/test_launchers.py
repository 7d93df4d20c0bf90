"""Cluster launchers for real: submitit_local runs the SLURM launcher's code path on this machine; slurm
without sbatch, an unreachable Ray address: refused before any job starts; sweep progress lines."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from exp_helpers import kvlab_cmd, needs_data, run_env

from kvlab.study.analysis import load_runs
from kvlab.study.sweep_ledger import read_ledger

pytestmark = pytest.mark.process  # another Python process: in the default suite, out of `make test-unit`

TINY = ["model=random-llama-tiny", "task=agreement", "workload=none", "task.num_prompts=2",
        "task.prompt_length=32", "task.max_new_tokens=4", "engine.kv_cache_memory=2MiB", "progress=false",
        "logger=none"]


def kvlab_run(cwd, *args: str, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(kvlab_cmd(*args), cwd=cwd, env=env or run_env(), capture_output=True, text=True,
                          timeout=timeout)


def summary_head(out: subprocess.CompletedProcess) -> str:
    return [line for line in out.stdout.splitlines() if line.startswith("sweep ") and " jobs: " in line][-1]


@needs_data("wikitext-2-raw")
def test_submitit_local_runs_the_sweep_into_the_same_folder_and_records(tmp_path):
    sweep = tmp_path / "sweep"
    out = kvlab_run(tmp_path, "-m", "hydra/launcher=submitit_local", *TINY, "engine.block_size=8,16",
                    "sweep_progress_s=1", f"hydra.sweep.dir={sweep}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = load_runs(sweep)
    assert len(runs) == 2 and (runs["status"] == "finished").all()
    assert sorted(runs["engine.block_size"]) == [8, 16] and (runs["agreement/greedy_match"] == 1.0).all()
    # each job ran in a process of its own, submitted by submitit (its pickles and logs under .submitit/)
    assert len({p for p in runs["meta.pid"]}) == 2 and os.getpid() not in set(runs["meta.pid"])
    assert list(sweep.glob(".submitit/*/*_submitted.pkl"))
    # the job folders are the basic launcher's (sweep.dir/<override dirname>), the ledger has both jobs
    assert all(str(p).startswith(str(sweep)) and "engine.block_size=" in p for p in runs["run_dir"])
    assert sorted(row["status"] for row in read_ledger(sweep)) == ["finished", "finished"]
    assert summary_head(out) == f"sweep {sweep}: 2 jobs: 2 finished, 0 failed, 0 skipped"
    assert f"sweep {sweep} progress: 2 finished, 0 failed, 0 skipped; 0 running" in out.stdout


@needs_data("wikitext-2-raw")
@pytest.mark.heavy
def test_submitit_local_four_jobs_then_a_rerun_skips_them(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=submitit_local", *TINY, "engine.block_size=8,16",
            "engine.allocator=paged,contiguous", f"hydra.sweep.dir={sweep}"]
    first = kvlab_run(tmp_path, *args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert len(load_runs(sweep)) == 4 and (load_runs(sweep)["status"] == "finished").all()
    again = kvlab_run(tmp_path, *args, env=ray_env())
    assert summary_head(again) == f"sweep {sweep}: 4 jobs: 0 finished, 0 failed, 4 skipped"


def test_slurm_without_sbatch_is_refused_before_any_job(tmp_path):
    sweep = tmp_path / "sweep"
    env = run_env(PATH=os.path.dirname(sys.executable) + ":/usr/bin:/bin")  # no sbatch on this PATH
    assert subprocess.run(["which", "sbatch"], env=env, capture_output=True).returncode != 0
    out = kvlab_run(tmp_path, "-m", "hydra/launcher=slurm", *TINY, "engine.block_size=8,16",
                    f"hydra.sweep.dir={sweep}", env=env, timeout=120)
    assert out.returncode == 1
    assert "sweep refused before any job started: hydra/launcher=slurm submits its jobs with `sbatch`" in out.stderr
    assert "hydra/launcher=submitit_local" in out.stderr
    assert not list(sweep.rglob("run.jsonl")) and not (sweep / ".submitit").exists()


@pytest.mark.parametrize("address, says", [
    ("127.0.0.1:9", "does not answer"),               # the discard port: nothing listens
    ("ray://127.0.0.1:9", "does not answer"),
    ("nonsense", "is not host:port, ray://host:port or auto"),
])
def test_an_unreachable_ray_address_is_refused_before_any_job(tmp_path, address, says):
    sweep = tmp_path / "sweep"
    out = kvlab_run(tmp_path, "-m", "hydra/launcher=ray_cluster", f"hydra.launcher.ray.init.address='{address}'",
                    *TINY, "engine.block_size=8,16", f"hydra.sweep.dir={sweep}", timeout=120)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "sweep refused before any job started" in out.stderr and says in out.stderr
    assert not list(sweep.rglob("run.jsonl"))




def needs_ray():
    try:
        import hydra_plugins.hydra_ray_launcher  # noqa: F401
        import ray  # noqa: F401
    except ImportError:
        return pytest.mark.skip(reason="hydra-ray-launcher / ray not installed (pip install -e '.[sweeps]')")
    return pytest.mark.heavy


RAY = ["hydra/launcher=ray_cluster", "hydra.launcher.ray.init.num_cpus=2", "hydra.launcher.ray.remote.num_cpus=1",
       "sweep_progress_s=1"]


def ray_env() -> dict:
    # Ray's own memory monitor kills workers once the whole machine passes 95% memory, whoever uses it; on a
    # shared test machine that kills this test's jobs for other processes' memory: off (the kernel's OOM
    # killer still acts). The test kills a worker itself.
    return run_env(RAY_memory_monitor_refresh_ms="0")


@needs_data("wikitext-2-raw")
@needs_ray()
def test_ray_local_cluster_runs_four_jobs_into_the_sweep_folder(tmp_path):
    sweep = tmp_path / "sweep"
    out = kvlab_run(tmp_path, "-m", *RAY, *TINY, "engine.block_size=8,16", "engine.allocator=paged,contiguous",
                    f"hydra.sweep.dir={sweep}", env=ray_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = load_runs(sweep)
    assert len(runs) == 4 and (runs["status"] == "finished").all()
    assert set(zip(runs["engine.block_size"], runs["engine.allocator"])) == {
        (8, "paged"), (8, "contiguous"), (16, "paged"), (16, "contiguous")}
    assert os.getpid() not in set(runs["meta.pid"]) and len(set(runs["meta.pid"])) == 4  # max_calls=1: a worker each
    assert summary_head(out) == f"sweep {sweep}: 4 jobs: 4 finished, 0 failed, 0 skipped"
    assert "progress: 4 finished, 0 failed, 0 skipped; 0 running" in out.stdout


@needs_data("wikitext-2-raw")
@needs_ray()
def test_ray_killed_worker_is_recorded_failed_and_a_rerun_completes_only_it(tmp_path):
    import json
    import signal
    import time

    sweep = tmp_path / "sweep"
    # three jobs; num_prompts=48 makes one long enough to be killed while it runs
    args = ["-m", *RAY, *TINY, "task.num_prompts=2,3,48", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(kvlab_cmd(*args), cwd=tmp_path, env=ray_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    victim = None
    deadline = time.time() + 900  # a loaded machine can take minutes to start Ray workers
    while victim is None and time.time() < deadline and proc.poll() is None:
        for record in sweep.rglob("run.jsonl"):
            start = json.loads(record.read_text().splitlines()[0])
            if start["config"]["task"]["num_prompts"] == 48:
                victim = record
                os.kill(start["meta"]["pid"], signal.SIGKILL)  # the Ray worker running that job
        time.sleep(0.1)
    stdout, stderr = proc.communicate(timeout=900)
    assert victim is not None, "the long job never started\n" + stdout[-2000:] + stderr[-2000:]
    assert proc.returncode == 1, stdout[-3000:] + stderr[-3000:]
    runs = load_runs(sweep).set_index("task.num_prompts")
    assert runs.loc[48, "status"] == "failed" and "Ray worker died" in runs.loc[48, "error"]
    assert (runs.loc[[2, 3], "status"] == "finished").all()
    head = summary_head(type("Out", (), {"stdout": stdout})())
    assert head == f"sweep {sweep}: 3 jobs: 2 finished, 1 failed, 0 skipped"
    assert "failed " in stdout and "task.num_prompts=48" in stdout and "Ray worker died" in stdout
    finished = {n: runs.loc[n, "meta.started_at"] for n in (2, 3)}

    again = kvlab_run(tmp_path, *args, env=ray_env())
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert summary_head(again) == f"sweep {sweep}: 3 jobs: 1 finished, 0 failed, 2 skipped"
    runs = load_runs(sweep).set_index("task.num_prompts")
    assert len(runs) == 3 and (runs["status"] == "finished").all()
    assert {n: runs.loc[n, "meta.started_at"] for n in (2, 3)} == finished  # not repeated


def test_a_dead_workers_half_written_record_gets_a_failed_finish(tmp_path):
    from hydra_plugins.kvlab_launchers.ray_cluster import mark_record_failed

    record = tmp_path / "run.jsonl"
    record.write_text('{"event": "start", "name": "j", "config": {"policy": {"name": "full"}}, "meta": {}}\n{"event": "met')
    mark_record_failed(tmp_path, "Ray worker died: WorkerCrashedError")
    runs = load_runs(tmp_path)
    assert list(runs["status"]) == ["failed"] and runs["error"][0] == "Ray worker died: WorkerCrashedError"
    mark_record_failed(tmp_path, "again")  # finished records are left alone
    assert load_runs(tmp_path)["error"][0] == "Ray worker died: WorkerCrashedError"

"""The leaderboard study end to end on a tiny model: the experiment's sweep, read back into one row per
(model, policy, ratio) with the quality, KV-bytes and batch-16 throughput columns."""

from __future__ import annotations

import subprocess

from exp_helpers import kvlab_cmd, needs_data, run_env

from kvlab.study.analysis import leaderboard, load_runs


@needs_data("wikitext-2-raw")
def test_the_leaderboard_sweep_becomes_one_row_per_policy_and_ratio(tmp_path):
    sweep = tmp_path / "lb"
    args = ["-m", "experiment=leaderboard", f"hydra.sweep.dir={sweep}", "model=random-llama-tiny",
            "task.num_prompts=2", "task.prompt_length=160", "task.max_new_tokens=4", "workload.num_requests=4",
            "workload.max_context=160", "workload.max_output=4", "engine.kv_cache_memory=4MiB", "progress=false",
            "logger=none", "policy=full,snapkv", "policy.compression_ratio=0.5,0.75"]
    out = subprocess.run(kvlab_cmd(*args), cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    board = leaderboard(load_runs(sweep))  # what kvlab-report writes
    rows = board.to_dict("records")
    assert [(r["method"], r["compression ratio"]) for r in rows] == [("full", 0.0), ("snapkv", 0.5), ("snapkv", 0.75)]
    full, half, quarter = rows
    assert full["greedy match"] == 1.0 and full["KL to full cache"] == 0.0
    held = "KV MiB held (mean)"
    assert quarter[held] < half[held] < full[held]
    assert all(r["tokens/s"] > 0 for r in rows)

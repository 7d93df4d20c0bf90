"""kvlab.study.analysis: flattening, filtering and the standard plots on a synthetic table of runs."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from kvlab.study.analysis import flatten, load_runs, plot_quality_vs_budget, plot_throughput_vs_batch, plot_waste_breakdown  # noqa: E402


def synthetic_runs() -> pd.DataFrame:
    rows = []
    for policy in ("snapkv", "h2o"):
        for budget in (128, 256, 512):
            for allocator in ("paged", "contiguous"):
                rows.append({"status": "finished", "policy.name": policy, "policy.budget": budget,
                             "engine.allocator": allocator, "engine.block_size": 16,
                             "agreement/kl": 1.0 / budget, "workload/max_concurrent_seqs": budget // 64,
                             "workload/tokens_per_s": float(budget), "workload/waste_internal": 0.01,
                             "workload/waste_reservation": 0.3 if allocator == "contiguous" else 0.0,
                             "workload/waste_external": 0.1 if allocator == "contiguous" else 0.0})
    rows.append({**rows[0], "status": "failed", "agreement/kl": 99.0})
    return pd.DataFrame(rows)


def test_flatten():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": {}, "e": None}) == {"a.b": 1, "a.c": (1, 2), "d": None, "e": None}
    assert flatten({"x": 1}, "meta.") == {"meta.x": 1}


def test_standard_plots_draw_finished_runs():
    runs = synthetic_runs()
    fig = plot_quality_vs_budget(runs)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert set(lines) == {"snapkv", "h2o"}
    assert list(lines["h2o"].get_ydata()) == pytest.approx([1 / 128, 1 / 256, 1 / 512])  # the failed run is left out
    assert len(plot_throughput_vs_batch(runs).axes[0].get_lines()) == 2
    bars = plot_waste_breakdown(runs, by=["engine.allocator"]).axes[0].patches
    assert len(bars) == 2 * 3  # two allocators x three waste parts


def test_missing_column_is_named():
    with pytest.raises(KeyError, match="policy.budget"):
        plot_quality_vs_budget(synthetic_runs().drop(columns=["policy.budget"]))


def test_load_runs_rejects_what_it_cannot_read(tmp_path):
    assert load_runs(tmp_path).empty
    with pytest.raises(FileNotFoundError, match="neither a folder nor a W&B project"):
        load_runs(tmp_path / "nope")


def test_load_runs_reads_the_local_records_of_a_sweep_folder(tmp_path):
    from kvlab.study.loggers import LocalLogger

    for job, status in (("block_size=8", "finished"), ("block_size=16", "failed")):
        log = LocalLogger()
        log.start(tmp_path / job, f"study/{job}", {"engine": {"block_size": int(job.split("=")[1])}},
                  {"git_commit": "abc"})
        log.log_metrics({"agreement/kl": 0.5})
        log.finish(status, {"run/elapsed_s": 1.0}, error="boom" if status == "failed" else None)
    (tmp_path / "block_size=8" / "wandb" / "offline-run-x").mkdir(parents=True)  # W&B files are not read
    runs = load_runs(tmp_path).set_index("engine.block_size")
    assert list(runs.index) == [16, 8] and set(runs["source"]) == {"local"}
    assert runs.loc[8, "status"] == "finished" and runs.loc[16, "error"] == "boom"
    assert runs.loc[8, "agreement/kl"] == 0.5 and runs.loc[8, "meta.git_commit"] == "abc"
    assert list(load_runs(tmp_path, include_failed=False).index) == [0]


def test_load_runs_from_a_wandb_project_uses_the_public_api(monkeypatch):
    import wandb

    class Run:
        name, url, state = "study/job0", "https://wandb.ai/e/p/runs/1", "finished"
        config = {"engine": {"block_size": 8}, "meta": {"seed": 0}, "_wandb": {}}
        summary_metrics = {"agreement/kl": 0.25, "status": "finished", "_runtime": 3, "tables/x": {}}

    class Api:
        def runs(self, project):
            assert project == "e/p"
            return [Run()]

    monkeypatch.setattr(wandb, "Api", Api)
    [row] = load_runs("e/p").to_dict("records")
    assert row["source"] == "wandb" and row["status"] == "finished" and row["engine.block_size"] == 8
    assert row["agreement/kl"] == 0.25 and row["meta.seed"] == 0 and "_runtime" not in row and "tables/x" not in row

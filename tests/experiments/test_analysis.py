"""kvlab.analysis: flattening, filtering and the standard plots on a synthetic table of runs."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from kvlab.analysis import flatten, load_runs, plot_quality_vs_budget, plot_throughput_vs_batch, plot_waste_breakdown  # noqa: E402


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

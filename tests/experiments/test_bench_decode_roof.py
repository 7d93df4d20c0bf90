"""The decode-roof benchmark (experiments/bench_decode_roof.py) runs kvlab and HF `generate` on a tiny model."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from exp_helpers import REPO

sys.path.insert(0, str(REPO / "experiments"))


def test_every_cell_gets_bytes_per_step_over_its_time_as_a_fraction_of_the_roof(tmp_path):
    from bench_decode_roof import main, weight_bytes
    from kvlab.models import load_model

    out = tmp_path / "roof"
    roofs, rows = main(["--model", "random:llama-tiny", "--batches", "1", "2", "--contexts", "16", "40",
                       "--dtypes", "float32", "--quants", "auto", "--steps", "2", "--repeats", "2", "--warmup", "1",
                       "--roof-mib", "8", "--out", str(out)])
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["meta"]["roofs"] == roofs
    assert len(roofs) == 8 and [r["roof_gb_s"] for r in rows] == [  # one before every cell; kvlab's 2 layouts share it
        roofs[i // 3 * 2 + (i % 3 == 2)]["sum_gb_s"] for i in range(len(rows))]
    weights = weight_bytes(load_model("random:llama-tiny").model)
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    cells = {(r["system"], r["layout"], r["batch"], r["context"]): r for r in rows}
    assert set(cells) == {(s, l, b, c) for s, l in [("kvlab", "none"), ("kvlab", "auto"), ("hf-generate", "none")]
                          for b in (1, 2) for c in (16, 40)}
    for (system, layout, batch, context), r in cells.items():
        assert len(r["steps_s"]) == 2 and r["step_s"] == pytest.approx(statistics.median(r["steps_s"]))
        # mean cached tokens a timed step reads: context + 1 + warm-up + its index among the decode steps; kvlab's
        # blocks of 2 steps alternate layouts (none: blocks 0 and 2, auto: 1 and 3), HF's are blocks 0 and 1
        first = {"none": [0, 4], "auto": [2, 6]}[layout] if system == "kvlab" else [0, 2]
        cached = context + 1 + 1 + statistics.mean(first) + 0.5
        assert r["kv_bytes"] == pytest.approx(batch * cached * per_token)
        assert r["weight_mb"] == pytest.approx(weights / 1e6)
        assert r["roof_fraction"] == pytest.approx((weights + r["kv_bytes"]) / r["step_s"] / (r["roof_gb_s"] * 1e9))
        assert r["tok_s"] == pytest.approx(batch / r["step_s"])
        assert r["vs_hf"] == pytest.approx(cells["hf-generate", "none", batch, context]["step_s"] / r["step_s"])
    md = out.with_suffix(".md").read_text()
    assert f"**{statistics.median(r['sum_gb_s'] for r in roofs):.1f} GB/s**" in md
    assert md.count("| kvlab |") == 8 and md.count("| hf-generate |") == 4


def test_the_linear_layout_benchmark_times_every_group_both_ways(tmp_path):
    from bench_linear_layout import main

    out = tmp_path / "lin"
    rows = main(["--model", "random:llama-tiny", "--batches", "1", "3", "--dtypes", "float32", "--rounds", "3",
                 "--calls", "2", "--out", str(out)])
    assert [(r["group"], r["shape"], r["batch"]) for r in rows] == [
        ("q/k/v", "128 x 64", 1), ("q/k/v", "128 x 64", 3), ("gate/up", "256 x 64", 1), ("gate/up", "256 x 64", 3)]
    for r in rows:
        assert len(r["rounds_s"]["fused"]) == 3 and r["fused_us"] == pytest.approx(
            1e6 * statistics.median(r["rounds_s"]["fused"]))
        assert r["speedup"] == pytest.approx(r["separate_us"] / r["fused_us"])
        weight = int(r["shape"].split(" x ")[0]) * 64 * 4
        assert r["fused_gb_s"] == pytest.approx(weight / r["fused_us"] / 1e3)


def test_a_baseline_kernel_takes_turns_and_the_attention_time_is_read_per_step(tmp_path, monkeypatch):
    """--kernel-baseline: that revision's kernel runs the attention of every other block (and only those), each
    row quotes the step's time in the attention launcher and the K/V bytes over it."""
    import bench_decode_roof
    from kvlab.kernels.cpu import decode_attention as cpu

    if not cpu.available():
        pytest.skip("no C++ compiler: the CPU kernels fall back")
    calls = []

    def counting_kernel_at(rev):
        real = cpu._kernel()
        return lambda *a: calls.append(rev) or real(*a)

    monkeypatch.setattr(bench_decode_roof, "kernel_at", counting_kernel_at)
    out = tmp_path / "roof"
    _, rows = bench_decode_roof.main(["--model", "random:llama-tiny", "--batches", "2", "--contexts", "8", "--dtypes",
                                      "float32", "--quants", "auto", "--layouts", "auto", "--steps", "2", "--repeats",
                                      "2", "--warmup", "1", "--roof-mib", "8", "--no-hf", "--kernel-baseline", "HEAD",
                                      "--out", str(out)])
    assert cpu._kernel is not None and hasattr(cpu._kernel, "cache_info")  # its own kernel again afterwards
    assert len(calls) == 2 * 2 * 2  # 2 layers x 2 steps x the 2 baseline blocks (blocks 1 and 3)
    assert [r["kernel"] for r in rows] == ["this", "HEAD"]
    for r in rows:
        assert len(r["attn_s"]) == 2 and r["attn_ms"] == pytest.approx(1e3 * statistics.median(r["attn_s"]))
        assert 0 < r["attn_ms"] < r["step_ms"]
        assert r["attn_roof_fraction"] == pytest.approx(r["kv_bytes"] / (r["attn_ms"] / 1e3) / (r["roof_gb_s"] * 1e9))
    assert "| attention kernel |" in out.with_suffix(".md").read_text()

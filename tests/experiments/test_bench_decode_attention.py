"""The CPU decode-attention benchmark (experiments/bench_decode_attention.py) on a tiny grid, with a baseline."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from exp_helpers import REPO

sys.path.insert(0, str(REPO / "experiments"))


def test_the_kernel_the_reference_and_a_baseline_revision_are_timed_in_one_run(tmp_path):
    from bench_decode_attention import main

    from kvlab.kernels.cpu import decode_attention as cpu

    if not cpu.available():
        pytest.skip("no C++ compiler: the CPU kernels fall back")
    out = tmp_path / "da"
    main(["--batch", "2", "--context", "40", "--formats", "fp32", "int8", "--q-len", "1", "3", "--threads", "1", "2",
          "--repeats", "3", "--iters", "2", "--roof-gib", "0.01", "--baseline", "HEAD", "--out", str(out)])
    saved = json.loads(out.with_suffix(".json").read_text())
    rows = saved["rows"]
    assert [(r["threads"], r["format"], r["q_len"]) for r in rows] == [
        (t, f, n) for t in (1, 2) for f in ("fp32", "int8") for n in (1, 3)]
    assert set(saved["meta"]["roofs"]) == {"1", "2"}
    decode = {(r["threads"], r["format"]): r for r in rows if r["q_len"] == 1}
    for r in rows:
        one = decode[r["threads"], r["format"]]
        assert r["per_decode"] == pytest.approx(r["kernel_ms"] / one["kernel_ms"])
        assert r["baseline_per_decode"] == pytest.approx(r["baseline_ms"] / one["baseline_ms"])
        assert r["roof_gbs"] == saved["meta"]["roofs"][str(r["threads"])]["gbs"]
        assert len(r["kernel_s"]) == len(r["baseline_s"]) == 3
        assert r["baseline_ms"] == pytest.approx(1e3 * statistics.median(t[0] for t in r["baseline_s"]))
        assert r["baseline_speedup"] == pytest.approx(r["baseline_ms"] / r["kernel_ms"])
        assert r["max_diff"] < 1e-4
    assert hasattr(cpu._kernel, "cache_info")  # the launcher runs its own kernel again afterwards
    md = out.with_suffix(".md").read_text()
    assert "| kernel at HEAD ms | HEAD / kernel | HEAD: in decode steps |" in md and md.count("| 2 | 40 |") == 8

"""The dequantisation-cost benchmark (experiments/bench_dequant.py) runs every format on a tiny model."""

from __future__ import annotations

import json
import math
import statistics
import sys

import pytest

from exp_helpers import REPO

sys.path.insert(0, str(REPO / "experiments"))


def test_every_format_gets_a_decode_step_time_relative_to_fp32(tmp_path):
    from bench_dequant import main

    from kvlab.study.bench_io import fmt

    out = tmp_path / "dq"
    main(["--model", "random:llama-tiny", "--context", "32", "--batch", "2", "--steps", "2", "--repeats", "1",
          "--group-size", "8", "--block-size", "16", "--kv-cache-memory", "4MiB", "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["format"] for r in rows] == ["fp32", "bf16", "fp8_e4m3", "int8", "int4", "int2"]
    assert rows[0]["vs_fp32"] == 1.0 and rows[0]["extra_ms"] == 0.0
    base = rows[0]["step_ms"]
    for r in rows:  # the figures are what the timings say (their values are the machine's business)
        assert len(r["steps_s"]) == 1 and math.isfinite(r["step_ms"])
        assert r["step_ms"] == pytest.approx(1000 * statistics.median(r["steps_s"]))
        assert r["vs_fp32"] == pytest.approx(r["step_ms"] / base)
        assert r["extra_ms"] == pytest.approx(r["step_ms"] - base)
        assert r["per_token_us"] == pytest.approx(1000 * r["extra_ms"] / (2 * 32))  # batch 2 x 32 cached tokens
    md = out.with_suffix(".md").read_text()
    for r in rows:  # every row in the table, with its step time and ratio
        assert f"| {r['format']} | {fmt(r['step_ms'])} | {fmt(r['vs_fp32'])} |" in md, r

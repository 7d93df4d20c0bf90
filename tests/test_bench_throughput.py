"""Smoke test of experiments/bench_throughput.py: --help at once, and a --quick run of all three sections."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "bench_throughput.py"


def test_help_needs_no_model():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and "--concurrency-kv-memory" in out.stdout


@pytest.mark.heavy
@pytest.mark.model
def test_quick_run_writes_three_sections(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True,
                          text=True, timeout=1800, cwd=SCRIPT.parents[1])
    if proc.returncode and "needs `pip install" in proc.stderr:
        pytest.skip("smollm2-135m is not installed here")
    assert proc.returncode == 0, proc.stderr[-4000:]

    md = Path(f"{out}.md").read_text()
    for heading in ("## Micro", "## Trace", "## Concurrency", "Command: `python experiments/bench_throughput.py"):
        assert heading in md

    data = json.loads(Path(f"{out}.json").read_text())
    assert {r["system"] for r in data["micro"]} == {"hf-generate", "hf-generate-batch", "kvlab"}
    assert all(r["tok_s"] > 0 for r in data["micro"])
    trace = {r["system"]: r for r in data["trace"]}
    assert set(trace) == {"hf-generate", "hf-generate-batch", "kvlab"}
    assert all(r["tok_s"] > 0 and r["useful_tokens"] > 0 for r in trace.values())
    assert len({r["useful_tokens"] for r in trace.values()}) == 1  # every system served the same requests
    assert trace["kvlab"]["preemptions"] >= 0 and trace["kvlab"]["ttft_median_s"] > 0
    rows = {r["allocator"]: r for r in data["concurrency"]}
    assert {"paged", "contiguous"} <= set(rows)
    for row in rows.values():
        assert row["tok_s"] > 0 and row["max_concurrent_seqs"] >= 1
        assert all(0 <= row[k] <= 1 for k in ("waste_internal", "waste_reservation", "waste_external"))
    assert rows["contiguous"]["waste_internal"] > rows["paged"]["waste_internal"]  # max_model_len reservation
    assert data["ratios"]["trace_kvlab_over_best_hf"] > 0

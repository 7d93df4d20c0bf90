"""Smoke test of experiments/bench_throughput.py: --help at once, and a --quick run of all three sections."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "bench_throughput.py"


def test_help_needs_no_model():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and "--concurrency-kv-memory" in out.stdout


# --quick on 8 Azure conv rows, scale 0.25, prompts capped at 128 tokens, outputs at 8 (read from the CSV):
# prompts 94 99 128 23 23 95 128 97, outputs 8 8 8 4 4 8 8 8 -> 56 useful tokens.
QUICK_OUTPUT_TOKENS = 56
# SmolLM2 K/V in fp32: 2 * 30 layers * 3 heads * 64 * 4 B = 46,080 B per token; 15 MiB / (16 * 46,080 B) = 21 blocks.
# paged: the first three prompts take 6 + 7 + 8 = 21 blocks, so the first decode must preempt;
# contiguous: one max_model_len (256-token, 16-block) reservation at a time, the 5 free blocks an unusable hole.
CONCURRENCY_ARGS = ["--max-context", "128", "--max-model-len", "256", "--concurrency-kv-memory", "15MiB"]


@pytest.mark.heavy
@pytest.mark.model
def test_quick_run_writes_three_sections(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), *CONCURRENCY_ARGS],
                          capture_output=True, text=True, timeout=1800, cwd=SCRIPT.parents[1])
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
    assert all(r["tok_s"] > 0 and r["useful_tokens"] == QUICK_OUTPUT_TOKENS for r in trace.values())
    assert trace["kvlab"]["preemptions"] == 0 and trace["kvlab"]["ttft_median_s"] > 0  # 1 GiB holds all eight
    rows = {r["allocator"]: r for r in data["concurrency"]}
    paged, contiguous = rows["paged"], rows["contiguous"]
    assert paged["preemptions"] > 0 and paged["max_concurrent_seqs"] >= 3
    assert contiguous["preemptions"] == 0 and contiguous["max_concurrent_seqs"] == 1
    assert paged["waste_external"] == 0 and contiguous["waste_external"] > 0  # the 5-block hole
    assert contiguous["waste_internal"] > paged["waste_internal"]  # 256-token reservations, <= 136 used
    # held but unwritten slots, per step: contiguous >= 256 - 135 of 336; paged < 16 per running sequence
    assert contiguous["waste_internal"] + contiguous["waste_reservation"] >= 120 / 336 > (
        paged["waste_internal"] + paged["waste_reservation"])
    best_hf = max(r["tok_s"] for system, r in trace.items() if system != "kvlab")
    assert data["ratios"]["trace_kvlab_over_best_hf"] == pytest.approx(trace["kvlab"]["tok_s"] / best_hf)
    assert f"kvlab / best HF path: {data['ratios']['trace_kvlab_over_best_hf']:.2f}x" in md  # the figure printed

"""The captured-forward benchmark (experiments/bench_captured_forward.py) on a tiny model."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from exp_helpers import REPO

sys.path.insert(0, str(REPO / "experiments"))


@pytest.mark.heavy  # torch.compile's first trace of a model takes tens of seconds
def test_eager_runs_before_and_after_each_captured_forward_and_tokens_are_compared(tmp_path):
    from bench_captured_forward import main

    out = tmp_path / "cap"
    rows = main(["--model", "random:llama-tiny", "--backends", "aot_eager", "--context", "12", "--steps", "3",
                 "--warmup", "1", "--kv-cache-memory", "4MiB", "--out", str(out)])
    assert [r["run"] for r in rows] == ["eager", "aot_eager", "eager (again)"]
    for r in rows:
        assert r["step_ms"] == pytest.approx(1e3 * statistics.median(r["steps_s"]))
        assert r["vs_eager"] == pytest.approx(rows[0]["step_ms"] / r["step_ms"])
        assert len(r["tokens"]) == 1 and len(r["tokens"][0]) == 5
    assert rows[2]["same_tokens"]  # eager against eager
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == json.loads(json.dumps(rows))

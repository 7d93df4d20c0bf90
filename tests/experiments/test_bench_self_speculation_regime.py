"""The regime map (experiments/bench_self_speculation_regime.py) on a tiny model: a cell per process-free call,
then the aggregate table with the cost model's prediction beside each measured speed-up."""

from __future__ import annotations

import json
import math
import sys

import pytest

from exp_helpers import REPO

sys.path.insert(0, str(REPO / "experiments"))


def test_cells_then_the_aggregate_table(tmp_path, one_thread):
    from bench_self_speculation_regime import main

    from kvlab.study.bench_io import fmt

    out = str(tmp_path / "regime")
    common = ["--model", "random:llama-tiny", "--max-tokens", "8", "--repeats", "1", "--budget", "32", "--out", out]
    for cell in ("fp32,48,1", "bf16,48,2"):
        main(["--cell", cell, *common])
    main(["--aggregate", *common])
    data = json.loads((tmp_path / "regime.json").read_text())["cells"]
    assert [(d["dtype"], d["ctx"], d["batch"]) for d in data] == [("fp32", 48, 1), ("bf16", 48, 2)]
    assert data[1]["kv_bytes_per_token"] == pytest.approx(data[0]["kv_bytes_per_token"] / 2)  # the cache in bf16
    md = (tmp_path / "regime.md").read_text()
    for d in data:
        assert [r["draft"] for r in d["rows"]] == ["self_compressed(streaming_llm 32)", "ngram"]
        for r in d["rows"]:
            assert r["identical"] == "yes" and math.isfinite(r["speedup"]) and r["predicted"] > 0
            assert r["speedup"] == pytest.approx(r["runs"][0]["spec_tok_s"] / r["runs"][0]["plain_tok_s"])
            assert f"| {d['dtype']} | 48 | {d['batch']} | {r['draft']} | {fmt(r['kv_over_weights'])} |" in md
        sc = d["rows"][0]
        assert sc["runs"][0]["verifications"] > 0 and sc["drafted_len"] > 1
    with pytest.raises(SystemExit):
        main(["--cell", "fp16,48,1", *common])

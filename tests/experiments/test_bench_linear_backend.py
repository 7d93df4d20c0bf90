"""The linear-backend benchmarks: the microbench (experiments/bench_linear_small_batch.py) times every method
on every cell, and the decode-roof benchmark interleaves linear backends with layouts."""

from __future__ import annotations

import json
import sys

import pytest

from exp_helpers import REPO
from kvlab.kernels.cpu import linear as cpu_linear

sys.path.insert(0, str(REPO / "experiments"))
pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no C++ compiler or no AVX-512: no kernel")


def test_the_microbench_times_every_method_that_takes_the_dtype(tmp_path):
    from bench_linear_small_batch import main

    out = tmp_path / "lin"
    rows = main(["--shapes", "192x576", "--batches", "1", "3", "--repeats", "2", "--pool-mib", "2",
                 "--roof-mib", "8", "--threads", "1", "--out", str(out)])
    cells = {(r["dtype"], r["batch"], r["method"]) for r in rows}
    methods = {"torch", "mkl_packed", "onednn_packed", "onednn_dense", "cpu"}
    assert cells == {(d, b, m) for d in ("float32", "bfloat16") for b in (1, 3)
                     for m in (methods if d == "float32" else methods - {"mkl_packed"})}
    for r in rows:
        assert r["gb_s"] == pytest.approx(192 * 576 * (4 if r["dtype"] == "float32" else 2) / r["us"] / 1e3)
        assert r["roof_fraction"] == pytest.approx(r["gb_s"] / r["roof_gb_s"])
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == json.loads(json.dumps(rows))


def test_the_decode_roof_interleaves_linear_backends_with_layouts(tmp_path):
    from bench_decode_roof import main

    _, rows = main(["--model", "random:llama-tiny", "--batches", "2", "--contexts", "16", "--dtypes", "float32",
                    "--quants", "auto", "--steps", "2", "--repeats", "2", "--warmup", "1", "--roof-mib", "8",
                    "--no-hf", "--layouts", "none", "auto", "--linear-backends", "torch", "cpu",
                    "--out", str(tmp_path / "roof")])
    got = {(r["layout"], r["linear_backend"]): r for r in rows}
    assert set(got) == {(lay, be) for lay in ("none", "auto") for be in ("torch", "cpu")}
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    for i, variant in enumerate([("none", "torch"), ("none", "cpu"), ("auto", "torch"), ("auto", "cpu")]):
        cached = 16 + 1 + 1 + (2 * i + 2 * (i + 4)) / 2 + 0.5  # blocks i and i + 4 of 2 steps each
        assert got[variant]["kv_bytes"] == pytest.approx(2 * cached * per_token), variant
        assert len(got[variant]["steps_s"]) == 2

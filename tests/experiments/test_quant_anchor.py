"""The Hugging Face quantised-cache anchor (experiments/bench_quant_anchor.py) on a tiny model: both systems
run kvlab's own perplexity and agreement code, and the bytes each cache holds are counted from its tensors."""

from __future__ import annotations

import sys

import pytest
import torch

from exp_helpers import REPO, needs_data

sys.path.insert(0, str(REPO / "experiments"))


def test_tensor_bytes_looks_inside_quantos_packed_tensors():
    quanto = pytest.importorskip("optimum.quanto", reason="optimum-quanto is installed by the `anchors` extra")
    from bench_quant_anchor import tensor_bytes

    x = torch.randn(64, 32)
    scale, shift = quanto.MaxOptimizer()(x, quanto.qint4, 0, 32)
    q = quanto.quantize_weight(x, quanto.qint4, 0, scale, shift, 32)
    # 2048 values at 4 bits, plus a scale and a shift per group of 32 (fp32 here: x's dtype)
    assert tensor_bytes(q) == 2048 // 2 + 2 * (2048 // 32) * 4
    assert tensor_bytes(x) == 2048 * 4


@needs_data("wikitext-2-raw")
@pytest.mark.heavy  # both systems on SmolLM2 (~40 s); its byte counting is checked above without a model
def test_anchor_runs_both_systems_and_the_integer_formats_hold_fewer_bytes(tmp_path):
    pytest.importorskip("optimum.quanto", reason="optimum-quanto is installed by the `anchors` extra")
    from bench_quant_anchor import main

    out = tmp_path / "anchor"
    main(["--model", "random:llama-tiny", "--group-size", "8", "--residual", "8", "--num-windows", "1",
          "--num-prompts", "1", "--context", "48", "--continuation", "8", "--prompt-length", "200",
          "--max-new-tokens", "4", "--out", str(out)])
    import json

    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert len(rows) == 6
    for system in ({r["system"] for r in rows}):
        fp32, int4, int2 = (r for r in rows if r["system"] == system)
        assert fp32["kl"] == 0.0 and fp32["greedy_match"] == 1.0  # each system against its own fp32 cache
        assert max(int2["bytes_per_token"], int4["bytes_per_token"]) < 0.75 * fp32["bytes_per_token"], system
        assert all(r["ppl"] > 1 for r in (fp32, int4, int2))
    # Hugging Face keeps at most `residual` tokens unquantised; kvlab's open pages lease whole pages' codes for
    # their full-precision rows (16 int2 pages a row at these tiny heads, 8 int4), so int2 beats int4 there only
    # once the sealed pages outweigh the rows: at this length, Hugging Face's int2 is the smaller
    hf = {r["format"]: r["bytes_per_token"] for r in rows if r["system"] != "kvlab"}
    assert hf["int2"] < hf["int4"]


@needs_data("wikitext-2-raw")
def test_a_format_hugging_face_refuses_is_reported_not_fatal(tmp_path):
    """transformers' QuantizedCache refuses models with sliding-window layers (Gemma 3): the anchor keeps
    the fp32 row, lists the refusal with transformers' error, and still runs kvlab's formats."""
    pytest.importorskip("optimum.quanto", reason="optimum-quanto is installed by the `anchors` extra")
    from bench_quant_anchor import main

    out = tmp_path / "anchor"
    main(["--model", "random:gemma3-tiny", "--group-size", "8", "--residual", "8", "--num-windows", "1",
          "--num-prompts", "1", "--context", "48", "--continuation", "8", "--prompt-length", "48",
          "--max-new-tokens", "4", "--formats", "fp32", "int4", "--out", str(out)])
    import json

    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["system"], r["format"]) for r in rows] == [
        ("Hugging Face QuantizedCache (quanto)", "fp32 (DynamicCache)"), ("kvlab", "fp32"), ("kvlab", "int4")]
    text = out.with_suffix(".md").read_text()
    assert "Refused (no row):" in text and "QuantizedCache int4 on random:gemma3-tiny" in text
    assert "sliding_attention" in text

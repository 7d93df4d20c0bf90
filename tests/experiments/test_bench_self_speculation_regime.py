"""The regime map (experiments/bench_self_speculation_regime.py) on a tiny model: a cell per process-free call,
then the aggregate table with the cost model's prediction beside each measured speed-up; the shared-context
workload's prompts; every draft mode and the Hugging Face rows at batch 1."""

from __future__ import annotations

import json
import math
import sys

import pytest

from exp_helpers import REPO

sys.path.insert(0, str(REPO / "experiments"))

TINY = ["--model", "random:llama-tiny", "--repeats", "1", "--budget", "32", "--threads", "1"]


def test_cells_then_the_aggregate_table(tmp_path, one_thread):
    from bench_self_speculation_regime import main

    from kvlab.study.bench_io import fmt

    out = str(tmp_path / "regime")
    common = [*TINY, "--max-tokens", "8", "--drafts", "streaming", "ngram", "--out", out]
    for cell in ("fp32,48,1", "bf16,48,2"):
        main(["--cell", cell, *common])
    main(["--aggregate", *common, "--ceiling-mib", "8"])
    data = json.loads((tmp_path / "regime.json").read_text())["cells"]
    assert [(d["dtype"], d["ctx"], d["batch"]) for d in data] == [("fp32", 48, 1), ("bf16", 48, 2)]
    assert data[1]["kv_bytes_per_token"] == pytest.approx(data[0]["kv_bytes_per_token"] / 2)  # the cache in bf16
    md = (tmp_path / "regime.md").read_text()
    for d in data:
        assert d["linear_backend"] == "cpu"  # the small-batch linear kernel, the fastest plain path
        assert [r["draft"] for r in d["rows"]] == ["self_compressed(streaming_llm 32)", "ngram"]
        for r in d["rows"]:
            assert r["identical"] == "yes" and math.isfinite(r["speedup"]) and r["predicted"] > 0
            assert r["speedup"] == pytest.approx(r["runs"][0]["spec_tok_s"] / r["runs"][0]["plain_tok_s"])
            assert f"| {d['dtype']} | 48 | {d['batch']} | {r['draft']} | {fmt(r['kv_over_weights'])} |" in md
        sc = d["rows"][0]
        assert sc["runs"][0]["verifications"] > 0 and sc["drafted_len"] > 1
        assert 0 < sc["ceiling"] <= sc["ceiling_all"]  # the roof columns: fewer accepted drafts never pay more
    assert "The roof columns price every pass" in md and "GFLOP/s" in md
    with pytest.raises(SystemExit):
        main(["--cell", "fp16,48,1", *common])


def test_the_shared_workload_is_one_document_and_a_distinct_suffix_per_sequence():
    from bench_self_speculation_regime import cell_prompts

    ps, doc = cell_prompts(None, 64, 4, 256, "shared", suffix=8)
    assert len(doc) == 64 and all(len(p) == 72 and p[:64] == doc for p in ps)
    assert len({tuple(p[64:]) for p in ps}) == 4  # the sequences differ
    ps, doc = cell_prompts(None, 64, 4, 256, "distinct")
    assert doc is None and len({tuple(p) for p in ps}) == 4 and all(len(p) == 64 for p in ps)


def test_every_draft_mode_and_the_hugging_face_rows_at_batch_1(tmp_path, one_thread):
    from bench_self_speculation_regime import main

    out = str(tmp_path / "modes")
    d = main(["--cell", "fp32,48,1", *TINY, "--max-tokens", "6", "--snapkv-budget", "32", "--int4-budget", "32",
              "--refresh", "16", "--layers", "1", "--drafts", "snapkv", "int4", "layerskip", "model",
              "hf_early_exit", "hf_prompt_lookup", "--out", out])
    assert [r["draft"] for r in d["rows"]] == ["self_compressed(snapkv 32, refresh 8)",
                                                "self_compressed(streaming_llm 32, int4, refresh 16)",
                                                "layerskip(1 layers)", "model(random:llama-tiny)"]
    for r in d["rows"]:
        assert r["identical"] == "yes" and r["runs"][0]["verifications"] > 0 and r["predicted"] > 0
    assert [r["hf"].split(",")[0] for r in d["hf"]] == ["plain generate", "assistant_early_exit=1",
                                                         "prompt_lookup_num_tokens=4"]
    for r in d["hf"]:  # greedy: Hugging Face's outputs are kvlab's plain ones
        assert r["identical"] == "yes" and r["tok_s"] > 0 and r["vs_kvlab"] > 0
    big = main(["--cell", "fp32,48,2", *TINY, "--max-tokens", "4", "--own-pool-gib", "1e-6", "--drafts", "ngram",
                "layerskip", "model", "hf_early_exit", "--out", out])
    assert big["skipped"] == ["layerskip", "model"] and big["hf"] == []  # no copy of every context; HF at batch 1
    assert [r["draft"] for r in big["rows"]] == ["ngram"]


def test_the_roof_columns_price_each_draft_as_its_command_built_it(tmp_path, one_thread):
    """ceilings() reads each cell's command back: the view's budget, the int4 copy's bytes, an early exit's layers
    (a wrong budget or a draft taken for another changes the figure)."""
    from bench_self_speculation_regime import ceilings, draft_reads, main, model_shape, parse_args

    from kvlab.speculation.roofline import DraftReads, Machine, ceiling_speedup

    out = str(tmp_path / "roof")
    d = main(["--cell", "fp32,48,2", *TINY, "--max-tokens", "6", "--int4-budget", "32", "--layers", "1",
              "--drafts", "streaming", "int4", "layerskip", "ngram", "--out", out])
    cell = json.loads((tmp_path / "roof.cells" / "fp32_48_2.json").read_text())
    m = Machine(40e9, 150e9, 150e9)
    ceilings([cell], {"fp32": m})
    cargs = parse_args(["--cell", "fp32,48,2", *TINY, "--max-tokens", "6", "--int4-budget", "32", "--layers", "1",
                        "--drafts", "streaming", "int4", "layerskip", "ngram", "--out", out])
    assert vars(cargs) == cell["args"]
    shape, parts = model_shape("random:llama-tiny", "fp32", cell)
    c = cell["prompt_tokens"] + 3
    reads = {r["draft"]: draft_reads(cargs, r["draft"], "fp32", parts) for r in cell["rows"]}
    assert reads["self_compressed(streaming_llm 32)"] == DraftReads(view_tokens=32)
    int4 = reads["self_compressed(streaming_llm 32, int4, refresh 64)"]
    # 4-bit codes and their scales, every layer: between an eighth and a quarter of the fp32 cache's bytes a token
    assert int4.view_tokens == 32 and cell["kv_bytes_per_token"] / 8 < int4.kv_bytes_per_token < cell["kv_bytes_per_token"] / 4
    assert reads["layerskip(1 layers)"].layer_share == 0.5 and reads["ngram"].free
    for r in cell["rows"]:
        k = r["drafted_len"]
        assert r["ceiling_all"] == pytest.approx(ceiling_speedup(shape, m, reads[r["draft"]], 2, c, k, k + 1.0))
    assert len(d["rows"]) == 4

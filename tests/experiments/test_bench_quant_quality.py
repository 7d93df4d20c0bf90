"""The format quality benchmark (experiments/bench_quant_quality.py): every format, the bf16 residual rows and
the format x policy rows, on a tiny model."""

from __future__ import annotations

import json
import sys

from exp_helpers import REPO, needs_data

sys.path.insert(0, str(REPO / "experiments"))


@needs_data("wikitext-2-raw")
def test_formats_residual_variants_and_policy_rows(tmp_path):
    from bench_quant_quality import main

    out = tmp_path / "q"
    main(["--model", "random:llama-tiny", "--formats", "fp32", "int8", "int4", "--group-size", "8",
          "--num-windows", "1", "--context", "32", "--continuation", "8", "--num-prompts", "1",
          "--prompt-length", "48", "--max-new-tokens", "4", "--kv-cache-memory", "2MiB", "--max-num-seqs", "2",
          "--residual-bf16", "--variant", "fp8_e4m3:scaling=fixed,scale=0.5", "--policy", "snapkv", "--budgets", "16",
          "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["format"], r["args"], r["policy"]) for r in rows] == [
        ("fp32", "-", "full"), ("int8", "-", "full"), ("int4", "group_size=8", "full"),
        ("int4", "group_size=8,residual_dtype=bfloat16", "full"), ("fp8_e4m3", "scaling=fixed,scale=0.5", "full"),
        ("fp32", "-", "snapkv budget=16"), ("int8", "-", "snapkv budget=16"), ("int4", "group_size=8", "snapkv budget=16")]
    fp32, int8, int4, int4_bf16, fp8_fixed = rows[:5]
    assert fp32["vs_bf16"] == 2.0 and int8["bytes_per_token"] < fp32["bytes_per_token"] / 3
    assert fp32["kl"] == 0.0 and fp32["greedy_match"] == 1.0  # the fp32 full cache is its own reference
    # residual rows are leased from the pool's pages (issue 21 item 15): no area of their own is counted apart
    assert int4_bf16["residual_mib"] == 0.0 and int4["residual_mib"] == 0.0
    assert 0 < int4_bf16["leased_mib"] < int4["leased_mib"]  # bf16 rows lease half the pages
    assert fp8_fixed["bytes_per_token"] == fp32["bytes_per_token"] / 4 and fp8_fixed["leased_mib"] == 0.0
    assert all(r["ppl"] is None for r in rows[5:]) and all(r["ppl"] > 1 for r in rows[:5])
    assert rows[5]["kl"] > 0  # snapkv at 16 of 48 tokens changes the next-token distributions
    assert "| snapkv budget=16 |" in out.with_suffix(".md").read_text()


def test_a_policy_spec_carries_its_other_arguments():
    import pytest
    from bench_quant_quality import parse_args, policy_label

    args = parse_args(["--policy", "snapkv", "--policy", 'adakv:{"scorer": "h2o", "scorer_args": {"recent": 8}}'])
    assert args.policy == [("snapkv", {}), ("adakv", {"scorer": "h2o", "scorer_args": {"recent": 8}})]
    assert policy_label("snapkv", {}, 16) == "snapkv budget=16"
    assert policy_label(*args.policy[1], 128) == 'adakv scorer=h2o scorer_args={"recent": 8} budget=128'
    for bad in ('adakv:{"budget": 8}', "adakv:[1]", "adakv:{nope"):
        with pytest.raises(SystemExit):  # argparse reports the ArgumentTypeError and exits
            parse_args(["--policy", bad])

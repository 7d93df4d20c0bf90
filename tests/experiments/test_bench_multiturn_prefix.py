"""The multi-turn prefix-caching benchmark (experiments/bench_multiturn_prefix.py) on a tiny model, on int4
pages with a residual window: later turns hit the earlier turns' pages, and the report counts the turns
whose greedy tokens equal caching off's."""

from __future__ import annotations

import json
import sys

from exp_helpers import REPO, needs_data

sys.path.insert(0, str(REPO / "experiments"))


@needs_data("wikitext-2-raw")
def test_multiturn_on_int4_pages_with_a_residual_window(tmp_path):
    from bench_multiturn_prefix import main

    out = tmp_path / "mt"
    results = main(["--model", "random:llama-tiny", "--conversations", "2", "--turns", "2", "--user-len", "40",
                    "--max-tokens", "4", "--kv-memory", "2MiB", "--block-size", "8", "--repeats", "1",
                    "--quant", "int4", "--quant-args", '{"group_size": 8, "residual": 16}', "--out", str(out)])
    rows = {r["variant"]: r for r in results["rows"]}
    assert rows["off"]["prefix_hit_tokens"] == 0
    for name in ("hash", "radix"):  # turn 2 reuses turn 1's prompt pages, never the last residual tokens
        assert 0 < rows[name]["prefix_hit_tokens"] <= 2 * (40 + 4 + 40 - 16)
        assert rows[name]["computed_prompt_tokens"] < rows["off"]["computed_prompt_tokens"]
    assert results["turns_same_as_off"]["off"] == (4, 4)
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["turns_same_as_off"]["hash"][1] == 4
    assert '"residual": 16' in out.with_suffix(".md").read_text()

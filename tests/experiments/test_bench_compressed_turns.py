"""The compressed multi-turn benchmark (experiments/bench_compressed_turns.py) on a tiny model: the reuse variant
continues from the previous turns' compressed caches (hits, reused tokens, fewer prompt tokens computed), its first
turns equal the no-cache run's, and the report and its JSON are written."""

from __future__ import annotations

import json
import sys

from exp_helpers import REPO, needs_data

sys.path.insert(0, str(REPO / "experiments"))


@needs_data("wikitext-2-raw")
def test_reuse_hits_earlier_turns_and_first_turns_agree(tmp_path):
    from bench_compressed_turns import main

    out = tmp_path / "ct"
    results = main(["--model", "random:llama-tiny", "--conversations", "2", "--turns", "3", "--repeats", "1",
                    "--user-len", "64", "--max-tokens", "8", "--out", str(out)])
    rows = {r["variant"]: r for r in results["rows"]}
    assert rows["nocache"]["reuse_hits"] == 0 and rows["nocache"]["reused_tokens"] == 0
    # snapkv's 64-token observation window is computed by the request itself (BlockManager.turn_tail): with
    # 64-token user messages every returning turn takes its whole previous turn (its prompt and answer but the
    # last sampled token: 64 + 8 - 1 tokens, then 64 + 8 + 64 + 8 - 1)
    assert rows["reuse"]["reuse_hits"] == 2 * (3 - 1)
    assert rows["reuse"]["reused_tokens"] == 2 * ((64 + 8 - 1) + (2 * (64 + 8) - 1))
    assert rows["reuse"]["computed_prompt_tokens"] == rows["reuse"]["prompt_tokens"] - rows["reuse"]["reused_tokens"]
    assert rows["reuse"]["prompt_tokens"] == rows["nocache"]["prompt_tokens"]
    agree = results["agreement_with_nocache"]
    assert all(a == 1.0 for a, _ in agree["nocache"].values())
    assert agree["reuse"][0] == (1.0, 2)  # turn 0 has nothing to reuse: the same tokens as no-cache
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["rows"][1]["variant"] == "reuse"
    assert "Compressed multi-turn reuse" in out.with_suffix(".md").read_text()

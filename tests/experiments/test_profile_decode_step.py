"""The decode-step profile (experiments/profile_decode_step.py) splits a tiny model's steps into its parts."""

from __future__ import annotations

import json
import sys

import pytest

from exp_helpers import REPO

sys.path.insert(0, str(REPO / "experiments"))


def test_the_parts_of_a_profiled_step_cover_it_without_overlap(tmp_path):
    from profile_decode_step import PARTS, main

    out = tmp_path / "prof"
    rows = main(["--model", "random:llama-tiny", "--batches", "1", "3", "--context", "24", "--steps", "2",
                 "--plain-steps", "2", "--kv-cache-memory", "4MiB", "--layout", "auto", "--out", str(out)])
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert all(r[p] >= 0 for p in PARTS), r  # the remainders (module overhead, engine rest) too: no overlap
        assert sum(r[p] for p in PARTS) == pytest.approx(r["step"])
        assert r["linear"] > 0 and r["lm_head"] > 0 and r["attention"] > 0 and r["plan (prepare)"] > 0
        assert r["attention_top"] and all(name.startswith("aten::") for name, _ in r["attention_top"])
    saved = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert saved == json.loads(json.dumps(rows))
    md = out.with_suffix(".md").read_text()
    assert all(f"| {p} |" in md for p in PARTS)

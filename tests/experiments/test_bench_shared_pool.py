"""experiments/bench_shared_pool.py: its measurement on a tiny random Gemma 3 beats the per-group split's bound,
and an old revision assembled on PYTHONPATH is the kvlab a subprocess imports."""

from __future__ import annotations

import importlib.util
import random
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "bench_shared_pool.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_shared_pool", SCRIPT)  # its helpers: kvlab.study.bench_io
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shared_pool_admits_more_than_a_per_group_split(bench):
    # random:gemma3-tiny: 5 sliding layers (window 8) + 1 full layer, 1 KV head of 32 -> six groups of one layer;
    # a page is 4 tokens of one layer: 2 * 4 * 32 * 4 bytes = 1 KiB.
    pages, block, prompt_len, new = 144, 4, 40, 8
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(prompt_len)] for _ in range(8)]
    result = bench.measure({"model": "random:gemma3-tiny", "prompts": prompts, "max_tokens": new, "threads": 0,
                            "engine": dict(block_size=block, kv_cache_memory=pages * 1024, max_model_len=64,
                                           max_num_batched_tokens=16, dtype="float32")})
    assert result["shared_pool"] and result["num_groups"] == 6 and result["page_layers"] == 1
    assert result["kv_blocks_total"] == pages
    assert all(len(t) == new for t in result["token_ids"])
    # Split per group (before), a block id spans all 6 layers: 144 KiB / 6 KiB = 24 blocks in each pool, and the
    # full-attention pool holds 24 // (40 / 4) = 2 prompts. Shared, a sequence costs 10-12 full pages plus a few
    # window pages per sliding group (window 8 + a 16-token chunk), so the pool holds more.
    per_group_bound = (pages // 6) // (prompt_len // block)
    assert per_group_bound == 2
    assert result["max_concurrent_seqs"] > per_group_bound


def test_old_revision_wins_the_import_and_its_child_runs(bench, tmp_path):
    """The "before" measurement: the script itself runs as a child against kvlab as of ce793cb (which has no
    kvlab.study.bench_io: the script must not import it at the top), and run_child checks that the child imported
    the old kvlab (one pool per layer group there)."""
    if subprocess.run(["git", "-C", str(SCRIPT.parent), "rev-parse", "ce793cb"], capture_output=True).returncode:
        pytest.skip("not a git checkout holding ce793cb")
    site = bench.assemble("ce793cb", tmp_path)
    assert (site / "kvlab" / "policies").is_dir() and (site / "kvlab" / "kernels").is_dir()
    rng = random.Random(0)
    spec = {"model": "random:gemma3-tiny", "prompts": [[rng.randrange(256) for _ in range(40)] for _ in range(4)],
            "max_tokens": 4, "threads": 1, "engine": dict(block_size=4, kv_cache_memory=144 * 1024, max_model_len=64,
                                                          max_num_batched_tokens=16, dtype="float32")}
    result = bench.run_child(spec, site, tmp_path)
    assert Path(result["kvlab_file"]).is_relative_to(site)
    assert not result["shared_pool"] and all(len(t) == 4 for t in result["token_ids"])

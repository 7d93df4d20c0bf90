"""experiments/bench_policy_capacity.py on the tiny random Llama: evicted pages turn into concurrency.

8 prompts of 200 tokens in a 512 KiB pool (1,024 token slots over both layers): the full cache holds
4 prompts at once (13 pages of 16 tokens each); at compression ratio 0.75 each prompt keeps 50 tokens per
layer (4 pages of one layer each, 8 in all), so all 8 fit once compressed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "bench_policy_capacity.py"


def load_bench():
    """The benchmark script as a module (its folder must be on sys.path for its own imports)."""
    spec = importlib.util.spec_from_file_location("bench_policy_capacity", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_compression_turns_into_concurrent_sequences(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        bench = load_bench()
        results = bench.main(["--model", "random:llama-tiny", "--num-requests", "8", "--min-len", "200",
                              "--max-len", "200", "--max-tokens", "8", "--kv-memory", "512KiB",
                              "--max-model-len", "256", "--policies", "snapkv", "knorm", "--out", str(tmp_path / "cap")])
    finally:
        sys.path.remove(str(SCRIPT.parent))
    rows = {r["policy"]: r for r in results["rows"]}
    assert rows["full"]["max_concurrent_seqs"] == 4 and rows["full"]["policy_compressions"] == 0
    for name in ("snapkv", "knorm"):
        assert rows[name]["max_concurrent_seqs"] == 8 and rows[name]["policy_compressions"] == 8
        assert rows[name]["pages_freed_per_seq"] == 2 * (13 - 4)  # both layers, 13 pages down to 4
    assert (tmp_path / "cap.md").read_text().count("|") > 20


def test_the_model_free_replay_counts_what_a_run_counts(tmp_path):
    """--replay drives the engine's scheduler and budgets without the model: its concurrency, preemptions and
    steps equal a run's, for the full cache, compression at the end of prefill and per chunk with a cap."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        bench = load_bench()
        argv = ["--model", "random:llama-tiny", "--num-requests", "20", "--min-len", "200", "--max-len", "200",
                "--max-tokens", "8", "--kv-memory", "512KiB", "--max-model-len", "256", "--max-batched-tokens", "256",
                "--policies", "snapkv", "--chunk-policies", "snapkv", "--max-prefill-chunk", "32"]
        ran = bench.main(argv + ["--out", str(tmp_path / "run")])
        replayed = bench.main(argv + ["--replay", "--out", str(tmp_path / "replay")])
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert [r["policy"] for r in replayed["rows"]] == ["full", "snapkv", "snapkv (chunk, prefill chunk <= 32)"]
    for run, rep in zip(ran["rows"], replayed["rows"]):
        for key in ("max_concurrent_seqs", "mean_concurrent_seqs", "preemptions", "num_steps"):
            assert rep[key] == run[key], (run["policy"], key, rep[key], run[key])
    chunked = replayed["rows"][2]
    assert chunked["max_concurrent_seqs"] > replayed["rows"][1]["max_concurrent_seqs"]


def test_cache_formats_turn_into_concurrent_sequences_run_and_replay_alike(tmp_path):
    """--formats: every row once per cache format at the same byte budget; smaller formats hold more
    sequences, and the model-free replay counts what a run counts (the int4 residual area included)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        bench = load_bench()
        argv = ["--model", "random:llama-tiny", "--num-requests", "16", "--min-len", "200", "--max-len", "200",
                "--max-tokens", "8", "--kv-memory", "512KiB", "--max-model-len", "256", "--policies",
                "--formats", "fp32", "int8", "int4", "--group-size", "8", "--max-num-seqs", "16"]
        ran = bench.main(argv + ["--out", str(tmp_path / "run")])
        replayed = bench.main(argv + ["--replay", "--out", str(tmp_path / "replay")])
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert [r["policy"] for r in replayed["rows"]] == ["full [fp32]", "full [int8]", "full [int4]"]
    for run, rep in zip(ran["rows"], replayed["rows"]):
        for key in ("max_concurrent_seqs", "mean_concurrent_seqs", "preemptions", "num_steps"):
            assert rep[key] == run[key], (run["policy"], key, rep[key], run[key])
    fp32, int8, int4 = (r["max_concurrent_seqs"] for r in replayed["rows"])
    assert fp32 == 4 and int8 > 2 * fp32 and int4 > fp32

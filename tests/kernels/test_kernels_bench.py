"""The bench script's correctness path runs end to end (under the interpreter on a CPU-only machine)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_check_only_exits_zero(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it itself
    proc = subprocess.run(
        [sys.executable, "-m", "kvlab.kernels.bench", "--check-only", "--write", "--out-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| store_kv | fp8_e4m3 |" in proc.stdout and "FAILED" not in proc.stdout
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len(written) == 2 and written[0].startswith("kernels_bench_") and written[0].endswith(".json")

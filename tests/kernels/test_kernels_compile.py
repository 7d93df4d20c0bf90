"""Every kernel specialisation the launchers produce compiles for sm_90 (H100/H200) without a GPU.

The interpreter is lenient where the GPU compiler is not; this catches type and
shape errors in the real code-generation path (through the ptxas bundled with Triton).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]
BUNDLED_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not BUNDLED_PTXAS.exists() and "TRITON_PTXAS_PATH" not in os.environ,
                    reason="no ptxas (Triton's bundled one or TRITON_PTXAS_PATH) to assemble for the GPU")
def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "kvlab.kernels.compile_check", "--arch", "90"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("ok")]
    kernels = {line.rsplit(": ", 1)[-1].split(" ")[0] for line in compiled}
    assert kernels == {"store_kv_kernel", "paged_attention_kernel", "combine_splits_kernel",
                       "attention_stats_kernel", "copy_rows_kernel"}

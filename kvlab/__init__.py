"""kvlab: a research framework for KV-cache policies in LLM inference.

    from kvlab import LLM, SamplingParams

Heavy modules (torch, transformers) load on first use, so the torch-free
bookkeeping (allocators, scheduler, registries) imports instantly.
"""

from __future__ import annotations

__version__ = "0.1.0"

from kvlab import source_tree as _source_tree

_source_tree.hide()  # the source tree's kernels/ and policies/ are kvlab.kernels / kvlab.policies, never top-level

_LAZY = {
    "LLM": "kvlab.llm",
    "SamplingParams": "kvlab.sampling_params",
    "EngineConfig": "kvlab.engine_config",
    "LLMEngine": "kvlab.engine.llm_engine",
    "RequestOutput": "kvlab.outputs",
    "CompletionOutput": "kvlab.outputs",
    "ScoreOutput": "kvlab.outputs",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")

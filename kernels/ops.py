"""Backend dispatch: the engine's entry points into the kernels.

`auto` runs Triton on CUDA tensors and the torch reference on CPU tensors;
`torch` and `triton` force one (Triton on CPU needs TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch

from kvlab.kernels.reference.paged_attention import AttentionPlan, plan_paged_attention, run_paged_attention
from kvlab.kernels.reference.store_kv import store_kv_ref

_BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("KVLAB_KERNEL_BACKEND", "auto")


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    _backend = name


def get_backend() -> str:
    return _backend


def use_triton(t: torch.Tensor) -> bool:
    if _backend == "auto":
        return t.is_cuda
    return _backend == "triton"


__all__ = [
    "AttentionPlan",
    "plan_paged_attention",
    "run_paged_attention",
    "store_kv_ref",
    "set_backend",
    "get_backend",
    "use_triton",
]

"""Backend dispatch: the engine's entry points into the kernels.

`auto` runs Triton on CUDA tensors and, on CPU tensors, the native CPU decode attention
(kvlab.kernels.cpu, built with g++ on first use; KVLAB_CPU_KERNELS=0 turns it off) with the torch
reference for everything else; `torch` and `triton` force one (Triton on CPU needs TRITON_INTERPRET=1 set
before the kernels are first used). The backend comes from
KVLAB_KERNEL_BACKEND at import, `set_backend(name)`, or `with backend(name):`.

The Triton launchers are imported on first use only, so a CPU-only process
never imports (or decorates) a Triton kernel.

    plan = plan_paged_attention(cu_seqlens_q, seq_lens, block_tables, block_size, window, device)
    store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    out = run_paged_attention(q, k_cache, v_cache, plan, scale, softcap, k_scale, v_scale)
    out, stats = run_paged_attention(..., return_stats=True, stats_window=32)
    copy_blocks(k_cache, v_cache, src_blocks, dst_blocks)
    compact_slots(k_cache, v_cache, src_slots, dst_slots)
"""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kvlab.kernels.reference import block_ops as _ref_blocks
from kvlab.kernels.reference import paged_attention as _ref_attn
from kvlab.kernels.attention_plan import AttentionPlan, plan_paged_attention
from kvlab.kernels.cpu import decode_attention as _cpu_attn
from kvlab.kernels.reference.store_kv import store_kv_ref

_BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("KVLAB_KERNEL_BACKEND", "auto")  # checked by set_backend below


_ALIASES = {"reference": "torch"}


def set_backend(name: str) -> None:
    global _backend
    name = _ALIASES.get(name, name)
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    _backend = name


set_backend(_backend)


def get_backend() -> str:
    return _backend


@contextmanager
def backend(name: str) -> Iterator[None]:
    """Use backend `name` inside the block, then restore the previous one."""
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def use_triton(t: torch.Tensor) -> bool:
    if _backend == "auto":
        return t.is_cuda
    return _backend == "triton"


def use_cpu_kernels(t: torch.Tensor) -> bool:
    """The native CPU kernels: `auto` backend, a CPU tensor, KVLAB_CPU_KERNELS not 0."""
    return _backend == "auto" and t.device.type == "cpu" and _cpu_attn.enabled()


def _triton(module: str, name: str):
    """A Triton launcher, imported on first use (kvlab.kernels.<module>.<name>)."""
    return getattr(importlib.import_module(f"kvlab.kernels.{module}"), name)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, < 0 skips
    k_scale: torch.Tensor | None = None,  # [Hkv] float32
    v_scale: torch.Tensor | None = None,
) -> None:
    if use_triton(k_cache):
        return _triton("store_kv", "store_kv")(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if k_scale is None and v_scale is None and key.dtype == k_cache.dtype == v_cache.dtype == value.dtype \
            and k_cache.is_contiguous() and v_cache.is_contiguous() and _all_valid(slot_mapping):
        # a plain copy into the slots (the reference's writes, without its mask, casts and advanced indexing)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)
        return
    store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


_valid_slots = WeakIdKeyDictionary()  # slot mapping -> no slot < 0 (a step's mapping is stored into by every layer)


def _all_valid(slot_mapping: torch.Tensor) -> bool:
    valid = _valid_slots.get(slot_mapping)
    if valid is None:
        valid = _valid_slots[slot_mapping] = bool((slot_mapping >= 0).all()) and slot_mapping.dtype == torch.int64
    return valid


def run_paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    return_stats: bool = False,
    stats_window: int | None = None,
    out: torch.Tensor | None = None,
    stats_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[T, Hq, D] output, or (output, stats [B, Hkv, max seq_len]) with `return_stats`."""
    if use_triton(q):
        fn = _triton("paged_attention", "run_paged_attention")
    else:
        fn = _cpu_attn.run_paged_attention if use_cpu_kernels(q) else _ref_attn.run_paged_attention
    return fn(q, k_cache, v_cache, plan, scale, softcap, k_scale, v_scale,
              return_stats=return_stats, stats_window=stats_window, out=out, stats_out=stats_out)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    cu_seqlens_q: torch.Tensor,  # [B + 1] int
    seq_lens: torch.Tensor,  # [B] int
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    **kwargs,  # tree_mask, return_stats, stats_window, out, stats_out
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plan and run in one call (tests, one-off use); the engine plans once per step instead."""
    if use_triton(q):
        fn = _triton("paged_attention", "paged_attention")
    else:
        fn = _cpu_attn.paged_attention if use_cpu_kernels(q) else _ref_attn.paged_attention_ref
    return fn(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window, softcap,
              k_scale, v_scale, **kwargs)


def copy_blocks(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    src_blocks: torch.Tensor,  # [N] int
    dst_blocks: torch.Tensor,  # [N] int
) -> None:
    fn = _triton("block_ops", "copy_blocks") if use_triton(k_cache) else _ref_blocks.copy_blocks_ref
    fn(k_cache, v_cache, src_blocks, dst_blocks)


def compact_slots(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    src_slots: torch.Tensor,  # [N] int
    dst_slots: torch.Tensor,  # [N] int, may overlap src_slots
) -> None:
    fn = _triton("block_ops", "compact_slots") if use_triton(k_cache) else _ref_blocks.compact_slots_ref
    fn(k_cache, v_cache, src_slots, dst_slots)


__all__ = [
    "AttentionPlan",
    "plan_paged_attention",
    "run_paged_attention",
    "paged_attention",
    "store_kv",
    "store_kv_ref",
    "copy_blocks",
    "compact_slots",
    "set_backend",
    "get_backend",
    "backend",
    "use_triton",
    "use_cpu_kernels",
]

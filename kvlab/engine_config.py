"""Everything that configures an engine, checked before any model loads."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

ALLOWED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(value: int | float | str) -> int:
    """64 * 2**20, "64MiB", "1.5 GiB", "500MB" -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory {value!r} is not a size (examples: 268435456, '256MiB', '1GiB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"  # packaged name, local folder, .gguf file, random:<shape> or hub id
    block_size: int = 16  # tokens per KV block
    allocator: str = "paged"  # registered allocator name
    allocator_args: dict[str, Any] = field(default_factory=dict)
    kv_cache_memory: int | str = "256MiB"  # byte budget of the whole KV pool (all layers, K and V)
    max_num_seqs: int = 256  # running sequences at most
    max_num_batched_tokens: int = 512  # tokens computed per step at most (prefill chunks + decodes)
    max_model_len: int | None = None  # longest sequence; default: the model's context
    policy: str = "full"  # registered eviction/compression policy
    policy_args: dict[str, Any] = field(default_factory=dict)
    quant: str = "auto"  # registered cache format
    quant_args: dict[str, Any] = field(default_factory=dict)
    draft: str | None = None  # registered draft model (speculative decoding), None = off
    draft_args: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"  # model compute dtype
    device: str = "cpu"
    seed: int = 0
    kernel_backend: str = "auto"  # auto | torch | triton

    def __post_init__(self) -> None:
        if self.block_size not in ALLOWED_BLOCK_SIZES:
            raise ValueError(f"block_size {self.block_size} is not allowed; choose one of {ALLOWED_BLOCK_SIZES}")
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("allocator_args", "policy_args", "quant_args", "draft_args"):
            setattr(self, name, dict(getattr(self, name) or {}))

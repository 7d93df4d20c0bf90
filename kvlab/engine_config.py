"""Everything that configures an engine, checked before any model loads: the one schema of engine options.

    LLM(model="random:llama-tiny", block_size=16, kv_cache_memory="4MiB")  # -> EngineConfig(model=..., ...)

The Hydra experiment config holds the same options, laid out by section
(`engine.<field>`, `model.name` / `model.dtype`, `seed`, and the plugin sections
`policy` / `quant` / `draft`); kvlab.study.config checks a composed config against
these fields and maps it onto them (`kvlab.study.config.engine_options`). Adding an
engine option costs one field here and one commented line in conf/engine/default.yaml.

A wrong option raises `EngineOptionError` (a ValueError) naming it::

    block_size: expected int, got float 16.0
    block_size: 24 is not allowed; choose one of (1, 2, 4, 8, 16, 32, 64, 128, 256)
    device: 'cuda': CUDA is not available here (torch is built without CUDA); use device='cpu'
    policy_args: policy 'snapkv' needs a budget (...) or a compression_ratio (...)

Besides the types and ranges, the device and the kernel backend are checked against this machine,
and the policy is built once (so the plugins are loaded): its own parameter errors, and a
compressing policy given neither a budget nor a ratio, fail here.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from kvlab.sampling_params import MAX_SEED
from kvlab.schema import ConfigError, fields_of, fits, type_problem

ALLOWED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PLUGIN_ARGS = ("allocator_args", "policy_args", "quant_args", "draft_args", "prefix_eviction_args", "offload_placement_args")
DICT_ARGS = PLUGIN_ARGS + ("offload_args",)  # mappings of parameters (offload_args: the tiers', not a plugin's)
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


class EngineOptionError(ConfigError):
    """A wrong engine option: `key` is the option, `problem` what is wrong with it."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
        self.key, self.problem = key, problem


def parse_bytes(value: int | float | str) -> int:
    """64 * 2**20, "64MiB", "1.5 GiB", "500MB" -> bytes; ValueError for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a size (examples: 268435456, '256MiB', '1GiB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"  # packaged name, local folder, .gguf file, random:<shape> or hub id
    block_size: int = 16  # tokens per KV block, one of ALLOWED_BLOCK_SIZES
    allocator: str = "paged"  # registered allocator name
    allocator_args: dict[str, Any] = field(default_factory=dict)  # the allocator's dataclass parameters
    kv_cache_memory: int | float | str = "256MiB"  # byte budget of the whole KV pool (all layers, K and V)
    max_num_seqs: int = 256  # running sequences at most
    max_num_batched_tokens: int = 512  # tokens computed per step at most (prefill chunks + decodes)
    max_prefill_chunk: int | None = None  # prompt tokens one sequence computes per step at most (None: the step's
    # budget); under a policy compressing per chunk (when="chunk") admission counts its compressed prompt + one chunk
    max_model_len: int | None = None  # longest sequence; None: the model's context (longer than it: refused)
    policy: str = "full"  # registered eviction/compression policy
    policy_args: dict[str, Any] = field(default_factory=dict)
    quant: str = "auto"  # registered cache format
    quant_args: dict[str, Any] = field(default_factory=dict)
    draft: str | None = None  # registered draft model (speculative decoding), None = off
    draft_args: dict[str, Any] = field(default_factory=dict)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # model compute dtype
    device: str = "cpu"  # torch device of the model and the KV pool
    seed: int = 0  # sampling seed (and the random:* models' weights), an integer in [0, 2**63)
    kernel_backend: Literal["auto", "torch", "triton"] = "auto"  # auto: triton on CUDA tensors, on CPU the native
    # decode attention (kvlab.kernels.cpu, g++ on first use; KVLAB_CPU_KERNELS=0: off) and torch for the rest; torch:
    # the torch reference everywhere; triton on a CPU device only under Triton's interpreter (TRITON_INTERPRET=1)
    enable_prefix_caching: bool = False  # share full pages of common prefixes between requests (hashed)
    prefix_match: Literal["page", "token"] = "page"  # token: also share a cached page's first tokens (copied on write)
    prefix_cache: Literal["hash", "radix"] = "hash"  # the index of cached pages: hashed blocks | radix tree (always token-granular)
    prefix_eviction: str = "lru"  # registered prefix-cache eviction policy (which cached-free page goes first)
    prefix_eviction_args: dict[str, Any] = field(default_factory=dict)  # its dataclass parameters
    # with prefix caching and a compressing policy: True shares a hit's pages and keeps them whole when the request
    # is compressed (their memory is not spent again; what a request keeps then depends on its hit, a declared
    # deviation); False gives a request that hits its own copy of the hit's pages, compressed as without caching
    # (exact: the hit saves the prefill, not the memory)
    prefix_keep_shared: bool = True
    # every row of a forward pass computed alike (linear layers in fixed tiles, attention a row at a time, a residual
    # window read in token time): a rounding format's outputs stop depending on batching, chunking, preemption and
    # drafts, at a cost in speed (kvlab/engine/batch_invariant.py); off by default
    batch_invariant: bool = False
    # with a compressing policy: keep a finished request's compressed cache (its tables, the policy's state) for a
    # request whose prompt starts with its prompt + output (the conversation's next turn), which then computes only
    # its new tokens; outputs then depend on the hit (kvlab/cache/kept_turns.py); off by default
    reuse_compressed: bool = False
    reuse_compressed_max_turns: int = 64  # most finished turns kept (the least recently used goes first, or under pool pressure)
    # tiers below the pool (with prefix caching): pages evicted from the prefix cache go to host memory and/or disk and
    # come back on a hit instead of being recomputed (kvlab/cache/tiers/); None: off
    offload: Literal["host", "disk", "host_disk"] | None = None
    offload_args: dict[str, Any] = field(default_factory=dict)  # kvlab.cache.tiers.offload.OffloadArgs: memory, disk_memory, path, clean_stale, async_reads, async_writes
    offload_placement: str = "lru"  # registered placement (kvlab.registry.PLACEMENTS): which tier a page goes to, which leaves
    offload_placement_args: dict[str, Any] = field(default_factory=dict)  # its dataclass parameters
    # the linear layers' weight layout (kvlab/engine/linear_layout.py): auto fuses the projections that read one input
    # (q/k/v, gate/up) into one matrix product each; none keeps the model's own modules. Off by default
    linear_layout: Literal["none", "auto"] = "none"
    # who computes the linear layers (kvlab/engine/linear_backend.py): torch (F.linear); cpu runs kvlab's CPU kernel for
    # passes of <= 256 rows (decode, verification: each weight read once for the batch; every pass under
    # batch_invariant), torch for longer prefill chunks. cpu needs device cpu; without a compiler or AVX-512 it warns
    # once and runs torch. auto (the default): cpu on the CPU, torch on other devices
    # (faster than torch in all 8 cells of experiments/results/decode_roof_smollm2_linear_quiet.md, 1.3-2.3x)
    linear_backend: Literal["auto", "torch", "cpu"] = "auto"

    def __post_init__(self) -> None:
        for name in DICT_ARGS:
            if getattr(self, name) is None:
                setattr(self, name, {})
        for name, (annotation, _) in fields_of(type(self)).items():
            ok, _ = fits(getattr(self, name), annotation)
            if not ok:
                raise EngineOptionError(name, type_problem(getattr(self, name), annotation))
        if self.block_size not in ALLOWED_BLOCK_SIZES:
            raise EngineOptionError("block_size", f"{self.block_size} is not allowed; choose one of {ALLOWED_BLOCK_SIZES}")
        try:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        except ValueError as exc:
            raise EngineOptionError("kv_cache_memory", str(exc)) from None
        if self.kv_cache_memory <= 0:
            raise EngineOptionError("kv_cache_memory", f"must be positive, got {self.kv_cache_memory}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "reuse_compressed_max_turns"):
            if getattr(self, name) < 1:
                raise EngineOptionError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise EngineOptionError("max_prefill_chunk", f"must be >= 1 or None, got {self.max_prefill_chunk}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise EngineOptionError("max_model_len", f"must be >= 2 or None, got {self.max_model_len}")
        if not 0 <= self.seed < MAX_SEED:
            raise EngineOptionError("seed", f"must be an integer in [0, 2**63), got {self.seed}")
        for name in DICT_ARGS:
            setattr(self, name, dict(getattr(self, name)))
        for key, problem in (("device", device_problem(self.device)),
                             ("kernel_backend", backend_problem(self.kernel_backend, self.device)),
                             ("linear_backend", linear_backend_problem(self.linear_backend, self.device))):
            if problem:
                raise EngineOptionError(key, problem)
        self._check_policy_budget()

    def _check_policy_budget(self) -> None:
        """A compressing policy given neither a budget nor a compression_ratio keeps every token while it
        reads as compressed: refused (a policy's own parameter errors are raised here too, unchanged)."""
        from kvlab.registry import POLICIES

        policy = POLICIES.build(self.policy, **self.policy_args)
        if policy.compresses and policy.budget is None and policy.compression_ratio is None:
            raise EngineOptionError("policy_args", f"policy {self.policy!r} needs a budget (tokens kept per layer, "
                                    f"e.g. budget: 256) or a compression_ratio (fraction removed, e.g. "
                                    f"compression_ratio: 0.5); with neither it would keep every token (that is "
                                    f"policy 'full')")


def device_problem(device: str) -> str | None:
    """Why torch cannot place the model on `device` here, or None."""
    if device == "cpu":
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        return f"{device!r} is not a torch device ({exc})"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            return f"{device!r}: CUDA is not available here ({why}); use device='cpu'"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"{device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
        return None
    module = getattr(torch.backends, dev.type, None) or getattr(torch, dev.type, None)
    if dev.type != "cpu" and hasattr(module, "is_available") and not module.is_available():
        return f"{device!r}: {dev.type} is not available here; use device='cpu'"
    return None


def linear_backend_problem(backend: str, device: str) -> str | None:
    """Why the linear backend cannot run on `device`, or None: the `cpu` kernel reads CPU tensors only."""
    if backend == "cpu" and device.split(":")[0] != "cpu":
        return f"'cpu' runs kvlab's CPU kernel, and the model is on {device!r}; use linear_backend='torch'"
    return None


def backend_problem(backend: str, device: str) -> str | None:
    """Why the kernel backend cannot run on `device`, or None: Triton needs to be installed, and on a CPU
    device runs only under its interpreter (TRITON_INTERPRET=1 set before the kernels are imported)."""
    cuda = device.split(":")[0] == "cuda"
    if backend == "torch" or (backend == "auto" and not cuda):
        return None
    if importlib.util.find_spec("triton") is None:
        return f"{backend!r} runs Triton kernels on {device!r}, and Triton is not installed; use kernel_backend='torch'"
    if not cuda and os.environ.get("TRITON_INTERPRET", "0").lower() in ("", "0", "false", "off", "no"):
        return (f"'triton' on device {device!r} runs only under Triton's interpreter (set TRITON_INTERPRET=1 before "
                f"kvlab's kernels are imported: kernel tests); use kernel_backend='torch', or 'auto' (Triton on "
                f"CUDA, torch on CPU)")
    return None

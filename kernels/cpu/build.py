"""Build the CPU kernels on first use: g++ with OpenMP into a cache folder, loaded with ctypes.

The shared library is keyed by a hash of the source, the compiler flags, the compiler's version and the
CPU's instruction-set flags (it is built with -march=native), so an edited source, another compiler or
another machine builds its own copy and never loads a stale one. The folder is $KVLAB_CPU_KERNEL_CACHE,
else ~/.cache/kvlab/cpu_kernels. A build writes a temporary file and renames it into place, so processes
building at once never load a half-written library.

    lib = load_library()   # ctypes.CDLL, or None (one warning) when no compiler or the build fails
    lib = load_linear_library()   # the same for linear.cpp (needs AVX-512: elsewhere the build fails, one warning)
    lib = load_layer_ops_library()   # the same for layer_ops.cpp (the lean forward's RMSNorm and RoPE)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

SOURCE = Path(__file__).with_name("decode_attention.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-Wno-maybe-uninitialized")
ABI_VERSION = 4  # kvlab_abi_version() of decode_attention.cpp
LINEAR_SOURCE = Path(__file__).with_name("linear.cpp")
LINEAR_ABI_VERSION = 2  # kvlab_linear_abi_version() of linear.cpp
LAYER_OPS_SOURCE = Path(__file__).with_name("layer_ops.cpp")
LAYER_OPS_ABI_VERSION = 1  # kvlab_layer_ops_abi_version() of layer_ops.cpp
EXTRA_FLAGS = {"layer_ops": ("-ffp-contract=off",)}  # per source stem: layer_ops.cpp keeps torch's separate roundings


def enabled() -> bool:
    """kvlab's CPU kernels run unless KVLAB_CPU_KERNELS=0 (read on every call; every launcher asks this one)."""
    return os.environ.get("KVLAB_CPU_KERNELS", "1") != "0"


def cache_dir() -> Path:
    return Path(os.environ.get("KVLAB_CPU_KERNEL_CACHE") or Path.home() / ".cache" / "kvlab" / "cpu_kernels")


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def flags_for(source: Path) -> tuple[str, ...]:
    """The compiler flags of `source`: FLAGS, then its own (EXTRA_FLAGS)."""
    return (*FLAGS, *EXTRA_FLAGS.get(source.stem, ()))


def library_path(cxx: str, source: Path | None = None) -> Path:
    """Where `source` (default SOURCE, read at call time) compiled by `cxx` lives in the cache folder."""
    source = SOURCE if source is None else source
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(flags_for(source)).encode(), _compiler_version(cxx).encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:20]}.so"


def build(cxx: str, target: Path, source: Path | None = None) -> None:
    """Compile `source` (default SOURCE) into `target` (atomically); raises RuntimeError with the compiler's
    message on failure."""
    source = SOURCE if source is None else source
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *flags_for(source), "-o", tmp, str(source)], capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{cxx} failed on {source.name}:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL | None:
    """The compiled decode-attention kernels (built first when missing), or None after one warning."""
    return load_source(SOURCE, ABI_VERSION, "kvlab_abi_version", "CPU decode attention runs")  # SOURCE read now


@lru_cache(maxsize=None)
def load_linear_library() -> ctypes.CDLL | None:
    """The compiled small-batch linear kernel (linear.cpp), or None after one warning."""
    return load_source(LINEAR_SOURCE, LINEAR_ABI_VERSION, "kvlab_linear_abi_version", "CPU linear layers run")


@lru_cache(maxsize=None)
def load_layer_ops_library() -> ctypes.CDLL | None:
    """The compiled element-wise layer ops (layer_ops.cpp), or None after one warning."""
    return load_source(LAYER_OPS_SOURCE, LAYER_OPS_ABI_VERSION, "kvlab_layer_ops_abi_version",
                       "the lean forward's norms and rotary embedding run")


def load_source(source: Path, abi_version: int, abi_symbol: str, what: str) -> ctypes.CDLL | None:
    """`source` compiled (built first when missing) and checked by its `abi_symbol()`, or None after one
    warning saying that `what` (a subject and its verb) the torch reference."""
    cxx = compiler()
    if cxx is None:
        warnings.warn(f"kvlab: no C++ compiler (g++) found: {what} the torch reference",
                      RuntimeWarning, stacklevel=2)
        return None
    try:
        target = library_path(cxx, source)
        if not target.exists():
            build(cxx, target, source)
        lib = ctypes.CDLL(str(target))
        found = getattr(lib, abi_symbol)()
        if found != abi_version:
            raise RuntimeError(f"{target} has ABI {found}, expected {abi_version}")
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        warnings.warn(f"kvlab: CPU kernels unavailable ({e}): {what} the torch reference",
                      RuntimeWarning, stacklevel=2)
        return None
    return lib

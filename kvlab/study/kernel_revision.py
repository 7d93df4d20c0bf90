"""The CPU decode-attention kernel of another git revision, built like this checkout's, for same-run comparisons.

    fn = kernel_at("a2790e0")   # ctypes function with the current launcher's argument types
    with kernel_swapped(fn): ...   # the launcher (kvlab.kernels.cpu.decode_attention) runs `fn` meanwhile

The revision's kernels/cpu/decode_attention.cpp is compiled with this checkout's flags into the kernel cache
(kvlab.kernels.cpu.build, keyed by the source); an older ABI ignores the arguments it does not know.
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

from kvlab.study.bench_io import REPO


def kernel_at(rev: str):
    """kvlab_decode_attention of decode_attention.cpp at git revision `rev`."""
    from kvlab.kernels.cpu import build
    from kvlab.kernels.cpu import decode_attention as cpu

    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:kernels/cpu/decode_attention.cpp"],
                            capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "decode_attention.cpp"
        path.write_text(source)
        target = build.library_path(build.compiler(), path)
        if not target.exists():
            build.build(build.compiler(), target, path)
    fn = ctypes.CDLL(str(target)).kvlab_decode_attention
    fn.argtypes, fn.restype = cpu._kernel().argtypes, ctypes.c_int
    return fn


@contextmanager
def kernel_swapped(fn):
    """The launcher calls `fn` instead of its own kernel inside the block (None: its own)."""
    from kvlab.kernels.cpu import decode_attention as cpu

    current = cpu._kernel
    if fn is not None:
        cpu._kernel = lambda: fn
    try:
        yield
    finally:
        cpu._kernel = current

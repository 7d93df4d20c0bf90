"""The CPU decode attention where no C++ compiler is installed: one warning, then the torch reference runs.

This module needs no compiler and always runs (tests/kernels/test_cpu_decode_attention.py builds the kernels and
is skipped without one). "No compiler" is a PATH without g++ and no $CXX, as on such a machine, with an empty
kernel cache and the launchers' memos cleared before and after each test.
"""

import warnings

import pytest
import torch

from kvlab.kernels import ops
from kvlab.kernels.attention_plan import plan_paged_attention
from kvlab.kernels.cpu import build
from kvlab.kernels.cpu import decode_attention as cpu
from kvlab.kernels.reference import paged_attention as ref_module
from kvlab.kernels.reference.paged_attention import paged_attention_ref
from kvlab.kernels.testing import make_paged_batch

WARNING = "no C++ compiler (g++) found"


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """No g++ on PATH, no $CXX; the reference's calls are counted (the list returned)."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("KVLAB_CPU_KERNELS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder
    monkeypatch.setenv("KVLAB_CPU_KERNEL_CACHE", str(tmp_path / "cache"))
    calls = []
    reference = ref_module.run_paged_attention
    monkeypatch.setattr(ref_module, "run_paged_attention", lambda q, *a, **k: calls.append(q.shape[0]) or
                        reference(q, *a, **k))
    build.load_library.cache_clear()
    cpu._kernel.cache_clear()
    assert build.compiler() is None
    yield calls
    build.load_library.cache_clear()  # the next caller builds or loads the library with the real PATH
    cpu._kernel.cache_clear()


def compiler_warnings(seen) -> int:
    return sum(WARNING in str(w.message) for w in seen)


def test_no_compiler_falls_back_to_the_reference_with_one_warning(no_compiler):
    """The launcher, called twice, warns once and returns the reference's output; the kernel is unavailable."""
    batch = make_paged_batch([1, 1], [9, 40], 2, 3, 64, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not cpu.available()
        got = [cpu.paged_attention(*batch.args()) for _ in range(2)]
        assert build.load_library() is None
    assert compiler_warnings(seen) == 1
    assert no_compiler == [2, 2]  # the reference ran both calls, on every row
    want = paged_attention_ref(*batch.args())
    for out in got:
        torch.testing.assert_close(out, want)


def test_auto_backend_without_a_compiler_runs_the_reference(no_compiler):
    """ops' `auto` dispatch on CPU tensors, the engine's path, falls back alike: one warning over several calls."""
    batch = make_paged_batch([1, 1], [5, 40], 2, 3, 64, 16)
    plan = plan_paged_attention(batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist(), batch.block_tables.tolist(),
                                16)
    with warnings.catch_warnings(record=True) as seen, ops.backend("auto"):
        warnings.simplefilter("always")
        got = [ops.run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale) for _ in range(3)]
    assert compiler_warnings(seen) == 1
    assert no_compiler == [2, 2, 2]
    want = paged_attention_ref(*batch.args())
    for out in got:
        torch.testing.assert_close(out, want)

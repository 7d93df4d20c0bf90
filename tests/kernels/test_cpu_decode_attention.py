"""The native CPU decode attention (kvlab.kernels.cpu) against the torch reference.

Pairwise grid: head ratios 1/2/3/4, head_dim 64/128, block sizes 1/4/16/32, every element-wise pool dtype
(fp32, bf16, fp16, fp8 with per-head scales), sliding window, soft-capping, lengths 1, block boundary +-1 and
past the kernel's key chunk (its split-K path); packed int8 / int4 / int2 / fp8-per-token pages with residual
rows of their own and leased ones; mixed decode + extend steps; the dispatch; the engine. Needs a C++ compiler
(skipped without one); the fallback where there is none: tests/kernels/test_cpu_kernel_fallback.py.
"""

import os

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.cache.block_manager import LayerGroup
from kvlab.cache.kv_cache import KVCache
from kvlab.engine.attention import leaving_window
from kvlab.kernels import ops
from kvlab.kernels.attention_plan import plan_paged_attention
from kvlab.kernels.cpu import build
from kvlab.kernels.cpu import decode_attention as cpu
from kvlab.kernels.reference import paged_attention as ref_module
from kvlab.kernels.reference.paged_attention import paged_attention_ref
from kvlab.kernels.testing import CACHE_DTYPES, attention_tolerance, make_paged_batch
from kvlab.models import load_model
from kvlab.registry import build as build_plugin

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler: the CPU kernels fall back")

CASES = [
    # id, group, head_dim, block_size, cache, window, softcap, q dtype
    ("r1-d64-b16-fp32", 1, 64, 16, "fp32", None, None, torch.float32),
    ("r3-d64-b1-bf16-win", 3, 64, 1, "bf16", 5, None, torch.float32),
    ("r4-d128-b32-fp16-cap", 4, 128, 32, "fp16", None, 20.0, torch.float32),
    ("r2-d64-b16-e4m3-win", 2, 64, 16, "fp8_e4m3", 17, None, torch.float32),
    ("r3-d128-b4-e5m2-cap", 3, 128, 4, "fp8_e5m2", None, 5.0, torch.float32),
    ("r3-d64-b16-fp32-win-cap", 3, 64, 16, "fp32", 300, 30.0, torch.float32),
    ("r4-d64-b16-bf16-bf16q", 4, 64, 16, "bf16", 9, None, torch.bfloat16),
    ("r1-d128-b32-fp32-fp16q", 1, 128, 32, "fp32", None, None, torch.float16),
    ("r2-d40-b16-bf16-cap", 2, 40, 16, "bf16", None, 10.0, torch.float32),  # head_dim not a multiple of 16
]


def decode_lengths(bs: int) -> list[int]:
    """1, block boundary +-1, and longer than the kernel's key chunk (several partials to reduce)."""
    return [1, max(bs - 1, 1), bs, bs + 1, 2 * bs + 1, cpu.CHUNK_KEYS * 2 + 3]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decode_matches_reference(case):
    _, g, d, bs, cache, window, softcap, q_dtype = case
    seq_lens = decode_lengths(bs)
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, 2, g, d, bs, CACHE_DTYPES[cache], q_dtype,
                             sliding_window=window)
    poisoned = torch.full_like(batch.q, float("nan"))
    got = cpu.paged_attention(*batch.args(), window, softcap, batch.k_scale, batch.v_scale, out=poisoned)
    want = paged_attention_ref(*batch.args(), window, softcap, batch.k_scale, batch.v_scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **attention_tolerance(q_dtype))


@pytest.mark.parametrize("window", [None, 6])
def test_mixed_step_runs_decode_rows_in_the_kernel_and_extend_rows_on_the_reference(window, monkeypatch):
    """Decode rows beside a prefill chunk (longer than MAX_KERNEL_Q: the reference) and a short verification
    chunk (the kernel, one row per query: tests/kernels/test_cpu_multirow_attention.py): every token's output
    equals the reference's."""
    bs, long = 4, cpu.MAX_KERNEL_Q + 1
    q_lens, seq_lens = [1, long, 1, 3], [2 * bs + 1, long + bs, 3 * bs, bs + 3]
    batch = make_paged_batch(q_lens, seq_lens, 2, 3, 64, bs, torch.bfloat16, sliding_window=window)
    want = paged_attention_ref(*batch.args(), window, None, return_stats=True)
    calls = []
    reference = ref_module.run_paged_attention
    monkeypatch.setattr(ref_module, "run_paged_attention", lambda q, *a, **k: calls.append(q.shape[0]) or
                        reference(q, *a, **k))
    got = cpu.paged_attention(*batch.args(), window, None, out=torch.full_like(batch.q, float("nan")),
                              return_stats=True)
    assert calls == [long]  # the reference saw the long chunk's tokens only
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **attention_tolerance(torch.float32))


@pytest.mark.parametrize("cache,window,softcap,stats_window", [("fp32", None, None, None), ("bf16", 7, 10.0, 1),
                                                                 ("fp16", None, None, 0), ("fp8_e4m3", 300, None, 2)])
def test_attention_statistics_of_decode_rows_come_from_the_kernel(cache, window, softcap, stats_window, monkeypatch):
    """The mass every key received (summed over a KV head's query heads): the kernel's, never the reference's."""
    lens = [1, 17, cpu.CHUNK_KEYS * 2 + 3, 40]
    batch = make_paged_batch([1] * len(lens), lens, 2, 3, 64, 16, CACHE_DTYPES[cache], sliding_window=window)
    batch.block_tables[3, 1] = -1  # a released page
    args = (*batch.args(), window, softcap, batch.k_scale, batch.v_scale)
    want = paged_attention_ref(*args, return_stats=True, stats_window=stats_window)
    from kvlab.kernels.reference import attention_stats

    monkeypatch.setattr(attention_stats, "attention_stats_from_plan", None)  # the reference's would fail
    stats_out = torch.full((len(lens), 2, max(lens)), float("nan"))
    got = cpu.paged_attention(*args, return_stats=True, stats_window=stats_window, stats_out=stats_out)
    assert got[1] is stats_out
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **attention_tolerance(torch.float32))
    assert (stats_out.sum(-1) > 0.5).all() == (stats_window != 0)


@pytest.mark.parametrize("starts", [False, True], ids=["tree", "tree-starts"])
def test_tree_steps_run_unmasked_decode_rows_in_the_kernel(starts, monkeypatch):
    """A token-tree step: its decode rows run the kernel (bit-identical to the same rows in a step without a tree)
    unless the mask hides one of their keys; tree rows and masked decode rows run the reference with their mask rows."""
    bs = 4
    q_lens, seq_lens = [1, 5, 1, 3, 1], [2 * bs + 1, 3 * bs + 2, cpu.CHUNK_KEYS + 7, bs + 3, 3]
    batch = make_paged_batch(q_lens, seq_lens, 2, 3, 64, bs, tree=True, tree_starts=starts, seed=3)
    cu, tables, mask = batch.cu_seqlens_q.tolist(), batch.block_tables, batch.tree_mask
    masked = []
    if starts:  # decode rows 0 and 4 see every key from their tree start; row 2 does not see its first one
        for b in (0, 4):
            mask[cu[b], : seq_lens[b] - batch.tree_starts[b]] = True
        mask[cu[2], 0], masked = False, [2]
    plan = plan_paged_attention(cu, seq_lens, tables, bs, tree_mask=mask, tree_starts=batch.tree_starts)
    want = ref_module.run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale)
    calls = []
    reference = ref_module.run_paged_attention
    monkeypatch.setattr(ref_module, "run_paged_attention", lambda q, *a, **k: calls.append(q.shape[0]) or
                        reference(q, *a, **k))
    got = cpu.run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale)
    assert calls == [5 + 3 + len(masked)]  # the reference saw the tree rows and the masked decode row only
    torch.testing.assert_close(got, want, **attention_tolerance(torch.float32))
    alone = cpu.run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan_paged_attention(cu, seq_lens, tables,
                                                                                                 bs), batch.scale)
    for b in {0, 2, 4} - set(masked):
        assert torch.equal(got[cu[b]], alone[cu[b]]), b


@pytest.mark.parametrize("cache,softcap", [("fp32", None), ("bf16", None), ("fp32", 10.0)])
def test_released_pages_are_never_read(cache, softcap):
    """Pages an eviction policy released (-1 inside the table, not only before a window) are skipped."""
    bs, lens = 4, [30, 9, cpu.CHUNK_KEYS + 40]
    batch = make_paged_batch([1] * len(lens), lens, 2, 2, 64, bs, CACHE_DTYPES[cache])
    batch.block_tables[0, 2] = batch.block_tables[0, 5] = batch.block_tables[1, 0] = -1
    batch.block_tables[2, 1:cpu.CHUNK_KEYS // bs + 3] = -1  # a whole key chunk released
    got = cpu.paged_attention(*batch.args(), None, softcap)
    want = paged_attention_ref(*batch.args(), None, softcap)
    torch.testing.assert_close(got, want, **attention_tolerance(torch.float32))


def test_a_row_reads_the_same_whatever_else_the_batch_holds():
    """Key chunks sit at fixed cache indices: a row alone and the same row in a batch agree to the bit."""
    bs, lens = 16, [cpu.CHUNK_KEYS * 3 + 5, 40, 700, 1, 33]
    batch = make_paged_batch([1] * len(lens), lens, 2, 3, 64, bs)
    together = cpu.paged_attention(*batch.args())
    for b in range(len(lens)):
        alone = cpu.paged_attention(batch.q[b : b + 1], batch.k_cache, batch.v_cache, batch.block_tables[b : b + 1],
                                    torch.tensor([0, 1]), batch.seq_lens[b : b + 1], batch.scale)
        assert torch.equal(alone[0], together[b]), b


HKV, D, BS = 2, 64, 32


class ListLessor:
    """Leases pool pages from a fixed list (never a table's), out of order (the engine's: kvlab.cache.quant.lease)."""

    def __init__(self, pages):
        self.free, self.leases, self._n = list(pages), {}, 0

    def lease(self, n):
        if len(self.free) < n:
            return None
        self._n += 1
        self.leases[-self._n] = [self.free.pop(0) for _ in range(n)][::-1]
        return -self._n, self.leases[-self._n]

    def give_back(self, key):
        self.free.extend(self.leases.pop(key))

    def held(self):
        return lambda page: page <= 6


def filled_cache(name, args, lessor=None, bs=BS):
    """Three sequences written into a packed pool: sealed pages, open pages (residual rows) and a short one."""
    torch.manual_seed(4)
    quant = build_plugin("quant", name, **args)
    lens = [50, 70, 3]
    per = [-(-n // bs) for n in lens]
    tables = [list(range(1 + sum(per[:i]), 1 + sum(per[: i + 1]))) for i in range(3)]
    cache = KVCache([LayerGroup((0,))], sum(per) + 2 if lessor is None else 300, bs, HKV, D, quant, torch.float32,
                    "cpu", lessor=lessor)
    for table, n in zip(tables, lens):
        index = torch.arange(n)
        slots = torch.tensor(table)[index // bs] * bs + index % bs
        seal = leaving_window([table], [n], [n], getattr(quant, "residual", None) or 0, bs)
        x = torch.randn(n, HKV, D)
        cache.begin_step([slots], None if cache.residual is None else [seal])
        cache.store(0, x * 2, x.flip(-1), slots)
    width = max(per)
    return cache, torch.tensor([t + [-1] * (width - len(t)) for t in tables]), torch.tensor(lens)


PACKED = [
    ("int8", {}, False),
    ("int4", {"residual": BS}, False),
    ("int4", {"residual": BS, "residual_dtype": "bfloat16"}, True),
    ("int2", {"residual": BS, "group_size": 8}, True),
    ("fp8_e4m3", {}, False),
]


@pytest.mark.parametrize("name,args,leased", PACKED, ids=[f"{n}-{'leased' if l else 'own'}-{i}" for i, (n, a, l)
                                                          in enumerate(PACKED)])
def test_packed_pages_dequantised_in_the_kernel(name, args, leased):
    cache, tables, lens = filled_cache(name, args, ListLessor(range(10, 100)) if leased else None)
    assert cache.residual is None or cache.area.open_pages()  # some pages are read from residual rows
    q = torch.randn(3, 4, D)
    cu = torch.tensor([0, 1, 2, 3])
    got = cpu.paged_attention(q, cache.k(0), cache.v(0), tables, cu, lens, 0.125, sliding_window=60)
    want = paged_attention_ref(q, cache.k(0), cache.v(0), tables, cu, lens, 0.125, sliding_window=60)
    torch.testing.assert_close(got, want, **attention_tolerance(torch.float32))


PACKED_GRID = [  # every block size with each packed kind the kernel reads in registers (int8, fp8) or decodes (KIVI)
    (name, args, bs) for bs in (1, 4, 16, 32) for name, args in
    [("int8", {}), ("fp8_e4m3", {}), ("fp8_e5m2", {})]
    + ([("int4", {"residual": bs, "group_size": bs})] if bs >= 4 else [])
]


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("name,args,bs", PACKED_GRID,
                         ids=[f"{n}-b{bs}-{'res' if a.get('residual') else 'sealed'}" for n, a, bs in PACKED_GRID])
def test_packed_pages_at_every_block_size(name, args, bs, window):
    """int8 / fp8 codes widened in registers (their scales on the scores and weights), KIVI pages and their open
    pages' residual rows decoded: each against the reference, with and without a window."""
    cache, tables, lens = filled_cache(name, args, bs=bs)
    q = torch.randn(3, 4, D)
    cu = torch.tensor([0, 1, 2, 3])
    got = cpu.paged_attention(q, cache.k(0), cache.v(0), tables, cu, lens, 0.125, sliding_window=window)
    want = paged_attention_ref(q, cache.k(0), cache.v(0), tables, cu, lens, 0.125, sliding_window=window)
    torch.testing.assert_close(got, want, **attention_tolerance(torch.float32))


def test_bf16_queries_on_a_bf16_pool_match_the_reference():
    """bf16 queries over a bf16 pool: scored with VDPBF16PS pairs where the CPU has it (the engine's bf16 steps)."""
    batch = make_paged_batch([1] * 5, [1, 17, 64, 300, 600], 3, 3, 64, 16, torch.bfloat16, torch.float32)
    q32 = batch.q.bfloat16().float()  # bf16 values held in float32: the kernel's exact-bf16 check takes them
    got = cpu.paged_attention(q32, *batch.args()[1:])
    want = paged_attention_ref(q32, *batch.args()[1:])
    torch.testing.assert_close(got, want, **attention_tolerance(torch.float32))


def test_ops_dispatch_runs_the_kernel_unless_turned_off(monkeypatch):
    """`auto` on CPU tensors runs the kernel; KVLAB_CPU_KERNELS=0 and the `torch` backend run the reference."""
    batch = make_paged_batch([1, 1], [5, 40], 2, 3, 64, 16)
    plan = plan_paged_attention(batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist(), batch.block_tables.tolist(),
                                16)
    kernel = cpu._kernel()
    calls = []
    monkeypatch.setattr(cpu, "_kernel", lambda: (lambda *a: calls.append(1) or kernel(*a)))
    with ops.backend("auto"):
        ops.run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale)
        assert calls == [1]
        monkeypatch.setenv("KVLAB_CPU_KERNELS", "0")
        ops.run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale)
        assert calls == [1]
        monkeypatch.delenv("KVLAB_CPU_KERNELS")
    with ops.backend("torch"):
        ops.run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale)
    assert calls == [1]


def test_the_kernel_keeps_no_pool_alive():
    """A pool the kernel read is freed with its engine: the launcher's per-pool reading is held weakly (a strong
    reference there kept every engine's pool, 256 MiB each by default, until the process ended)."""
    import gc
    import weakref

    batch = make_paged_batch([1, 1], [5, 40], 2, 3, 64, 16)
    plan = plan_paged_attention(batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist(), batch.block_tables.tolist(),
                                16)
    with ops.backend("auto"):
        ops.run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale)
    assert id(batch.k_cache) in cpu._sides, "the kernel did not read the pool"
    pools = [weakref.ref(batch.k_cache), weakref.ref(batch.v_cache)]
    del batch
    gc.collect()
    assert [p() for p in pools] == [None, None], "the kernel's launcher keeps a pool alive"


def test_library_is_keyed_by_its_source(monkeypatch, tmp_path):
    """An edited source builds (and loads) a library of its own in the cache folder."""
    monkeypatch.setenv("KVLAB_CPU_KERNEL_CACHE", str(tmp_path))
    cxx = build.compiler()
    first = build.library_path(cxx)
    source = tmp_path / "decode_attention.cpp"
    source.write_text(build.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(build, "SOURCE", source)
    second = build.library_path(cxx)
    assert first.parent == second.parent == tmp_path and first != second
    build.build(cxx, second)
    assert second.is_file() and not [p for p in tmp_path.iterdir() if p.name.startswith("tmp")]


@pytest.mark.parametrize("name,quant,args", [("random:llama-tiny", "auto", {}), ("random:gemma3-tiny", "bf16", {}),
                                             ("random:llama-tiny", "int4", {"group_size": 8, "residual": 8})])
def test_engine_generates_what_the_reference_backend_does(name, quant, args, monkeypatch):
    """Prefill chunks, mixed steps and decode on the kernel against kernel_backend='torch'."""
    kernel, calls = cpu._kernel(), []
    monkeypatch.setattr(cpu, "_kernel", lambda: (lambda *a: calls.append(1) or kernel(*a)))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (37, 9, 1)]
    outputs = {}
    previous = ops.get_backend()
    try:
        for backend in ("torch", "auto"):
            llm = LLM(name, loaded=load_model(name), block_size=8, kv_cache_memory="2MiB", quant=quant,
                      quant_args=args, kernel_backend=backend, max_num_batched_tokens=16)
            outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
            outputs[backend] = [o.token_ids for o in outs]
            assert bool(calls) == (backend == "auto"), backend  # the kernel ran on `auto` only
    finally:
        ops.set_backend(previous)
    assert outputs["auto"] == outputs["torch"]


def test_a_build_without_avx512_or_f16c_matches_the_reference(monkeypatch, tmp_path):
    """The portable paths (lane-tree dot, scalar exp / max / accumulation, fp16 by bits, unpacking by shifts)
    that a machine without AVX-512 or F16C runs: built for baseline x86-64 and checked like the native build."""
    native = [f for f in build.FLAGS if f.startswith("-march")]
    monkeypatch.setattr(build, "FLAGS", tuple("-march=x86-64" if f in native else f for f in build.FLAGS))
    monkeypatch.setenv("KVLAB_CPU_KERNEL_CACHE", str(tmp_path))
    build.load_library.cache_clear()
    cpu._kernel.cache_clear()
    try:
        assert cpu.available() and list(tmp_path.glob("*.so"))
        for cache, g, d, bs, window, softcap in (("fp16", 3, 64, 16, 17, None), ("bf16", 2, 40, 4, None, 5.0),
                                                  ("fp32", 1, 64, 1, None, None)):
            seq_lens = decode_lengths(bs)
            batch = make_paged_batch([1] * len(seq_lens), seq_lens, 2, g, d, bs, CACHE_DTYPES[cache],
                                     sliding_window=window)
            got = cpu.paged_attention(*batch.args(), window, softcap, return_stats=True)  # output and statistics
            want = paged_attention_ref(*batch.args(), window, softcap, return_stats=True)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, **attention_tolerance(torch.float32))
        cache, tables, lens = filled_cache("int4", {"residual": BS})
        q, cu = torch.randn(3, 4, D), torch.tensor([0, 1, 2, 3])
        torch.testing.assert_close(cpu.paged_attention(q, cache.k(0), cache.v(0), tables, cu, lens, 0.125),
                                   paged_attention_ref(q, cache.k(0), cache.v(0), tables, cu, lens, 0.125),
                                   **attention_tolerance(torch.float32))
    finally:
        build.load_library.cache_clear()
        cpu._kernel.cache_clear()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings (Linux)")
def test_one_openmp_runtime_in_the_process():
    """The kernels are built with -fopenmp, so they need libgomp.so.1; torch ships its own copy under that
    soname and is loaded first, so the loader reuses it: one OpenMP runtime (two would each start a thread pool
    and oversubscribe the cores)."""
    assert build.load_library() is not None
    build.load_linear_library()
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes

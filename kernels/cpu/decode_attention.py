"""Launcher: paged decode attention on the CPU (decode_attention.cpp), beside the torch reference.

Same signatures as kvlab.kernels.reference.paged_attention. Decode rows (one query each) run the C++
kernel, which reads K/V straight from the pool through the block table (each cached byte once, online
softmax, the G query heads of a KV head sharing every decoded row; PagedAttention arXiv:2309.06180,
Flash-Decoding's split over key ranges). A short extend chunk (q_len <= MAX_KERNEL_Q: a verification pass of
k + 1 rows) whose tree mask, if any, hides none of its queries' causal keys runs the kernel too, as q_len decode
rows: query j reads cache indices [first_key_j, seq_len - q_len + j] (its causal prefix, its own sliding-window
start) through the sequence's table; for fp32 / bf16 / fp16 pools the chunk's rows that share a key chunk (and
its first key) run as one blocked work unit, each K/V row read once for all their query heads, each query keeping
its own softmax state and causal limit and getting the bits it gets decoded alone (other pools, or KVLAB_MQ_BLOCK=0:
the rows take turns key chunk by key chunk so a chunk read for one query is in cache for the next). The engine stores the pass's K/V before attending
(kvlab/engine/attention.py), so the drafted tokens' keys are in the pool. Longer chunks (prefill) and branching
token trees run the reference over a plan of their own, with their rows of a tree mask. A pool the kernel cannot
read runs the whole step on the reference. Attention statistics (`return_stats`): the kernel's for its rows (the
mass each key received, summed over the G query heads; a chunk's queries each into a row of their own, then
summed per sequence over its last `stats_window` queries, as the reference counts), the reference's for the
others.

MAX_KERNEL_Q = 16: measured at 16 sequences x 4096 keys fp32, SmolLM2's heads, one thread, the blocked kernel
took 0.21 of the reference's time at q_len 5 and 0.34 at q_len 16, 2.0x / 4.4x its own q_len-1 time
(experiments/results/verify_attention_cpu.md): 16 keeps the chunks where the kernel is clearly the faster
(verification's k + 1; prefill chunks are longer).

A row's keys are split at fixed cache indices (every CHUNK_KEYS), so its reduction order depends on the
row alone, never on the batch. The engine's batch-invariant mode still runs kvlab.kernels.reference.
row_attention (token-time reads of a residual window), not this kernel.

    out = run_paged_attention(q, k_cache, v_cache, plan, scale, softcap, k_scale, v_scale)
    enabled()  # False with KVLAB_CPU_KERNELS=0; the library is built on first use (kvlab.kernels.cpu.build)
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from functools import lru_cache

import torch

from kvlab.kernels.attention_plan import AttentionPlan, memo, plan_paged_attention
from kvlab.kernels.cpu.build import enabled, load_library
from kvlab.kernels.reference import paged_attention as _ref

CHUNK_KEYS = 256  # keys per work unit (Flash-Decoding split), fixed so a row's reduction order is its own
MAX_KERNEL_Q = 16  # extend chunks of at most this many queries (verification) run the kernel, one row per query
POOL_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # Side.fp8: the encoding the kernel widens in registers
PACKED_KINDS = {0: 10, 1: 11, 2: 12, 3: 13}  # PageCodec.layout() kind -> the kernel's kind
RES_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class _Side(ctypes.Structure):
    """struct Side of decode_attention.cpp: how to read one side (K or V) of the pool."""

    _fields_ = [
        ("kind", ctypes.c_int32), ("bits", ctypes.c_int32), ("group", ctypes.c_int32), ("res_dtype", ctypes.c_int32),
        ("data", ctypes.c_void_p), ("scale16", ctypes.c_void_p), ("zero16", ctypes.c_void_p),
        ("head_scale", ctypes.c_void_p), ("lut", ctypes.c_void_p),
        ("s_block", ctypes.c_int64), ("s_pos", ctypes.c_int64), ("s_head", ctypes.c_int64),
        ("res", ctypes.c_void_p), ("row_of", ctypes.c_void_p), ("lease", ctypes.c_void_p),
        ("res_k", ctypes.c_int64), ("res_chunk", ctypes.c_int64), ("fp8", ctypes.c_int32),
    ]


@lru_cache(maxsize=None)
def _kernel():
    lib = load_library()
    if lib is None:
        return None
    fn = lib.kvlab_decode_attention
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [p, i64, i64, p, i64, i64, ctypes.POINTER(_Side), ctypes.POINTER(_Side), p, i64, p, p, p,
                   i32, i32, i32, i32, i32, ctypes.c_float, ctypes.c_float, i32, i32, p, i64, p, p]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    return enabled() and _kernel() is not None


@lru_cache(maxsize=None)
def _fp8_lut(dtype: torch.dtype) -> torch.Tensor:
    """[256] float32: the value of every fp8 code of `dtype` (torch's own conversion)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


@dataclass
class _DecodeRows:
    """The plan's kernel rows (decode rows, and the rows of short extend chunks) as the kernel reads them, and
    the other extend rows as a plan of their own."""

    tokens: torch.Tensor  # [n] int32 packed query token of each kernel row
    rows: torch.Tensor  # [n] int64 the plan's row (sequence) of each kernel row
    seq_lens: torch.Tensor  # [n] int32 keys [first_key, seq_len) the row sees: its own causal prefix
    first_key: torch.Tensor  # [n] int32 first visible cache index (sliding window)
    tables: torch.Tensor  # [n, width] int32 (-1: released / padding)
    from_end: torch.Tensor | None  # [n] int64 q_len - j for query j (1: the last); None: one row per sequence
    group: torch.Tensor  # [n] int32 the plan's row again (the kernel runs a sequence's rows chunk by chunk)
    all_decode: bool  # every token is a kernel row
    extend_plan: AttentionPlan | None
    extend_tokens: torch.Tensor | None  # [m] int64 packed tokens of the extend rows
    extend_rows: torch.Tensor | None  # [e] int64 the plan's rows they are

    @property
    def one_per_sequence(self) -> bool:
        return self.from_end is None


def _decode_rows(plan: AttentionPlan) -> _DecodeRows:
    return memo(plan, "cpu.decode", _build_decode_rows)


def _unrestricted(plan: AttentionPlan, b: int) -> bool:
    """Whether every query of sequence b sees every key up to its own: no tree mask, or each of its mask rows
    shows all its columns up to the query's own (a chain; column j is cache index tree_start + j)."""
    if plan.tree_mask is None:
        return True
    n, lens = plan.q_lens[b], plan.seq_lens[b]
    start = plan.tree_starts[b] if plan.tree_starts is not None else lens - n
    rows = plan.tree_mask[plan.cu_seqlens_q[b] : plan.cu_seqlens_q[b + 1], : lens - start]  # [n, lens - start]
    own = torch.arange(lens - start, device=rows.device)[None, :] <= torch.arange(lens - start - n, lens - start,
                                                                                  device=rows.device)[:, None]
    return bool(rows[own].all())


def kernel_sequences(plan: AttentionPlan) -> list[int]:
    """The plan's rows the kernel runs: q_len in [1, MAX_KERNEL_Q], every query seeing its whole causal prefix."""
    return [b for b, n in enumerate(plan.q_lens) if 1 <= n <= MAX_KERNEL_Q and _unrestricted(plan, b)]


def _build_decode_rows(plan: AttentionPlan) -> _DecodeRows:
    q_lens, cu, lens, w = plan.q_lens, plan.cu_seqlens_q, plan.seq_lens, plan.sliding_window
    kernel = kernel_sequences(plan)
    chosen = set(kernel)
    extend = [b for b in range(len(q_lens)) if b not in chosen]  # long chunks, and rows a tree masks
    seq = [b for b in kernel for _ in range(q_lens[b])]  # query j of b: keys up to cache index lens - n + j
    local = [j for b in kernel for j in range(q_lens[b])]
    own_lens = [lens[b] - q_lens[b] + 1 + j for b, j in zip(seq, local)]
    tables = plan.block_tables
    if isinstance(tables, torch.Tensor):
        tables = tables.to(device="cpu", dtype=torch.int32).reshape(plan.batch_size, -1)[kernel]
    else:
        width = max((len(tables[b]) for b in kernel), default=0)
        tables = torch.tensor([list(tables[b]) + [-1] * (width - len(tables[b])) for b in kernel], dtype=torch.int32)
    if len(seq) > len(kernel):  # a sequence's queries share its table row
        tables = tables.repeat_interleave(torch.tensor([q_lens[b] for b in kernel]), dim=0)
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    extend_plan = extend_tokens = None
    if extend:
        extend_tokens = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in extend])
        ext_cu = [0]
        for b in extend:
            ext_cu.append(ext_cu[-1] + q_lens[b])
        ext_tables = plan.block_tables
        ext_tables = ext_tables[extend] if isinstance(ext_tables, torch.Tensor) else [ext_tables[b] for b in extend]
        tree = None if plan.tree_mask is None else plan.tree_mask.index_select(0, extend_tokens.to(plan.device))
        starts = None if plan.tree_starts is None else [plan.tree_starts[b] for b in extend]
        extend_plan = plan_paged_attention(ext_cu, [lens[b] for b in extend], ext_tables, plan.block_size, w,
                                           plan.device, tree_mask=tree, tree_starts=starts, null_block=plan.null_block)
    return _DecodeRows(
        tokens=as_i32([cu[b] + j for b, j in zip(seq, local)]),
        rows=torch.tensor(seq, dtype=torch.int64),
        group=torch.tensor(seq, dtype=torch.int32),
        seq_lens=as_i32(own_lens),
        first_key=as_i32([0 if w is None else max(0, n - w) for n in own_lens]),
        tables=tables.contiguous(),
        from_end=None if len(seq) == len(kernel) else torch.tensor([q_lens[b] - j for b, j in zip(seq, local)]),
        all_decode=not extend,
        extend_plan=extend_plan,
        extend_tokens=extend_tokens,
        extend_rows=torch.tensor(extend, dtype=torch.int64) if extend else None,
    )


def _pool_side(cache: torch.Tensor, scale: torch.Tensor | None) -> tuple[_Side, list] | None:
    """An element-wise pool [NB, bs, Hkv, D] (fp32 / bf16 / fp16, or fp8 with an optional per-head scale)."""
    if cache.stride(-1) != 1:
        return None
    keep = []  # not `cache`: the weak reference _sides holds it by would never die (each pool leaked)
    side = _Side(data=cache.data_ptr(), s_block=cache.stride(0), s_pos=cache.stride(1), s_head=cache.stride(2))
    if cache.dtype in POOL_KINDS and scale is None:
        side.kind = POOL_KINDS[cache.dtype]
    elif cache.dtype in FP8:
        lut = _fp8_lut(cache.dtype)
        side.kind, side.lut, side.fp8 = 3, lut.data_ptr(), FP8_CODES[cache.dtype]
        keep.append(lut)
        if scale is not None:
            if scale.dtype != torch.float32 or not scale.is_contiguous():
                return None
            side.head_scale = scale.data_ptr()
            keep.append(scale)
    else:
        return None
    return side, keep


def _packed_side(store) -> tuple[_Side, list] | None:
    """A packed format's PageStore (kvlab.cache.quant.page_store): codes, fp16 scales / zeros, residual rows."""
    kind, bits, group = store.codec.layout()
    parts = store.parts
    if kind not in PACKED_KINDS or any(not t.is_contiguous() for t in parts.values()):
        return None
    keep = list(parts.values())
    side = _Side(kind=PACKED_KINDS[kind], bits=bits, group=group, data=parts["data"].data_ptr())
    for name, field in (("scale", "scale16"), ("zero", "zero16")):
        if name in parts:
            if parts[name].dtype != torch.float16:
                return None
            setattr(side, field, parts[name].data_ptr())
    if kind == 3:
        lut = _fp8_lut(parts["data"].dtype)
        side.lut, side.fp8 = lut.data_ptr(), FP8_CODES.get(parts["data"].dtype, 0)
        keep.append(lut)
    if store.residual is not None:
        area = store.area
        if store.residual.dtype not in RES_DTYPES or area.row_of.dtype != torch.int64 \
                or area.lease.dtype != torch.int64 or not area.lease.is_contiguous():
            return None
        side.res, side.res_dtype = store.residual.data_ptr(), RES_DTYPES[store.residual.dtype]
        side.row_of, side.lease = area.row_of.data_ptr(), area.lease.data_ptr()
        side.res_k, side.res_chunk = area.k, store.chunk
        keep += [store.residual, area.row_of, area.lease]
    return side, keep


_sides: dict[int, tuple[weakref.ref, dict]] = {}  # id(pool tensor or PageStore) -> (its weakref, {scale key: side})


def _side(cache, scale):
    """How the kernel reads `cache` (None: it cannot), built once per pool and scale: the engine's pools are
    long-lived objects, and their parts, residual storage, row_of and lease tensors change only in place."""
    entry = _sides.get(id(cache))
    if entry is None or entry[0]() is not cache:
        entry = _sides[id(cache)] = (weakref.ref(cache, lambda _, i=id(cache), d=_sides: d.pop(i, None)), {})
    per_cache = entry[1]
    key = (None if scale is None else (scale.data_ptr(), scale.dtype),
           cache.data_ptr() if isinstance(cache, torch.Tensor) else None)
    if key not in per_cache:
        if isinstance(cache, torch.Tensor):
            per_cache[key] = _pool_side(cache, scale)
        else:
            per_cache[key] = None if scale is not None else _packed_side(cache)
    return per_cache[key]


def _check_inputs(q, k_cache, plan, out) -> None:
    _, block_size, hkv, d = k_cache.shape
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % hkv:
        raise ValueError(f"q must be [T, Hq, {d}] with Hq a multiple of the pool's {hkv} KV heads, got {tuple(q.shape)}")
    if q.dtype not in POOL_KINDS or q.device.type != "cpu":
        raise ValueError(f"q must be a float32 / bfloat16 / float16 CPU tensor, got {q.dtype} on {q.device}")
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens but the plan was made for {plan.num_tokens}")
    if plan.block_size != block_size:
        raise ValueError(f"plan block_size {plan.block_size} != cache block_size {block_size}")
    if out is not None and (out.shape != q.shape or out.stride(-1) != 1 or out.device.type != "cpu"):
        raise ValueError(f"out must be {tuple(q.shape)} on the CPU, contiguous in head_dim; got {tuple(out.shape)}")


def run_paged_attention(
    q: torch.Tensor,  # [T, Hq, D] packed queries
    k_cache,  # [num_blocks, block_size, Hkv, D] pool tensor, or a packed PageStore
    v_cache,
    plan: AttentionPlan,
    scale: float,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,  # [Hkv] float32 (fp8 pools)
    v_scale: torch.Tensor | None = None,
    *,
    return_stats: bool = False,
    stats_window: int | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    stats_out: torch.Tensor | None = None,  # [B, Hkv, max(seq_lens)] float32
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    reference = lambda: _ref.run_paged_attention(  # noqa: E731
        q, k_cache, v_cache, plan, scale, softcap, k_scale, v_scale,
        return_stats=return_stats, stats_window=stats_window, out=out, stats_out=stats_out)
    kernel = _kernel() if enabled() else None
    if kernel is None or q.device.type != "cpu" or min(plan.q_lens, default=0) > MAX_KERNEL_Q:
        return reference()
    k_side, v_side = _side(k_cache, k_scale), _side(v_cache, v_scale)
    if k_side is None or v_side is None:
        return reference()
    _check_inputs(q, k_cache, plan, out)
    rows = _decode_rows(plan)
    if not rows.tokens.shape[0]:  # no short chain: long chunks, or rows a tree mask restricts
        return reference()
    out = q.new_empty(q.shape) if out is None else out
    direct = out.dtype == torch.float32
    target = out if direct else torch.empty(q.shape, dtype=torch.float32)  # [T, Hq, D]
    q32 = q if q.dtype == torch.float32 and q.stride(-1) == 1 else q.float().contiguous()
    _, bs, hkv, d = k_cache.shape
    stats = per_row = stats_ptr = stats_off = None
    if return_stats:  # kernel rows' statistics from the kernel, the others' from the reference (below)
        stats = torch.zeros(plan.batch_size, hkv, max(plan.seq_lens, default=0)) if stats_out is None \
            else stats_out.zero_()
        if stats_window is None or stats_window >= 1:  # a window of 0 counts no query: zeros
            if rows.one_per_sequence:  # each row writes its sequence's statistics in place
                stats_off, stats_ptr = rows.rows * stats.stride(0), stats.data_ptr()
            else:  # each query's own, summed per sequence below
                per_row = torch.zeros(rows.tokens.shape[0], hkv, stats.shape[2])  # [n, Hkv, L]
                stats_off, stats_ptr = torch.arange(per_row.shape[0]) * per_row.stride(0), per_row.data_ptr()
    status = kernel(
        q32.data_ptr(), q32.stride(0), q32.stride(1), target.data_ptr(), target.stride(0), target.stride(1),
        k_side[0], v_side[0], rows.tables.data_ptr(), rows.tables.stride(0),
        rows.tokens.data_ptr(), rows.seq_lens.data_ptr(), rows.first_key.data_ptr(),
        rows.tokens.shape[0], hkv, q.shape[1] // hkv, d, bs, float(scale), float(softcap or 0.0), CHUNK_KEYS,
        torch.get_num_threads(), stats_ptr, 0 if stats is None else (stats if per_row is None else per_row).stride(1),
        None if stats_off is None else stats_off.data_ptr(), None if rows.one_per_sequence else rows.group.data_ptr())
    if status:
        raise RuntimeError(f"kvlab_decode_attention failed with status {status}")
    if per_row is not None:
        _sum_row_stats(stats, per_row, rows, stats_window)
    if not direct:
        if rows.all_decode:
            out.copy_(target)
        else:
            index = rows.tokens.long()
            out.index_copy_(0, index, target.index_select(0, index).to(out.dtype))
    if rows.extend_plan is not None:
        q_ext = q.index_select(0, rows.extend_tokens)
        o = _ref.run_paged_attention(q_ext, k_cache, v_cache, rows.extend_plan, scale, softcap, k_scale, v_scale)
        out.index_copy_(0, rows.extend_tokens, o)
        if return_stats:
            from kvlab.kernels.reference.attention_stats import attention_stats_from_plan

            ext = attention_stats_from_plan(q_ext, k_cache, rows.extend_plan, scale, softcap, k_scale, stats_window)
            stats[rows.extend_rows, :, : ext.shape[2]] = ext
    return (out, stats) if return_stats else out


def _sum_row_stats(stats: torch.Tensor, per_row: torch.Tensor, rows: _DecodeRows, window: int | None) -> None:
    """stats[b] = the sum over b's last `window` kernel rows (all: None) of their statistics, in query order
    (what the reference counts: kvlab.kernels.reference.attention_stats)."""
    counted = torch.ones_like(rows.from_end, dtype=torch.bool) if window is None else rows.from_end <= window
    stats.index_add_(0, rows.rows[counted], per_row[counted])


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache,
    v_cache,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64 (-1 = released / padding)
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    tree_mask: torch.Tensor | None = None,
    return_stats: bool = False,
    stats_window: int | None = None,
    out: torch.Tensor | None = None,
    stats_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plan and run in one call; same signature as kvlab.kernels.reference.paged_attention_ref."""
    plan = plan_paged_attention(cu_seqlens_q.tolist(), seq_lens.tolist(), block_tables.tolist(), k_cache.shape[1],
                                sliding_window, q.device, tree_mask=tree_mask)
    return run_paged_attention(q, k_cache, v_cache, plan, scale, softcap, k_scale, v_scale,
                               return_stats=return_stats, stats_window=stats_window, out=out, stats_out=stats_out)

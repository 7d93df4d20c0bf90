"""Launcher: paged attention (decode, extend, prefill) with Triton, plus attention statistics.

Same signatures as kvlab.kernels.reference.paged_attention: `run_paged_attention`
takes a plan from `plan_paged_attention` (built once per step, shared by every
layer; the device index tensors and query tiles the kernels need are derived on
first use and cached in the plan), `paged_attention` plans and runs in one call.

Per step and per layer:
  1. decode rows (one query) launch with BLOCK_Q = 1, G query heads per program;
     extend rows (chunked prefill, speculative verification, SpecInfer trees
     arXiv:2305.09781) launch with BLOCK_Q = BLOCK_M // G query tokens per program;
  2. when few programs would cover a long context, each one's key range is split
     NUM_SPLITS ways and a reduction pass merges them (Flash-Decoding split-K);
  3. with `return_stats`, one more pass turns the attention's log-sum-exp into the
     attention each cached key received (H2O arXiv:2306.14048, SnapKV arXiv:2404.14469).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton.language as tl

from kvlab.kernels import _checks as C
from kvlab.kernels.attention_plan import AttentionPlan, memo, plan_paged_attention
from kvlab.kernels.triton_kernels.attention_stats import attention_stats_kernel
from kvlab.kernels.triton_kernels.paged_attention import combine_splits_kernel, paged_attention_kernel

MAX_SPLITS = 64


@dataclass
class _DeviceBatch:
    """The plan's batch layout as int32 device tensors (built once per plan)."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    tree_mask: torch.Tensor | None  # [T, >= max q_len] uint8
    tree_starts: torch.Tensor | None  # [B] int32 cache index of each row's mask column 0 (with tree_mask)
    decode_rows: list[int]
    extend_rows: list[int]


@dataclass
class _Tiles:
    """Query tiles of one launch: which sequence and first query each program takes."""

    seq: torch.Tensor  # [n_tiles] int32
    start: torch.Tensor  # [n_tiles] int32
    tokens: torch.Tensor  # [n_tokens] int32 packed tokens covered (for the split reduction)
    max_kv: int  # longest seq_len among the rows


def _device_batch(plan: AttentionPlan) -> _DeviceBatch:
    return memo(plan, "triton.batch", _build_device_batch)


def _build_device_batch(plan: AttentionPlan) -> _DeviceBatch:
    dev = plan.device
    tables = plan.block_tables
    if isinstance(tables, torch.Tensor):
        tables = tables.to(device=dev, dtype=torch.int32).contiguous()
    else:
        width = max((len(t) for t in tables), default=0)
        tables = torch.tensor([list(t) + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
    tables = tables.reshape(len(plan.seq_lens), -1)
    q_lens = plan.q_lens
    batch = _DeviceBatch(
        block_tables=tables,
        cu_seqlens_q=torch.tensor(plan.cu_seqlens_q, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(plan.seq_lens, dtype=torch.int32, device=dev),
        tree_mask=None if plan.tree_mask is None else plan.tree_mask.to(dev, torch.uint8).contiguous(),
        tree_starts=None if plan.tree_mask is None else torch.tensor(
            plan.tree_starts or [n - q for n, q in zip(plan.seq_lens, q_lens)], dtype=torch.int32, device=dev),
        decode_rows=[b for b, n in enumerate(q_lens) if n == 1],
        extend_rows=[b for b, n in enumerate(q_lens) if n > 1],
    )
    return batch


def _tiles(plan: AttentionPlan, rows: list[int], block_q: int) -> _Tiles:
    tiles = memo(plan, "triton.tiles", lambda _: {})  # (rows, block_q) -> _Tiles
    key = (tuple(rows), block_q)
    if key not in tiles:
        tiles[key] = _build_tiles(plan, rows, block_q)
    return tiles[key]


def _build_tiles(plan: AttentionPlan, rows: list[int], block_q: int) -> _Tiles:
    seq, start, tokens = [], [], []
    cu = plan.cu_seqlens_q
    for b in rows:
        n = cu[b + 1] - cu[b]
        for s in range(0, n, block_q):
            seq.append(b)
            start.append(s)
        tokens.extend(range(cu[b], cu[b + 1]))
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=plan.device)  # noqa: E731
    return _Tiles(as_t(seq), as_t(start), as_t(tokens), max(plan.seq_lens[b] for b in rows))


@lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small, so tests exercise splitting


def _launch_config(g: int, d: int, decode: bool) -> dict[str, int]:
    """Tile sizes: rows = query tokens x G heads; keys per step shrink as head_dim grows."""
    block_d = C.next_pow2(d)
    block_m = max(16 if decode else (64 if block_d <= 128 else 32), C.next_pow2(g))
    return dict(
        BLOCK_M=block_m,
        BLOCK_Q=1 if decode else block_m // g,
        BLOCK_N=64 if block_d <= 128 else 32,
        BLOCK_D=block_d,
        num_warps=4 if block_d <= 128 or decode else 8,
    )


def choose_num_splits(programs: int, max_kv: int, block_n: int, device: torch.device) -> int:
    """Flash-Decoding: split the keys when the grid alone would leave the device idle."""
    target = 4 * _num_sms(device)
    if programs >= target:
        return 1
    min_keys = 4 * block_n if device.type == "cuda" else block_n
    return max(1, min(-(-target // programs), max_kv // min_keys, MAX_SPLITS))


def _dot_dtype(q: torch.Tensor):
    """tl.dot operand dtype: the query's on GPUs; float32 under the interpreter, whose
    tl.dot multiplies bfloat16 bit patterns as integers (triton 3.x interpreter)."""
    if q.device.type == "cpu" or q.dtype == torch.float32:
        return tl.float32
    return tl.float16 if q.dtype == torch.float16 else tl.bfloat16


def _check_attention_inputs(q, k_cache, v_cache, plan, k_scale, v_scale, out):
    _, block_size, hkv, d = C.check_cache_pair(k_cache, v_cache, packed_ok=True)
    if not isinstance(k_cache, torch.Tensor) and (k_scale is not None or v_scale is not None):
        raise ValueError("packed page stores carry their own scales: pass k_scale=v_scale=None")
    device = k_cache.device
    C.check_tokens(q, "q", None, d, device)
    if q.shape[1] % hkv:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({hkv})")
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens but the plan was made for {plan.num_tokens}")
    if plan.block_size != block_size:
        raise ValueError(f"plan block_size {plan.block_size} != cache block_size {block_size}")
    if plan.device != device:
        raise ValueError(f"plan was made for {plan.device}, cache is on {device}")
    C.check_scale(k_scale, hkv, device, "k_scale")
    C.check_scale(v_scale, hkv, device, "v_scale")
    if out is not None and (out.shape != q.shape or out.stride(-1) != 1 or out.device != device):
        raise ValueError(f"out must be {tuple(q.shape)} on {device}, contiguous in head_dim; got {tuple(out.shape)}")
    C.check_runnable(paged_attention_kernel, device)


def run_paged_attention(
    q: torch.Tensor,  # [T, Hq, D] packed queries
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    plan: AttentionPlan,
    scale: float,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,  # [Hkv] float32 dequantisation scales
    v_scale: torch.Tensor | None = None,
    *,
    return_stats: bool = False,
    stats_window: int | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    stats_out: torch.Tensor | None = None,  # [B, Hkv, max(seq_lens)] float32
    num_splits: int | None = None,  # force the split-K factor (None: heuristic)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    _check_attention_inputs(q, k_cache, v_cache, plan, k_scale, v_scale, out)
    T, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    k_codec = _codec_id(k_cache, k_scale, "k_cache")
    v_codec = _codec_id(v_cache, v_scale, "v_cache")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if out is None:
        out = q.new_empty(T, hq, d)
    batch = _device_batch(plan)
    lse = torch.empty(T, hq, dtype=torch.float32, device=q.device) if return_stats else None
    common = dict(
        q=q, k_cache=k_cache, v_cache=v_cache, out=out, lse=lse, plan=plan, batch=batch,
        k_scale=k_scale, v_scale=v_scale, scale=scale, softcap=softcap, g=g,
        k_codec=k_codec, v_codec=v_codec,
    )
    for rows, decode in ((batch.decode_rows, True), (batch.extend_rows, False)):
        if rows:
            _launch_attention(rows=rows, decode=decode, num_splits=num_splits, **common)
    if not return_stats:
        return out
    stats = _launch_stats(q, k_cache, lse, plan, batch, k_scale, scale, softcap, g, k_codec, stats_window, stats_out)
    return out, stats


def _codec_id(cache, scale, name: str) -> int:
    return C.CODEC_PACKED if not isinstance(cache, torch.Tensor) else C.codec_for(cache, scale, name).id


@dataclass
class _Pool:
    """What a kernel gets for one side of the pool: the tensor it indexes, scale / zero / residual
    pointers (placeholders when unused) and the packed layout constants."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    residual: torch.Tensor
    row_of: torch.Tensor
    lease: torch.Tensor
    consts: dict


def _pool(cache, scale, placeholder, side: str) -> _Pool:
    if isinstance(cache, torch.Tensor):
        return _Pool(cache, scale if scale is not None else placeholder, placeholder, placeholder, placeholder,
                     placeholder, {})
    p = C.packed_side(cache)
    area = cache.area
    consts = {f"{side}_KIND": p.kind, f"{side}_BITS": p.bits, f"{side}_GROUP": p.group,
              "NUM_KV_HEADS": cache.shape[2], "HAS_RES": p.residual is not None}
    if p.residual is not None:
        consts.update(RES_K=area.k, RES_CHUNK=cache.chunk)
    return _Pool(p.data, p.scale, p.zero if p.zero is not None else placeholder,
                 p.residual if p.residual is not None else placeholder,
                 area.row_of if area is not None else placeholder, area.lease if area is not None else placeholder,
                 consts)


def _launch_attention(*, q, k_cache, v_cache, out, lse, plan, batch, rows, decode, k_scale, v_scale, scale,
                      softcap, g, k_codec, v_codec, num_splits):
    T, hq, d = q.shape
    hkv = k_cache.shape[2]
    cfg = _launch_config(g, d, decode)
    tiles = _tiles(plan, rows, cfg["BLOCK_Q"])
    n_tiles = tiles.seq.shape[0]
    splits = num_splits or choose_num_splits(n_tiles * hkv, tiles.max_kv, cfg["BLOCK_N"], q.device)
    window = plan.sliding_window
    tree = batch.tree_mask
    placeholder = batch.seq_lens
    if splits == 1:
        target, m, l = out, placeholder, placeholder
        o_strides = (out.stride(0), out.stride(1), 0)
        ml_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    else:
        target = torch.empty(T, hq, splits, d, dtype=torch.float32, device=q.device)  # [T, Hq, S, D]
        m = torch.empty(T, hq, splits, dtype=torch.float32, device=q.device)  # [T, Hq, S]
        l = torch.empty_like(m)
        o_strides = (target.stride(0), target.stride(1), target.stride(2))
        ml_strides = (m.stride(0), m.stride(1))
    kp, vp = _pool(k_cache, k_scale, placeholder, "K"), _pool(v_cache, v_scale, placeholder, "V")
    paged_attention_kernel[(n_tiles, hkv, splits)](
        q, kp.data, vp.data, target,
        lse if lse is not None else placeholder, m, l,
        batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, tiles.seq, tiles.start,
        tree if tree is not None else placeholder,
        batch.tree_starts if tree is not None else placeholder,
        kp.scale, vp.scale, kp.zero, vp.zero, kp.residual, vp.residual, kp.row_of, kp.lease,
        float(scale), float(softcap or 1.0), int(window or 0),
        q.stride(0), q.stride(1),
        kp.data.stride(0), kp.data.stride(1), kp.data.stride(2),
        vp.data.stride(0), vp.data.stride(1), vp.data.stride(2),
        *o_strides,
        *ml_strides,
        batch.block_tables.stride(0),
        tree.stride(0) if tree is not None else 0,
        PAGE=k_cache.shape[1],
        G=g,
        HEAD_DIM=d,
        BLOCK_D=cfg["BLOCK_D"],
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_Q=cfg["BLOCK_Q"],
        BLOCK_N=cfg["BLOCK_N"],
        NUM_SPLITS=splits,
        USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        USE_TREE=tree is not None,
        K_CODEC=k_codec,
        V_CODEC=v_codec,
        WRITE_LSE=lse is not None,
        DOT_DTYPE=_dot_dtype(q),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"],
        **{**kp.consts, **vp.consts},
    )
    if splits > 1:
        combine_splits_kernel[(tiles.tokens.shape[0], hq)](
            target, m, l, out,
            lse if lse is not None else placeholder,
            tiles.tokens,
            target.stride(0), target.stride(1), target.stride(2),
            m.stride(0), m.stride(1),
            out.stride(0), out.stride(1),
            *((lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)),
            NUM_SPLITS=splits,
            BLOCK_S=C.next_pow2(splits),
            HEAD_DIM=d,
            BLOCK_D=cfg["BLOCK_D"],
            WRITE_LSE=lse is not None,
            num_warps=4,
        )


def _launch_stats(q, k_cache, lse, plan, batch, k_scale, scale, softcap, g, k_codec, stats_window, stats_out):
    T, hq, d = q.shape
    hkv = k_cache.shape[2]
    B, L = plan.batch_size, max(plan.seq_lens, default=0)
    if stats_window is not None and stats_window < 1:
        raise ValueError(f"stats_window must be >= 1 or None (all of the step's queries), got {stats_window}")
    if stats_out is None:
        stats_out = torch.empty(B, hkv, L, dtype=torch.float32, device=q.device)
    elif stats_out.shape != (B, hkv, L) or stats_out.dtype != torch.float32 or stats_out.stride(-1) != 1:
        raise ValueError(f"stats_out must be float32 [{B}, {hkv}, {L}] contiguous in its last dim, got {tuple(stats_out.shape)}")
    if B == 0 or L == 0:
        return stats_out
    cfg = _launch_config(g, d, decode=not batch.extend_rows)
    window, tree, placeholder = plan.sliding_window, batch.tree_mask, batch.seq_lens
    kp = _pool(k_cache, k_scale, placeholder, "K")
    attention_stats_kernel[(B, hkv, -(-L // cfg["BLOCK_N"]))](
        q, kp.data, lse, stats_out,
        batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
        tree if tree is not None else placeholder,
        batch.tree_starts if tree is not None else placeholder,
        kp.scale, kp.zero, kp.residual, kp.row_of, kp.lease,
        float(scale), float(softcap or 1.0), int(window or 0),
        int(stats_window if stats_window is not None else T), L,
        q.stride(0), q.stride(1),
        kp.data.stride(0), kp.data.stride(1), kp.data.stride(2),
        lse.stride(0), lse.stride(1),
        stats_out.stride(0), stats_out.stride(1),
        batch.block_tables.stride(0),
        tree.stride(0) if tree is not None else 0,
        PAGE=k_cache.shape[1],
        G=g,
        HEAD_DIM=d,
        BLOCK_D=cfg["BLOCK_D"],
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_Q=cfg["BLOCK_Q"],
        BLOCK_N=cfg["BLOCK_N"],
        USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        USE_TREE=tree is not None,
        K_CODEC=k_codec,
        DOT_DTYPE=_dot_dtype(q),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"],
        **kp.consts,
    )
    return stats_out


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64 (-1 = released / padding)
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32/int64
    seq_lens: torch.Tensor,  # [B] int32/int64
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    tree_mask: torch.Tensor | None = None,  # [T, >= max q_len] bool
    tree_starts: list[int] | None = None,  # [B] cache index of each row's mask column 0 (AttentionPlan)
    return_stats: bool = False,
    stats_window: int | None = None,
    out: torch.Tensor | None = None,
    stats_out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plan and run in one call; same signature as kvlab.kernels.reference.paged_attention_ref."""
    device = k_cache.device
    C.check_index(block_tables, "block_tables", 2, device)
    C.check_index(cu_seqlens_q, "cu_seqlens_q", 1, device)
    C.check_index(seq_lens, "seq_lens", 1, device)
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, seq_lens {seq_lens.shape[0]} entries")
    plan = plan_paged_attention(
        cu_seqlens_q.tolist(), seq_lens.tolist(), block_tables, k_cache.shape[1], sliding_window, device,
        tree_mask=tree_mask, tree_starts=tree_starts,
    )
    return run_paged_attention(
        q, k_cache, v_cache, plan, scale, softcap, k_scale, v_scale,
        return_stats=return_stats, stats_window=stats_window, out=out, stats_out=stats_out, num_splits=num_splits,
    )


def attention_stats(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    stats_window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, Hkv, max(seq_lens)] float32
    """Statistics alone (runs the attention for its log-sum-exp); prefer `return_stats=True` in the attention call."""
    _, stats = paged_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window, softcap,
        k_scale, v_scale, tree_mask=tree_mask, return_stats=True, stats_window=stats_window,
    )
    return stats

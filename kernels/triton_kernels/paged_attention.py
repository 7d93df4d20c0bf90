"""Triton kernels: paged attention over ragged batches, split-K, and the split reduction.

PagedAttention (Kwon et al., arXiv:2309.06180) reads keys and values through a
block table; the online softmax follows FlashAttention, and long contexts are
split over several programs whose partial results are merged by a second pass
(Flash-Decoding, Dao et al. 2023, "split-K").

One program handles one *query tile* of one sequence for one KV head and one
split. A tile packs BLOCK_Q query tokens x G query heads (the G = Hq / Hkv heads
sharing that KV head, GQA) into BLOCK_M = BLOCK_Q * G rows, so every key tile is
loaded once per KV head and any head ratio works:

    row r -> query token q0 + r // G, query head kv_head * G + r % G

Decode uses BLOCK_Q = 1 (one token, G heads); extend / chunked prefill /
speculative verification use larger BLOCK_Q. Scores are kept in the log2 domain
(scale * log2(e) folded in) and `lse` is written in that domain for the
statistics kernel.
"""

import triton
import triton.language as tl

from kvlab.kernels.triton_kernels.codec import decode, load_packed

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    """tanh through exp (no libdevice needed, works under the interpreter)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def logits_log2(q, k, scale, softcap, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q [M, D] @ k [D, N] -> scaled (soft-capped) logits times log2(e), float32 [M, N]."""
    s = tl.dot(q, k, input_precision=DOT_PRECISION)
    if USE_SOFTCAP:
        s = softcap * _tanh(s * (scale / softcap))
        s = s * LOG2E
    else:
        s = s * (scale * LOG2E)
    return s


@triton.jit
def visible(
    pos,  # [M] cache index of each query row
    j,  # [N] cache index of each key
    row_valid,  # [M]
    key_valid,  # [N]
    tok,  # [M] packed token index of each row (tree mask row)
    tree0,  # cache index of the row's tree-mask column 0 (the plan's tree_starts; default its first new token)
    window,
    tree_ptr,
    stride_tree,
    USE_WINDOW: tl.constexpr,
    USE_TREE: tl.constexpr,
):
    """[M, N] bool: may query row see key j (causal, sliding window, tree mask)."""
    ok = row_valid[:, None] & key_valid[None, :] & (j[None, :] <= pos[:, None])
    if USE_WINDOW:
        ok = ok & (pos[:, None] - j[None, :] < window)
    if USE_TREE:
        col = j - tree0  # [N] the key's tree-mask column (< 0: before the tree, visible)
        new = ok & (col[None, :] >= 0)
        tm = tl.load(tree_ptr + tok[:, None] * stride_tree + col[None, :], mask=new, other=1)
        ok = ok & (tm != 0)
    return ok


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    out_ptr,  # NUM_SPLITS == 1: [T, Hq, D] output; else [T, Hq, NUM_SPLITS, D] float32 partial sums
    lse_ptr,  # [T, Hq] float32 log2-sum-exp (WRITE_LSE, NUM_SPLITS == 1)
    m_ptr,  # [T, Hq, NUM_SPLITS] float32 partial row max (NUM_SPLITS > 1)
    l_ptr,  # [T, Hq, NUM_SPLITS] float32 partial row sum (NUM_SPLITS > 1)
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    tile_seq_ptr,  # [n_tiles] int32 sequence of each query tile
    tile_start_ptr,  # [n_tiles] int32 first query (within its sequence's chunk) of each tile
    tree_ptr,  # [T, >= max q_len] uint8 tree mask (USE_TREE)
    tree_start_ptr,  # [B] int32 cache index of each row's tree-mask column 0 (USE_TREE)
    k_scale_ptr,  # [Hkv] float32 (SCALED codec); PACKED: the page store's scale part
    v_scale_ptr,
    k_zero_ptr,  # PACKED: zero-point part (asymmetric layouts)
    v_zero_ptr,
    k_res_ptr,  # PACKED with HAS_RES: residual row storage, flat (codec.load_packed)
    v_res_ptr,
    row_of_ptr,  # PACKED with HAS_RES: [num_blocks] int64 residual row of each page (-1: sealed)
    lease_ptr,  # PACKED with HAS_RES: [rows, RES_K] int64 chunk of each part of a row
    scale,
    softcap,
    window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,  # lse / m / l (token, head); the split index is contiguous
    stride_bt,
    stride_tree,
    PAGE: tl.constexpr,  # block_size of the pool
    G: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per tile (BLOCK_Q * G <= BLOCK_M)
    BLOCK_N: tl.constexpr,  # keys per inner step
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_TREE: tl.constexpr,
    K_CODEC: tl.constexpr,
    V_CODEC: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # dtype of the tl.dot operands (the query dtype on GPUs)
    DOT_PRECISION: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr = 1,  # PACKED codecs: layout constants (kvlab.cache.quant PageCodec.layout)
    K_KIND: tl.constexpr = 0,
    K_BITS: tl.constexpr = 8,
    K_GROUP: tl.constexpr = 1,
    V_KIND: tl.constexpr = 0,
    V_BITS: tl.constexpr = 8,
    V_GROUP: tl.constexpr = 1,
    HAS_RES: tl.constexpr = False,
    RES_K: tl.constexpr = 1,
    RES_CHUNK: tl.constexpr = 1,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_start_ptr + tile)
    cu0 = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - cu0
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # cache length before this step
    tree0 = prefix
    if USE_TREE:
        tree0 = tl.load(tree_start_ptr + seq)

    r = tl.arange(0, BLOCK_M)
    qi = r // G
    local = q0 + qi  # [BLOCK_M] query index within the sequence's chunk
    row_valid = (qi < BLOCK_Q) & (local < q_len)
    tok = (cu0 + local).to(tl.int64)  # [BLOCK_M] packed token index
    head = kv_head * G + r % G  # [BLOCK_M] query head
    pos = prefix + local  # [BLOCK_M] cache index of the query
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM

    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]

    # keys this tile can see: [lo, hi)
    hi = prefix + tl.minimum(q0 + BLOCK_Q, q_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(prefix + q0 - window + 1, 0)
    first_tile = lo // BLOCK_N
    n_tiles = tl.cdiv(hi, BLOCK_N) - first_tile
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t_begin = first_tile + split * per_split
    t_end = tl.minimum(t_begin + per_split, first_tile + n_tiles)

    k_scale = 1.0
    v_scale = 1.0
    if K_CODEC == 1:
        k_scale = tl.load(k_scale_ptr + kv_head)
    if V_CODEC == 1:
        v_scale = tl.load(v_scale_ptr + kv_head)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    for kt in range(t_begin, t_end):
        j = kt * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] cache indices
        key_valid = (j >= lo) & (j < hi)
        block = tl.load(table + j // PAGE, mask=key_valid, other=-1).to(tl.int64)
        key_valid = key_valid & (block >= 0)  # a released page (-1) is never read
        block = tl.maximum(block, 0)
        in_page = j % PAGE
        if K_CODEC == 2:  # packed pages, dequantised on load
            k = load_packed(k_cache_ptr, k_scale_ptr, k_zero_ptr, k_res_ptr, row_of_ptr, lease_ptr,
                            block[None, :], in_page[None, :], kv_head, d[:, None],
                            key_valid[None, :] & d_valid[:, None],
                            PAGE, NUM_KV_HEADS, HEAD_DIM, K_KIND, K_BITS, K_GROUP, HAS_RES, RES_K, RES_CHUNK,
                            DOT_DTYPE)
        else:
            k_off = block * stride_kb + in_page * stride_ks + kv_head * stride_kh  # [BLOCK_N]
            k = tl.load(
                k_cache_ptr + k_off[None, :] + d[:, None],
                mask=key_valid[None, :] & d_valid[:, None],
                other=0.0,
            )  # [BLOCK_D, BLOCK_N]
            k = decode(k, k_scale, K_CODEC, DOT_DTYPE)
        s = logits_log2(q, k, scale, softcap, USE_SOFTCAP, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        ok = visible(pos, j, row_valid, key_valid, tok, tree0, window, tree_ptr, stride_tree, USE_WINDOW, USE_TREE)
        s = tl.where(ok, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)

        if V_CODEC == 2:
            v = load_packed(v_cache_ptr, v_scale_ptr, v_zero_ptr, v_res_ptr, row_of_ptr, lease_ptr,
                            block[:, None], in_page[:, None], kv_head, d[None, :],
                            key_valid[:, None] & d_valid[None, :],
                            PAGE, NUM_KV_HEADS, HEAD_DIM, V_KIND, V_BITS, V_GROUP, HAS_RES, RES_K, RES_CHUNK,
                            DOT_DTYPE)
        else:
            v_off = block * stride_vb + in_page * stride_vs + kv_head * stride_vh
            v = tl.load(
                v_cache_ptr + v_off[:, None] + d[None, :],
                mask=key_valid[:, None] & d_valid[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            v = decode(v, v_scale, V_CODEC, DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    io_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptr = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=io_mask)
        if WRITE_LSE:
            lse = m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))
            tl.store(lse_ptr + tok * stride_lt + head * stride_lh, lse, mask=row_valid)
    else:
        o_ptr = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(o_ptr, acc, mask=io_mask)
        ml = tok * stride_lt + head * stride_lh + split
        tl.store(m_ptr + ml, m_i, mask=row_valid)
        tl.store(l_ptr + ml, l_i, mask=row_valid)


@triton.jit
def combine_splits_kernel(
    part_ptr,  # [T, Hq, NUM_SPLITS, D] float32 unnormalised partial outputs
    m_ptr,  # [T, Hq, NUM_SPLITS] float32
    l_ptr,  # [T, Hq, NUM_SPLITS] float32
    out_ptr,  # [T, Hq, D]
    lse_ptr,  # [T, Hq] float32 (WRITE_LSE)
    tokens_ptr,  # [n] int32 tokens to combine
    stride_pt, stride_ph, stride_ps,
    stride_mt, stride_mh,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Merge the splits of one (token, query head): out = sum_s w_s acc_s / sum_s w_s l_s, w_s = 2^(m_s - max m)."""
    tok = tl.load(tokens_ptr + tl.program_id(0)).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_valid = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    ml = tok * stride_mt + h * stride_mh + s
    m = tl.load(m_ptr + ml, mask=s_valid, other=float("-inf"))  # [BLOCK_S]
    l = tl.load(l_ptr + ml, mask=s_valid, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)  # [BLOCK_S]; empty splits (m = -inf) weigh 0
    total = tl.sum(l * w, 0)
    acc = tl.load(
        part_ptr + tok * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_valid)
    if WRITE_LSE:
        tl.store(lse_ptr + tok * stride_lt + h * stride_lh, m_safe + tl.log2(tl.where(total == 0.0, 1.0, total)))

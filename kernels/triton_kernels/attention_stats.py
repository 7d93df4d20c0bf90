"""Triton kernel: attention received by each cached key, from the attention pass's log-sum-exp.

For score-based eviction (H2O arXiv:2306.14048, SnapKV arXiv:2404.14469, TOVA):
stats[b, h, j] = sum over the counted queries i of sequence b and the query heads
g of KV head h of P[i, g, j]. The attention kernel already produced each row's
log2-sum-exp, so P = 2^(s - lse) needs no second softmax pass: one program owns
one key tile of one (sequence, KV head), loads it once, and sweeps the counted
queries (the last `stats_window` of the sequence's chunk) in tiles of
BLOCK_Q tokens x G heads, exactly like the attention kernel's rows.
"""

import triton
import triton.language as tl

from kvlab.kernels.triton_kernels.codec import decode, load_packed
from kvlab.kernels.triton_kernels.paged_attention import logits_log2, visible


@triton.jit
def attention_stats_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    lse_ptr,  # [T, Hq] float32 log2-sum-exp of every query row
    stats_ptr,  # [B, Hkv, L] float32 output
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    tree_ptr,  # [T, >= max q_len] uint8 (USE_TREE)
    tree_start_ptr,  # [B] int32 cache index of each row's tree-mask column 0 (USE_TREE)
    k_scale_ptr,  # [Hkv] float32 (SCALED codec); PACKED: the page store's scale part
    k_zero_ptr,  # PACKED: zero-point part
    k_res_ptr,  # PACKED with HAS_RES: residual row storage, flat (codec.load_packed)
    row_of_ptr,  # PACKED with HAS_RES: [num_blocks] int64
    lease_ptr,  # PACKED with HAS_RES: [rows, RES_K] int64
    scale,
    softcap,
    window,
    stats_window,  # count the last `stats_window` queries of each sequence
    stats_len,  # L, the stats row length
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_lt, stride_lh,
    stride_sb, stride_sh,
    stride_bt,
    stride_tree,
    PAGE: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_TREE: tl.constexpr,
    K_CODEC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr = 1,  # PACKED codec layout (kvlab.cache.quant PageCodec.layout)
    K_KIND: tl.constexpr = 0,
    K_BITS: tl.constexpr = 8,
    K_GROUP: tl.constexpr = 1,
    HAS_RES: tl.constexpr = False,
    RES_K: tl.constexpr = 1,
    RES_CHUNK: tl.constexpr = 1,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    key_tile = tl.program_id(2)

    cu0 = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - cu0
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    tree0 = prefix
    if USE_TREE:
        tree0 = tl.load(tree_start_ptr + seq)

    j = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] cache indices
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(prefix - window + 1, 0)  # older keys are outside every query's window
    key_valid = (j >= lo) & (j < seq_len)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM

    block = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + j // PAGE, mask=key_valid, other=-1)
    block = block.to(tl.int64)
    key_valid = key_valid & (block >= 0)  # a released page (-1) is never read
    block = tl.maximum(block, 0)
    k_scale = 1.0
    if K_CODEC == 2:  # packed pages: dequantised once here, the loop below casts only
        k = load_packed(k_cache_ptr, k_scale_ptr, k_zero_ptr, k_res_ptr, row_of_ptr, lease_ptr,
                        block[None, :], (j % PAGE)[None, :], kv_head, d[:, None],
                        key_valid[None, :] & d_valid[:, None],
                        PAGE, NUM_KV_HEADS, HEAD_DIM, K_KIND, K_BITS, K_GROUP, HAS_RES, RES_K, RES_CHUNK,
                        tl.float32)
    else:
        k_off = block * stride_kb + (j % PAGE) * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off[None, :] + d[:, None], mask=key_valid[None, :] & d_valid[:, None], other=0.0)
    if K_CODEC == 1:
        k_scale = tl.load(k_scale_ptr + kv_head)

    r = tl.arange(0, BLOCK_M)
    qi = r // G
    head = kv_head * G + r % G
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # queries before the key tile cannot see it (causal): start at the first one that can
    q_first = tl.maximum(q_len - tl.minimum(stats_window, q_len), key_tile * BLOCK_N - prefix)
    for q0 in range(q_first, q_len, BLOCK_Q):
        local = q0 + qi
        row_valid = (qi < BLOCK_Q) & (local < q_len)
        tok = (cu0 + local).to(tl.int64)
        pos = prefix + local
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_valid[:, None] & d_valid[None, :],
            other=0.0,
        ).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]
        kq = decode(k, k_scale, K_CODEC, DOT_DTYPE)  # PACKED: already dequantised, a cast
        s = logits_log2(q, kq, scale, softcap, USE_SOFTCAP, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        ok = visible(pos, j, row_valid, key_valid, tok, tree0, window, tree_ptr, stride_tree, USE_WINDOW, USE_TREE)
        lse = tl.load(lse_ptr + tok * stride_lt + head * stride_lh, mask=row_valid, other=0.0)
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        acc += tl.sum(p, 0)

    out = stats_ptr + seq.to(tl.int64) * stride_sb + kv_head * stride_sh + j
    tl.store(out, acc, mask=j < stats_len)

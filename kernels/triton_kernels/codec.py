"""Cache codecs: how a storage format is written (quantise) and read (dequantise) inside kernels.

A codec is a `tl.constexpr` id chosen by the launcher from the pool's storage
dtype and whether scales are given (kvlab.kernels._checks.codec_for); each
kernel calls `encode`/`decode`, so a new format adds one branch here and one
case in `codec_for`, and every kernel picks it up. Scales are per KV head:
stored = x / scale, read = stored * scale.

CAST   plain dtype conversion (fp32 / bf16 / fp16 storage, no scale).
SCALED float storage with a scale, clamped to the storage range (fp8 e4m3 / e5m2).

Narrow float stores are rounded to the storage grid (nearest, ties to even) in
float32 first, so the final cast is exact: the same bits on every GPU and under
Triton's interpreter, whose own narrowing casts truncate (bf16) or lose the
carry into the exponent (fp8), as of triton 3.x.
"""

import triton
import triton.language as tl

CAST = tl.constexpr(0)
SCALED = tl.constexpr(1)


@triton.jit
def round_to_grid(y, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """float32 y -> nearest value (ties to even) with MANT_BITS mantissa bits and exponent >= MIN_EXP."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)  # unbiased exponent, subnormal range clamped
    ulp = ((e - MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - MANT_BITS)
    inv_ulp = ((MANT_BITS - e + 127) << 23).to(tl.float32, bitcast=True)  # 2^(MANT_BITS - e), no division
    m = y * inv_ulp  # exact (power-of-two scaling), |m| < 2^(MANT_BITS + 1)
    m = (m + 12582912.0) - 12582912.0  # + 1.5 * 2^23: rounds to an integer, ties to even
    return m * ulp


@triton.jit
def encode(
    x,
    scale,
    CODEC: tl.constexpr,
    STORE_MAX: tl.constexpr,  # largest finite storage value (SCALED clamp)
    MANT_BITS: tl.constexpr,  # storage mantissa bits (>= 23: no rounding step)
    MIN_EXP: tl.constexpr,  # smallest storage exponent of the rounding grid
    out_dtype: tl.constexpr,
):
    """x (any float tile) -> storage tile; `scale` broadcasts against x (per-head)."""
    y = x.to(tl.float32)
    if CODEC == 1:
        y = y / scale
        y = tl.minimum(tl.maximum(y, -STORE_MAX), STORE_MAX)
    if MANT_BITS < 23:
        y = round_to_grid(y, MANT_BITS, MIN_EXP)
    return y.to(out_dtype)


@triton.jit
def decode(x, scale, CODEC: tl.constexpr, out_dtype: tl.constexpr):
    """storage tile -> compute tile in `out_dtype`."""
    if CODEC == 1:
        return (x.to(tl.float32) * scale).to(out_dtype)
    else:
        return x.to(out_dtype)


# Packed formats (kvlab.cache.quant: int8, int4, int2, fp8 per token) are read through `load_packed`: the launcher passes
# the page parts of a kvlab.cache.quant.page_store.PageStore (all contiguous, so strides follow from the
# shapes) and the codec's layout (kvlab.cache.quant.base.PageCodec.layout):
#   KIND 0  int8 codes [pages, PAGE, Hkv, D], scale [pages, PAGE, Hkv] (symmetric, per token per head)
#   KIND 1  codes [pages, PAGE, Hkv, D * BITS / 8], scale / zero [pages, PAGE / GROUP, Hkv, D]
#           (asymmetric, per channel over GROUP tokens: KIVI keys)
#   KIND 2  codes as KIND 1, scale / zero [pages, PAGE, Hkv, D / GROUP] (per token over GROUP channels: KIVI values)
#   KIND 3  fp8 codes [pages, PAGE, Hkv, D], scale [pages, PAGE, Hkv] (per token per head: fp8 scaling="token")
# With HAS_RES, a page whose residual row (row_of[page]) is >= 0 is read from its full-precision row
# instead: element e = (pos * Hkv + h) * D + d of row r is res[lease[r, e // RES_CHUNK] * RES_CHUNK +
# e % RES_CHUNK] (kvlab.cache.quant.page_store: RES_K chunks per row; an area of its own has RES_K = 1,
# lease[r] = r; rows leased from the pool live in RES_K pages' codes, `res` viewing them in the row dtype).
PACKED = tl.constexpr(2)


@triton.jit
def load_packed(
    data_ptr, scale_ptr, zero_ptr, res_ptr, row_of_ptr, lease_ptr,
    blk,  # int64 page of each element (any shape, broadcast with the others)
    pos,  # slot within the page
    h,  # KV head
    dd,  # channel
    mask,
    PAGE: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_RES: tl.constexpr,
    RES_K: tl.constexpr,  # chunks per residual row
    RES_CHUNK: tl.constexpr,  # elements per chunk
    out_dtype: tl.constexpr,
):
    """Dequantised elements of a packed page store, in `out_dtype` (0 where masked)."""
    slot = blk * PAGE + pos
    ptr = data_ptr + (slot * HKV + h) * (HEAD_DIM * BITS // 8) + dd // (8 // BITS)
    if KIND == 3:
        raw = tl.load(ptr, mask=mask, other=0.0)  # fp8 codes
    else:
        raw = tl.load(ptr, mask=mask, other=0)
    if KIND == 0 or KIND == 3:  # one int8 / fp8 code per element, a scale per token per head
        s = tl.load(scale_ptr + slot * HKV + h, mask=mask, other=0.0).to(tl.float32)
        x = raw.to(tl.float32) * s
    else:
        byte = raw.to(tl.int32)
        code = ((byte >> ((dd % (8 // BITS)) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
        if KIND == 1:
            sidx = ((blk * (PAGE // GROUP) + pos // GROUP) * HKV + h) * HEAD_DIM + dd
        else:
            sidx = (slot * HKV + h) * (HEAD_DIM // GROUP) + dd // GROUP
        s = tl.load(scale_ptr + sidx, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + sidx, mask=mask, other=0.0).to(tl.float32)
        x = code * s + z
    if HAS_RES:
        row = tl.load(row_of_ptr + blk, mask=mask, other=-1)
        is_open = mask & (row >= 0)
        e = (pos * HKV + h) * HEAD_DIM + dd  # element within the row
        chunk = tl.load(lease_ptr + row * RES_K + e // RES_CHUNK, mask=is_open, other=0)
        r = tl.load(res_ptr + chunk * RES_CHUNK + e % RES_CHUNK, mask=is_open, other=0.0)
        x = tl.where(is_open, r.to(tl.float32), x)
    return x.to(out_dtype)

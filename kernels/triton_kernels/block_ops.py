"""Triton kernel: copy rows of the paged pool by index (block copy-on-write, token compaction).

A row is either a whole block (ROWS_PER_BLOCK = 1, ROW_ELEMS = block_size * Hkv * D)
or one slot (ROWS_PER_BLOCK = block_size, ROW_ELEMS = Hkv * D); the inside of a
row is contiguous. Each program copies one BLOCK-sized chunk of one row.
"""

import triton
import triton.language as tl


@triton.jit
def copy_rows_kernel(
    src_ptr,
    dst_ptr,
    src_rows_ptr,  # [N] int rows to read
    dst_rows_ptr,  # [N] int rows to write
    src_stride_block, src_stride_row,  # address of row r = (r // RPB) * stride_block + (r % RPB) * stride_row
    dst_stride_block, dst_stride_row,
    SRC_RPB: tl.constexpr,
    DST_RPB: tl.constexpr,
    ROW_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    src_row = tl.load(src_rows_ptr + i).to(tl.int64)
    dst_row = tl.load(dst_rows_ptr + i).to(tl.int64)
    src = src_ptr + (src_row // SRC_RPB) * src_stride_block + (src_row % SRC_RPB) * src_stride_row
    dst = dst_ptr + (dst_row // DST_RPB) * dst_stride_block + (dst_row % DST_RPB) * dst_stride_row
    e = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = e < ROW_ELEMS
    tl.store(dst + e, tl.load(src + e, mask=mask), mask=mask)

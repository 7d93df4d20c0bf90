"""Triton store_kv, copy_blocks and compact_slots against the torch references.

Pools start random (never zeros) so untouched slots are checked too; storage
must match bit for bit after the kernels' rounding (within one storage ulp).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is imported

import pytest  # noqa: E402

from kvlab.kernels.block_ops import compact_slots, copy_blocks  # noqa: E402
from kvlab.kernels.reference.block_ops import compact_slots_ref, copy_blocks_ref  # noqa: E402
from kvlab.kernels.reference.store_kv import store_kv_ref  # noqa: E402
from kvlab.kernels.store_kv import store_kv  # noqa: E402
from kvlab.kernels.testing import CACHE_DTYPES, FP8, random_pool, random_scales, storage_close  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

STORE_CASES = [
    # cache format, num_kv_heads, head_dim, block_size, key dtype, scaled
    ("fp32", 2, 64, 16, torch.float32, False),
    ("bf16", 3, 256, 1, torch.float32, False),
    ("bf16", 1, 64, 32, torch.bfloat16, False),
    ("fp16", 4, 64, 16, torch.float32, True),
    ("fp8_e4m3", 3, 64, 32, torch.float32, True),
    ("fp8_e4m3", 2, 256, 16, torch.bfloat16, True),
    ("fp8_e5m2", 4, 64, 1, torch.float32, True),
]


@pytest.mark.parametrize("cache,hkv,d,bs,key_dtype,scaled", STORE_CASES)
def test_store_kv_matches_reference(cache, hkv, d, bs, key_dtype, scaled):
    dtype = CACHE_DTYPES[cache]
    gen = torch.Generator().manual_seed(1000 * hkv + 10 * d + bs)
    nb, T = 5, 2 * bs + 3
    k_scale, v_scale = (random_scales(hkv, gen, DEVICE), random_scales(hkv, gen, DEVICE)) if scaled else (None, None)
    pools = [random_pool(nb, bs, hkv, d, dtype, None, gen, DEVICE) for _ in range(2)]
    key = (3 * torch.randn(T, hkv, d, generator=gen)).to(key_dtype).to(DEVICE)
    value = (3 * torch.randn(T, hkv, d, generator=gen)).to(key_dtype).to(DEVICE)
    if dtype in FP8:
        key[0, 0, :4] = torch.tensor([1e4, -1e4, 1e-6, 0.0])  # saturates, underflows, zero
    slots = torch.randperm(nb * bs, generator=gen)[:T].to(DEVICE)
    slots[1::4] = -1  # padding tokens write nothing
    mine = [p.clone() for p in pools]
    store_kv(key, value, *mine, slots, k_scale, v_scale)
    store_kv_ref(key, value, *pools, slots, k_scale, v_scale)
    for got, want in zip(mine, pools):
        assert bool(storage_close(got, want).all())
        assert not got.float().isnan().any()


def test_store_kv_strided_pool_view():
    """A layer's pool may be a view into a bigger allocation (e.g. [layers, blocks, ...])."""
    gen = torch.Generator().manual_seed(3)
    big = random_pool(2 * 4, 16, 2, 64, torch.bfloat16, None, gen, DEVICE).view(2, 4, 16, 2, 64)
    k_cache, v_cache = big[0], big[1]
    key, value = torch.randn(5, 2, 64, generator=gen).to(DEVICE), torch.randn(5, 2, 64, generator=gen).to(DEVICE)
    slots = torch.tensor([0, 17, 63, -1, 30], device=DEVICE)
    want = big.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    store_kv_ref(key, value, want[0], want[1], slots)
    assert torch.equal(big.float(), want.float())


@pytest.mark.parametrize("cache,bs", [("fp32", 1), ("bf16", 16), ("fp8_e4m3", 32), ("fp8_e5m2", 16)])
def test_copy_blocks_and_compact_slots_match_reference(cache, bs):
    dtype = CACHE_DTYPES[cache]
    gen = torch.Generator().manual_seed(bs)
    nb = 8
    pools = [random_pool(nb, bs, 3, 64, dtype, None, gen, DEVICE) for _ in range(2)]
    mine = [p.clone() for p in pools]
    src, dst = torch.tensor([0, 5, 2], device=DEVICE), torch.tensor([7, 1, 6], device=DEVICE)
    copy_blocks(*mine, src, dst)
    copy_blocks_ref(*pools, src, dst)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(mine, pools))
    # keep every other token of slots [0, 3 * bs) and pack them at the front (overlapping, in place)
    keep = torch.arange(0, 3 * bs, 2, device=DEVICE)
    packed = torch.arange(keep.numel(), device=DEVICE)
    compact_slots(*mine, keep, packed)
    compact_slots_ref(*pools, keep, packed)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(mine, pools))


def test_block_ops_with_no_work():
    pools = [torch.randn(2, 16, 1, 64, device=DEVICE) for _ in range(2)]
    before = [p.clone() for p in pools]
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    copy_blocks(*pools, empty, empty)
    compact_slots(*pools, empty, empty)
    assert all(torch.equal(a, b) for a, b in zip(pools, before))

"""fp8 cache formats: registry, parameters, per-token and fixed scaling, round trips within the fp8 grid,
and the Triton kernels reading per-token pages as the torch reference does."""

import pytest
import torch

from kvlab.cache.block_manager import LayerGroup
from kvlab.kernels.reference.paged_attention import paged_attention_ref
from kvlab.kernels.reference.store_kv import dequantize_ref, store_kv_ref
from kvlab.cache.kv_cache import KVCache
from kvlab.cache.quant.fp8 import FP8TokenCodec
from kvlab.registry import QUANT_FORMATS, build

DTYPES = [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]


@pytest.mark.parametrize("name,dtype", DTYPES)
def test_fp8_formats_registered(name, dtype):
    fmt = build("quant", name)
    assert name in QUANT_FORMATS.names()
    assert fmt.storage_dtype(torch.bfloat16) == dtype and fmt.scaling == "token" and fmt.packed
    assert fmt.init_scales(4, "cpu") is None  # per-token scales live in the pages
    k, v = fmt.storage(16, 4, 64, torch.float32)
    assert k["data"].dtype == dtype and k["scale"].shape == (16, 4) and k["scale"].dtype == torch.float16
    assert fmt.bytes_per_token(4, 64, 16, torch.float32) == 2 * (4 * 64 + 4 * 2)  # codes + a scale per head
    fixed = build("quant", name, scaling="fixed")
    assert not fixed.packed and fixed.bytes_per_token(4, 64, 16, torch.float32) == 2 * 4 * 64
    k, v = fixed.init_scales(4, "cpu")
    assert torch.equal(k, torch.ones(4)) and k is not v


def test_fp8_parameters_are_checked():
    with pytest.raises(ValueError, match="scale must be a positive"):
        build("quant", "fp8_e4m3", scale=0.0)
    with pytest.raises(ValueError, match="scaling must be one of token, fixed"):
        build("quant", "fp8_e4m3", scaling="head")
    with pytest.raises(ValueError, match="candidates must be an integer in"):
        build("quant", "fp8_e4m3", candidates=0)


@pytest.mark.parametrize("name,dtype", DTYPES)
@pytest.mark.parametrize("candidates", [1, 8])
def test_per_token_scales_depend_on_the_token_alone(name, dtype, candidates):
    """A token's codes and scale are the same whatever is encoded with it (other tokens, other chunks),
    nothing saturates (the amax maps to at most fp8_max), and every element is within half the grid's
    spacing there (`steps`); more candidates never round a token worse."""
    codec = FP8TokenCodec(dtype, candidates)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 64, generator=g) * torch.logspace(-3, 3, 40).view(40, 1, 1)  # 1e-3 .. 1e3 tokens
    x[5, 1] = 0.0  # an all-zero head
    whole = codec.encode_tokens(x)
    for lo, hi in ((0, 1), (3, 17), (17, 40)):
        part = codec.encode_tokens(x[lo:hi])
        assert torch.equal(part["scale"], whole["scale"][lo:hi])
        assert torch.equal(part["data"].view(torch.uint8), whole["data"][lo:hi].view(torch.uint8))
    parts = {n: t.unsqueeze(0) for n, t in whole.items()}  # one "page" of 40 slots
    back = codec.decode(parts, torch.float32)[0]
    assert bool(((back - x).abs() <= codec.steps(parts)[0] / 2 * (1 + 1e-6)).all())
    assert bool((whole["data"].float().abs() <= codec.max_value).all()) and torch.equal(back[5, 1], x[5, 1])
    if candidates > 1:
        amax_only = codec.decode({n: t.unsqueeze(0) for n, t in FP8TokenCodec(dtype, 1).encode_tokens(x).items()},
                                 torch.float32)[0]
        assert bool(((back - x).square().sum(-1) <= (amax_only - x).square().sum(-1)).all())


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fixed_scale_round_trip_within_fp8_precision(name):
    fmt = build("quant", name, scaling="fixed", scale=0.25)
    dtype = fmt.storage_dtype(torch.float32)
    key, value = torch.randn(16, 2, 32) * 5, torch.randn(16, 2, 32)
    scales = fmt.init_scales(2, "cpu")
    assert torch.equal(scales[0], torch.full((2,), 0.25))
    k_cache = torch.randn(2, 8, 2, 32).to(dtype)
    v_cache = torch.randn(2, 8, 2, 32).to(dtype)
    store_kv_ref(key, value, k_cache, v_cache, torch.arange(16), *scales)
    eps = torch.finfo(dtype).eps
    for cache, x, s in ((k_cache, key, scales[0]), (v_cache, value, scales[1])):
        back = dequantize_ref(cache.view(16, 2, 32), s, torch.float32)
        tiny = torch.finfo(dtype).smallest_normal * eps * s.view(1, -1, 1)
        assert bool(((back - x).abs() <= eps / 2 * x.abs() + tiny).all())


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_triton_attention_reads_per_token_fp8_pages(name):
    """The Triton kernels (codec.load_packed KIND 3) against the torch reference on per-token fp8 pages."""
    from kvlab.kernels.paged_attention import paged_attention

    torch.manual_seed(3)
    cache = KVCache([LayerGroup((0,))], 8, 16, 2, 64, build("quant", name, candidates=4), torch.float32, "cpu")
    lens, tables = [20, 35, 3], [[1, 2], [3, 4, 5], [6]]
    slots = torch.cat([torch.tensor(t)[torch.arange(n) // 16] * 16 + torch.arange(n) % 16
                       for t, n in zip(tables, lens)])
    x = torch.randn(len(slots), 2, 64) * 3
    cache.begin_step([slots])
    cache.store(0, x, x.flip(-1), slots)
    bt, cu = torch.tensor([[1, 2, -1], [3, 4, 5], [6, -1, -1]]), torch.tensor([0, 1, 4, 5])
    q = torch.randn(5, 4, 64)
    got, stats = paged_attention(q, cache.k(0), cache.v(0), bt, cu, torch.tensor(lens), 0.125, return_stats=True)
    want, want_stats = paged_attention_ref(q, cache.k(0), cache.v(0), bt, cu, torch.tensor(lens), 0.125,
                                           return_stats=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(stats, want_stats, atol=1e-4, rtol=1e-4)

"""fp8 cache formats: registry, parameters, calibration, and a store/read round trip."""

import pytest
import torch

from kvlab.kernels.reference.store_kv import dequantize_ref, store_kv_ref
from kvlab.registry import QUANT_FORMATS, build


@pytest.mark.parametrize("name,dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_formats_registered(name, dtype):
    fmt = build("quant", name)
    assert name in QUANT_FORMATS.names()
    assert fmt.storage_dtype(torch.bfloat16) == dtype
    assert fmt.bytes_per_element(torch.bfloat16) == 1
    k, v = fmt.init_scales(4, "cpu")
    assert k.shape == (4,) and k.dtype == torch.float32 and k is not v


def test_fp8_parameters_are_checked():
    with pytest.raises(ValueError, match="scale must be a positive"):
        build("quant", "fp8_e4m3", scale=0.0)
    with pytest.raises(ValueError, match="granularity"):
        build("quant", "fp8_e4m3", granularity="channel")


@pytest.mark.parametrize("granularity", ["head", "tensor"])
def test_calibrate_uses_full_range(granularity):
    fmt = build("quant", "fp8_e4m3", granularity=granularity)
    key = torch.randn(7, 3, 16) * torch.tensor([1.0, 10.0, 100.0]).view(1, 3, 1)  # [T, Hkv, D]
    value = torch.randn(7, 3, 16)
    scales = fmt.init_scales(3, "cpu")
    fmt.calibrate(key, value, scales)
    amax = key.abs().amax(dim=(0, 2))
    want = amax if granularity == "head" else amax.max().expand(3)
    torch.testing.assert_close(scales[0], want / 448.0)


def test_fixed_scale_is_kept():
    fmt = build("quant", "fp8_e5m2", scale=0.25)
    scales = fmt.init_scales(2, "cpu")
    fmt.calibrate(torch.randn(3, 2, 8) * 1e3, torch.randn(3, 2, 8), scales)
    assert torch.equal(scales[0], torch.full((2,), 0.25))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_round_trip_within_fp8_precision(name):
    fmt = build("quant", name)
    dtype = fmt.storage_dtype(torch.float32)
    key, value = torch.randn(16, 2, 32) * 5, torch.randn(16, 2, 32)
    scales = fmt.init_scales(2, "cpu")
    fmt.calibrate(key, value, scales)
    k_cache = torch.randn(2, 8, 2, 32).to(dtype)
    v_cache = torch.randn(2, 8, 2, 32).to(dtype)
    store_kv_ref(key, value, k_cache, v_cache, torch.arange(16), *scales)
    eps = torch.finfo(dtype).eps
    for cache, x, s in ((k_cache, key, scales[0]), (v_cache, value, scales[1])):
        back = dequantize_ref(cache.view(16, 2, 32), s, torch.float32)
        tiny = torch.finfo(dtype).smallest_normal * eps * s.view(1, -1, 1)
        assert bool(((back - x).abs() <= eps / 2 * x.abs() + tiny).all())

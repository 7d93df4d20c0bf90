"""Round trips of real keys and values (captured from SmolLM2-135M and Gemma3-270M on a short
text) through every integer format: each element within half a quantisation step."""

import pytest
import torch

from kvlab.cache.block_manager import LayerGroup
from kvlab.cache.kv_cache import KVCache
from kvlab.registry import build

TEXT = ("The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in fixed-size "
        "blocks, and a cache format decides how many bytes each of them costs. ") * 3


_CAPTURED: dict = {}


def captured_kv(loaded, layers=(0, 1, -1)):
    """[(key [T, Hkv, D], value [T, Hkv, D]) for a few layers] from one forward pass (once per model)."""
    if id(loaded) not in _CAPTURED:
        _CAPTURED[id(loaded)] = _capture(loaded, layers)
    return _CAPTURED[id(loaded)]


def _capture(loaded, layers):
    ids = loaded.tokenizer(TEXT, return_tensors="pt").input_ids[:, :128]
    with torch.inference_mode():
        cache = loaded.model(ids, use_cache=True).past_key_values
    return [(cache.layers[i].keys[0].transpose(0, 1).float(), cache.layers[i].values[0].transpose(0, 1).float())
            for i in layers]


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_real_kv_round_trip_within_the_bound(load_reference, model, name):
    quant = build("quant", name, **({} if name == "int8" else {"residual": 0}))
    for key, value in captured_kv(load_reference(model)):
        T, hkv, d = key.shape
        bs = 32
        cache = KVCache([LayerGroup((0,))], T // bs + 1, bs, hkv, d, quant, torch.float32, "cpu")
        slots = torch.arange(T // bs * bs)
        cache.begin_step([slots], None if cache.residual is None else [set(range(T // bs))])
        cache.store(0, key[: len(slots)], value[: len(slots)], slots)
        k, v = cache.read_slots(0, slots, torch.float32)
        assert cache.area is None or not cache.area.open_pages()
        for side, got, x in (("k", k, key), ("v", v, value)):
            step = (cache.k if side == "k" else cache.v)(0).steps_at(slots)  # all pages sealed: no exact reads
            err = (got - x[: len(slots)]).abs()
            assert bool((err <= step / 2 * (1 + 1e-5) + 1e-6).all()), (model, name, side, float(err.max()))
            rel = float(err.pow(2).mean().sqrt() / x.pow(2).mean().sqrt())
            assert rel < {"int8": 0.02, "int4": 0.2, "int2": 0.8}[name], (model, name, side, rel)

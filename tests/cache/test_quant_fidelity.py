"""Quantised caches checked by what they hold, not by lengths: every format against fp32 on the tiny models.

Two layers of checks:
- what is read back equals what was stored, within the format's own rounding bound computed here from the
  stored values (int8: half a step of amax / 127 per token and KV head; KIVI int4 / int2: half a step of
  (max - min) / (2^bits - 1) per key channel over a group of tokens, per value token over a group of
  channels; bf16 / fp16: half an ulp), so keys decoding to zeros or one scale for a whole tensor fail;
- the next-token distributions of scored continuations against an fp32 cache: mean KL per format below a
  bound, greedy (argmax) agreement above one, and more bits never worse (int8 < int4 < int2,
  e4m3 < e5m2), so a format that silently kept fp32, or decoded garbage, fails.

The tiny random models attend almost uniformly at their initial weights (a key's error then hardly moves
the output); their query / key projections and head are scaled up here so that attention is peaked and
the cache's contents decide the distributions.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.models import load_model

G = 8  # the KIVI group size used here (divides the tiny heads' 16 / 32 channels and the 16-token pages)
PACKED = {"int8": {}, "int4": {"group_size": G, "residual": 0}, "int2": {"group_size": G, "residual": 0}}
# mean KL(fp32 || format) per scored token, and the least greedy agreement, measured x ~3 (fp8, int4, int2)
BOUNDS = {
    "random:llama-tiny": {"bf16": (1e-6, 0.95), "fp16": (1e-6, 0.95), "fp8_e4m3": (2e-4, 0.9),
                          "fp8_e5m2": (8e-4, 0.9), "int8": (1e-5, 0.95), "int4": (4e-4, 0.9), "int2": (1.2e-2, 0.6)},
    "random:gemma3-tiny": {"bf16": (2e-5, 0.95), "fp16": (1e-6, 0.95), "fp8_e4m3": (3e-3, 0.85),
                           "fp8_e5m2": (1e-2, 0.8), "int8": (2e-4, 0.9), "int4": (4e-3, 0.85), "int2": (8e-2, 0.45)},
}
FORMATS = {"bf16": {}, "fp16": {}, "fp8_e4m3": {}, "fp8_e5m2": {}, **PACKED}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def sharpened(name: str):
    loaded = load_model(name)
    for layer in loaded.model.model.layers:
        layer.self_attn.q_proj.weight.data *= 6
        layer.self_attn.k_proj.weight.data *= 6
    loaded.model.lm_head.weight.data *= 5
    return loaded


@pytest.fixture(scope="module")
def models():
    return {name: sharpened(name) for name in BOUNDS}


def engine(models, name: str, quant: str, quant_args: dict | None = None, **kw) -> LLM:
    return LLM(name, loaded=copy.deepcopy(models[name]), quant=quant, quant_args=quant_args or {}, block_size=16,
               kv_cache_memory="4MiB", **kw)


def requests(seed: int = 0, n: int = 3, ctx: int = 96, cont: int = 16):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randint(3, 256, (ctx,), generator=g).tolist() for _ in range(n)],
            [torch.randint(3, 256, (cont,), generator=g).tolist() for _ in range(n)])


def dists(llm: LLM, contexts, continuations) -> torch.Tensor:
    """[tokens, vocab] log-probs of every continuation token."""
    return torch.cat([o.dists for o in llm.score(contexts, continuations, return_dists=True)])


def kl_and_agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    kl = (ref.exp() * (ref - got)).sum(dim=-1)  # [tokens] KL(ref || got)
    return float(kl.mean()), float((ref.argmax(-1) == got.argmax(-1)).float().mean())


# -- the next-token distributions against fp32 -----------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_each_format_stays_close_to_fp32_and_more_bits_are_closer(models, name):
    contexts, continuations = requests()
    ref = dists(engine(models, name, "fp32"), contexts, continuations)
    measured = {}
    for quant, args in FORMATS.items():
        measured[quant] = kl_and_agreement(ref, dists(engine(models, name, quant, args), contexts, continuations))
    for quant, (kl, agree) in measured.items():
        most, least = BOUNDS[name][quant]
        assert kl <= most and agree >= least, f"{name} {quant}: KL {kl:.2e} (bound {most:.0e}), greedy agreement " \
                                              f"{agree:.3f} (at least {least})"
    kl = {q: m[0] for q, m in measured.items()}
    assert kl["int8"] < kl["int4"] < kl["int2"] and kl["fp8_e4m3"] < kl["fp8_e5m2"], kl  # the bits are really cut


def test_int4_with_a_residual_window_and_a_prefix_hit_stays_close_to_fp32(models):
    """The residual window's open pages and a prefix hit's shared sealed pages read what was stored."""
    name = "random:llama-tiny"
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 256, (64,), generator=g).tolist()
    contexts = [prefix + torch.randint(3, 256, (32,), generator=g).tolist() for _ in range(2)]
    continuations = [torch.randint(3, 256, (16,), generator=g).tolist() for _ in range(2)]
    ref = dists(engine(models, name, "fp32"), contexts[1:], continuations[1:])
    llm = engine(models, name, "int4", {"group_size": G, "residual": 16}, enable_prefix_caching=True,
                 max_prefill_chunk=16)
    llm.score(contexts[:1], continuations[:1])
    llm.reset_stats()
    kl, agree = kl_and_agreement(ref, dists(llm, contexts[1:], continuations[1:]))
    assert llm.stats()["prefix_hit_tokens"] >= 48  # the second request read the first one's pages
    assert kl <= BOUNDS[name]["int4"][0] and agree >= BOUNDS[name]["int4"][1], (kl, agree)


# -- what is read back against what was stored ----------------------------------------------------------------
def group_range(x: torch.Tensor, group: torch.Tensor, dim_groups: int | None = None) -> torch.Tensor:
    """x [N, Hkv, D]; group [N] the group of each row -> (max - min) over the rows of each group, per
    element, broadcast back to [N, Hkv, D]."""
    index = group[:, None, None].expand_as(x)
    count = int(group.max()) + 1
    hi = torch.full((count, *x.shape[1:]), -torch.inf).scatter_reduce(0, index, x, "amax")
    lo = torch.full((count, *x.shape[1:]), torch.inf).scatter_reduce(0, index, x, "amin")
    return (hi - lo).gather(0, index)


def channel_range(x: torch.Tensor, size: int) -> torch.Tensor:
    """x [N, Hkv, D] -> (max - min) over each group of `size` channels, broadcast to [N, Hkv, D]."""
    n, h, d = x.shape
    xg = x.view(n, h, d // size, size)
    return (xg.amax(-1, keepdim=True) - xg.amin(-1, keepdim=True)).expand_as(xg).reshape(n, h, d)


def rounding_bound(quant: str, x: torch.Tensor, slots: torch.Tensor, block_size: int, keys: bool) -> torch.Tensor:
    """[N, Hkv, D]: how far the format may move each stored element (half a quantisation step, and a little
    for the float16 rounding of scales), from the stored values alone."""
    if quant in ("bf16", "fp16"):
        return x.abs() * 2.0 ** -8 + 1e-30 if quant == "bf16" else x.abs() * 2.0 ** -11 + 2.0 ** -25  # subnormals
    if quant == "int8":  # symmetric per token and KV head
        return (x.abs().amax(dim=-1, keepdim=True) / 127 / 2 * (1 + 2 ** -9)).expand_as(x) + 1e-7
    qmax = (1 << {"int4": 4, "int2": 2}[quant]) - 1
    if keys:  # per channel over G tokens of a page
        span = group_range(x, (slots // block_size) * (block_size // G) + (slots % block_size) // G)
    else:  # per token over G channels
        span = channel_range(x, G)
    return span / qmax / 2 * (1 + 2 ** -8) + 1e-6


@pytest.mark.parametrize("quant", ["bf16", "fp16", *PACKED])
def test_what_the_cache_reads_back_is_what_was_stored(models, quant):
    """Every K and V element stored during prefill and decode of two requests (every layer, every head),
    read back through the format, is within the format's rounding of the value stored."""
    llm = engine(models, "random:llama-tiny", quant, FORMATS[quant])
    cache, engine_ = llm.engine.cache, llm.engine
    stored: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> slot -> (k, v) [Hkv, D]
    store = cache.store

    def recording(layer, key, value, slot_mapping, *args, **kwargs):
        for i, s in enumerate(slot_mapping.tolist()):
            if s >= 0:
                stored.setdefault(layer, {})[s] = (key[i].float().clone(), value[i].float().clone())
        return store(layer, key, value, slot_mapping, *args, **kwargs)

    cache.store = recording
    contexts, _ = requests(seed=2, n=2, ctx=70)
    for prompt in contexts:
        engine_.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine_.scheduler.waiting or any(s.num_output_tokens < 3 for s in engine_.scheduler.running):
        engine_.step()  # stop before the requests finish: their pages still hold what they stored
    moved = False
    for layer, by_slot in stored.items():
        slots = torch.tensor(sorted(by_slot))
        want_k = torch.stack([by_slot[s][0] for s in slots.tolist()])  # [N, Hkv, D]
        want_v = torch.stack([by_slot[s][1] for s in slots.tolist()])
        got_k, got_v = cache.read_slots(layer, slots, torch.float32)
        for side, want, got in (("K", want_k, got_k), ("V", want_v, got_v)):
            bound = rounding_bound(quant, want, slots, cache.block_size, keys=side == "K")
            excess = ((got - want).abs() / bound).max()
            assert excess <= 1, f"{quant} layer {layer} {side}: an element read back {float(excess):.1f}x its bound"
            moved |= bool((got != want).any())
    assert sorted(stored) == [0, 1] and all(len(by_slot) >= 140 for by_slot in stored.values())
    assert moved  # the format rounded something: the values were really stored in it

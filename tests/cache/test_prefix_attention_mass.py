"""H2O with prefix caching: a hit starts from the attention its prefix's own queries paid the prefix's keys
(kvlab.policies.prefix_mass), so its statistics are those of a run that computed the prefix itself."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache.prefix_cache import PrefixCache
from kvlab.llm import LLM
from kvlab.policies.prefix_mass import PrefixMass
from kvlab.registry import PREFIX_EVICTIONS
from kvlab.sampling_params import SamplingParams
from kvlab.testing import check_combination

H2O = {"budget": 128, "recent": 4}  # nothing evicted: the prompt's pages stay registered (and the stats whole)
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def prompts(seed: int = 0) -> tuple[list[int], list[int]]:
    """Two prompts sharing their first 48 tokens (3 pages of 16): A of 53, B of 68."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (48,), generator=g).tolist()
    return shared + torch.randint(3, 256, (5,), generator=g).tolist(), shared + torch.randint(3, 256, (20,), generator=g).tolist()


def engine(on: bool, **kwargs) -> LLM:
    return LLM("random:llama-tiny", block_size=16, kv_cache_memory="2MiB", enable_prefix_caching=on,
               prefix_keep_shared=False, policy="h2o", policy_args=H2O, **kwargs)


def mass_at_compression(llm: LLM, prompt: list[int]) -> tuple[dict[int, torch.Tensor], int]:
    """The running totals `prompt` is compressed with at its end, and the tokens it took from the prefix cache."""
    compressor, seen = llm.engine.compressor, {}
    compress = compressor.compress

    def record(seq, queries, mass=None):
        seen["mass"] = {layer: m.clone() for layer, m in (mass or {}).items()}
        seen["hit"] = llm.engine.block_manager.num_hit_tokens(seq)
        return compress(seq, queries, mass)
    compressor.compress = record
    llm.generate([prompt], PARAMS)
    compressor.compress = compress
    return seen["mass"], seen["hit"]


def test_a_hit_starts_from_the_prefix_s_own_attention_and_ends_with_the_statistics_of_a_recompute():
    """B hits A's 48 cached tokens: its totals (the prefix's kept mass + its own queries') equal, to the bit,
    those of a run without caching that ends its chunks where the hit run does (48, 64: the same passes, so
    the same K/V bits and the same sums in the same order), and those of a run computing B in one chunk to
    fp32 rounding (a pass of another shape: K/V and the step's sum differ in their last bits)."""
    a, b = prompts()
    on = engine(True)
    on.generate([a], PARAMS)
    assert len(on.engine.compressor.prefix_mass) == 1  # the block ending at token 48 (A's last page boundary)
    hit_mass, hit = mass_at_compression(on, b)
    assert hit == 48
    off = engine(False)
    stop_at = off.engine.scheduler.stop_at  # the hit run's chunks: [48, 64) (B's own kept boundary), [64, 68)
    off.engine.scheduler.stop_at = lambda seq: min([p for p in (48, 64, stop_at(seq)) if p is not None
                                                    and p > seq.num_computed_tokens], default=None)
    chunked, _ = mass_at_compression(off, b)
    whole, _ = mass_at_compression(engine(False), b)
    assert hit_mass.keys() == chunked.keys() == whole.keys() and hit_mass
    for layer in hit_mass:
        assert hit_mass[layer].shape[0] == 68
        assert torch.equal(hit_mass[layer], chunked[layer]), f"layer {layer}: seeded + later mass != recompute"
        torch.testing.assert_close(hit_mass[layer], whole[layer], rtol=1e-5, atol=1e-5)


def test_a_hit_ending_inside_a_page_is_cut_back_to_the_kept_statistics():
    """The radix tree would share A's partly filled last page (tokens 48..52); no mass is kept there, so the hit
    stops at token 48, where it is."""
    a, _ = prompts()
    on = engine(True, prefix_cache="radix")
    on.generate([a], PARAMS)
    assert mass_at_compression(on, a[:51] + [9] * 10)[1] == 48


def test_the_kept_mass_goes_when_a_page_of_its_prefix_is_evicted():
    pc = PrefixCache(4, PREFIX_EVICTIONS.build("lru"))
    store = PrefixMass()
    pc.on_unregister.append(store.drop)
    pc.commit(1, list(range(8)), 8, b"", [[10, 11]])
    first, second = pc.chains[1]
    store.put(first, {0: torch.zeros(4, 1)})
    store.put(second, {0: torch.zeros(8, 1)})
    pc.park([10, 11])
    while store.has(second):
        pc.evict()
    assert len(store) == (1 if first.pages else 0)
    assert all(node.pages for node in (first, second) if store.has(node))


@pytest.mark.heavy  # ~25 s each on two shared cores
@pytest.mark.parametrize("when", ["prefill", "decode"])
@pytest.mark.parametrize("prefix_cache", ["hash", "radix"])
def test_h2o_with_prefix_caching_that_copies_a_hits_pages_is_exact(when, prefix_cache):
    args = {"budget": 32, "recent": 8, "when": when, **({"every": 8} if when == "decode" else {})}
    assert check_combination(policy="h2o", policy_args=args, enable_prefix_caching=True, prefix_cache=prefix_cache,
                             prefix_keep_shared=False) == "exact"

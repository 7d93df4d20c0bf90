"""Every registered cache format and allocator runs with every other option's defaults (EngineConfig()),
on the default model's shapes: int4 / int2 with the engine's 16-token pages (their groups follow the
block size), and the contiguous allocator with the default 256 MiB pool (it reserves a request's
length, not SmolLM2's 8,192 positions)."""

import pytest

from kvlab import LLM, SamplingParams
from kvlab.engine_config import EngineConfig
from kvlab.models import load_model
from kvlab.registry import ALLOCATORS, QUANT_FORMATS

# SmolLM2-135M's KV shapes (30 layers, 3 KV heads of 64, 8,192 positions) around random tiny compute
SHAPES = "random:kv-smollm2"
PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def loaded():
    return load_model(SHAPES)


def run_with_defaults(loaded, **option):
    """One request on an engine whose every field but `option` is EngineConfig()'s default."""
    llm = LLM(SHAPES, loaded=loaded, **option)
    defaults = EngineConfig()
    config = llm.engine.config
    assert (config.block_size, config.kv_cache_memory, config.max_num_seqs) == \
        (defaults.block_size, defaults.kv_cache_memory, defaults.max_num_seqs)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    return llm


@pytest.mark.parametrize("quant", QUANT_FORMATS.names())
def test_every_format_runs_with_the_default_engine(loaded, quant):
    llm = run_with_defaults(loaded, quant=quant)
    assert llm.engine.block_manager.num_used_blocks() == 0
    if getattr(llm.engine.quant, "group_size", 0) is None:  # KIVI: key groups follow the 16-token pages
        key_codec, value_codec = llm.engine.cache.codecs
        assert (key_codec.group_size, value_codec.group_size) == (16, 32)


@pytest.mark.parametrize("allocator", ALLOCATORS.names())
def test_every_allocator_runs_with_the_default_engine(loaded, allocator):
    llm = run_with_defaults(loaded, allocator=allocator)
    bm = llm.engine.block_manager
    assert bm.num_blocks * bm.block_size < llm.engine.max_model_len  # a max_model_len reservation cannot fit
    assert bm.num_used_blocks() == 0

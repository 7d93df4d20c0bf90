"""Every quant option, as `kvlab-run quant=<option>` composes it, fits the default engine's pages on the
default model's shapes, and the contiguous allocator composes to a reservation that fits the default
pool (without loading a model: the shapes are SmolLM2-135M's, kvlab.models.RANDOM_SHAPES)."""

from __future__ import annotations

import pytest
from exp_helpers import CONF_DIR

from kvlab.study.config import validate
from kvlab.engine_config import EngineConfig
from kvlab.study.experiment import llm_kwargs
from kvlab.models import RANDOM_SHAPES
from kvlab.registry import ALLOCATORS, QUANT_FORMATS

SMOLLM2 = RANDOM_SHAPES["llama-135m"]


def quant_options() -> list[str]:
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from kvlab.study.conf_plugins import register_plugin_configs

    register_plugin_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return GlobalHydra.instance().config_loader().get_group_options("quant")


@pytest.mark.parametrize("option", quant_options())
def test_every_quant_option_fits_the_default_pages(compose, option):
    engine = EngineConfig(**llm_kwargs(validate(compose([f"quant={option}"]))))
    assert engine.block_size == EngineConfig().block_size
    fmt = QUANT_FORMATS.build(engine.quant, **engine.quant_args)
    fmt.check_shape(SMOLLM2["num_key_value_heads"], SMOLLM2["head_dim"], engine.block_size)  # raises if not


@pytest.mark.parametrize("override", ["engine.allocator=contiguous", "engine=contiguous"])
def test_contiguous_composes_to_a_reservation_the_default_pool_holds(compose, override):
    engine = EngineConfig(**llm_kwargs(validate(compose([override]))))
    allocator = ALLOCATORS.build(engine.allocator, **engine.allocator_args)
    fp32_token = 2 * SMOLLM2["num_hidden_layers"] * SMOLLM2["num_key_value_heads"] * SMOLLM2["head_dim"] * 4
    pool_blocks = engine.kv_cache_memory // (fp32_token * engine.block_size)
    allocator.setup(pool_blocks, engine.block_size, SMOLLM2["max_position_embeddings"])
    assert allocator.can_allocate(100, 100 + 256)  # a 100-token prompt asking for 256 new tokens

"""What a run's config is checked for before its model loads, beyond its schema (kvlab.study.config).

    check_before_load(config)   # a validated config (kvlab.study.config.validate); ConfigError naming the path

`kvlab.study.config.validate` checks every section against its schema and builds each plugin alone. The
checks here need the data folder or the model's shape, read from its config without the weights
(a random shape's, or the model folder's config.json through transformers' AutoConfig); the device
and the kernel backend are EngineConfig's own checks (kvlab.engine_config), run by validate:

- quant: the format stores the model's KV heads in pages of engine.block_size (QuantFormat.check_shape);
- engine.kv_cache_memory: the pool holds at least one page, sized as the engine sizes it (the layer
  groups the policy asks for, the bytes of one page, the residual area of a format that keeps one);
- task, workload: every data source they name exists (kvlab.study.tasks.data.data_path): the string fields
  named in DATA_FIELDS, whatever the class (`trace` may be an Azure trace's name, conv or code).

The engine checks all of this again when it is built (kvlab.engine.llm_engine); what needs the weights, or
the config of a hub model that is not on disk, is left to it.
"""

from __future__ import annotations

from kvlab.study.config import engine_options
from kvlab.engine_config import EngineConfig
from kvlab.schema import ConfigError

DATA_FIELDS = ("source", "haystack", "corpus", "trace")  # fields of a task / workload that name its data


def check_before_load(config: dict) -> None:
    """Raise ConfigError (naming the config path) for what would fail once the model is loaded."""
    engine = EngineConfig(**engine_options(config))
    model = model_config(engine.model)
    if model is not None:
        check_pool(engine, model)
    for section in ("task", "workload"):
        check_data(section, config.get(section), config.get("data_dir"))


def one_line(exc: BaseException | str) -> str:
    """A message on one line (a config error is printed as one): its lines stripped, joined by "; "."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def model_config(name: str):
    """The model's transformers config, read without its weights; None for a hub id (not on disk)."""
    from kvlab.models import random_config, resolve

    if name.startswith("random:"):
        return random_config(name.split(":", 1)[1])
    try:
        folder = resolve(name)  # a packaged model or a .gguf file: its converted folder (converted once)
    except (OSError, KeyError) as exc:
        raise ConfigError(f"model.name: {one_line(exc)}") from None
    if folder is None:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.name: cannot read the model's config in {folder} ({one_line(exc)})") from None


def check_pool(config: EngineConfig, model) -> None:
    """The format fits the model's heads and pages, and the pool holds one page (as LLMEngine sizes it)."""
    import torch

    from kvlab.cache.kv_cache import bytes_per_block
    from kvlab.engine.build import layer_groups
    from kvlab.engine.build import residual_budget
    from kvlab.registry import POLICIES, QUANT_FORMATS, load_plugins

    load_plugins()
    policy = POLICIES.build(config.policy, **config.policy_args)
    quant = QUANT_FORMATS.build(config.quant, **config.quant_args)
    heads = model.num_key_value_heads
    head_dim = getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads
    try:
        quant.check_shape(heads, head_dim, config.block_size)
    except ValueError as exc:
        raise ConfigError(f"quant: {one_line(exc)} (engine.block_size={config.block_size}, the model's head_dim "
                          f"{head_dim})") from None
    groups = layer_groups(model, per_layer=policy.compresses, per_head=policy.head_budgets)
    dtype = getattr(torch, config.dtype)
    page = bytes_per_block(groups, config.block_size, heads, head_dim, quant, dtype)
    _, residual = residual_budget(quant, groups, config, heads, head_dim, dtype)
    if config.kv_cache_memory - residual < page:
        layers = len(groups[0].layers)
        raise ConfigError(
            f"engine.kv_cache_memory: {config.kv_cache_memory} bytes is less than one page of "
            f"{config.block_size} tokens ({page:.0f} bytes: {layers} layer{'s' * (layers > 1)} of "
            f"{config.model!r}, cache format {config.quant!r}"
            + (f", after {residual} bytes of residual area" if residual else "") + "); raise it")


def check_data(section: str, node: dict | None, data_dir: str | None) -> None:
    """Every data source a task / workload names (DATA_FIELDS) exists under the data folder, or absolute."""
    if not node:
        return
    from kvlab.study.tasks.data import MissingDataError, data_path
    from kvlab.study.workloads.azure import TRACES

    for key in DATA_FIELDS:
        source = node.get(key)
        if not isinstance(source, str) or source.startswith("hub:"):
            continue
        try:
            data_path(TRACES.get(source, source) if key == "trace" else source, data_dir)
        except MissingDataError as exc:
            raise ConfigError(f"{section}.{key}: {one_line(exc)}") from None

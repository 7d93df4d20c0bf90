"""Config checking: a composed config is validated before any model loads.

`validate(cfg)` checks every section of a composed kvlab config against a
schema: the engine's options (`engine`, `model`, `seed`) against the runtime
`kvlab.engine_config.EngineConfig`, their one definition (its types, defaults and
`__post_init__` checks, errors reported at their config path), the other
top-level keys against `RootConfig`, the plugin sections (`policy`, `draft`, `quant`,
`engine.allocator_args`) against the registered plugin's dataclass fields, and
the `_target_` sections (`task`, `workload`, `logger`) against their class's
fields. It returns a plain dict with every plugin default filled in (so the
logged config shows every parameter) and raises `ConfigError` naming the path
of the first wrong key, type or value::

    engine.block_size: expected int, got str 'big'
    policy.budgett: unknown parameter of policy 'snapkv'; its parameters: budget, window

Plugins are then built once (their `__post_init__` checks values); building a
plugin must stay cheap (no tensors, no model).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from kvlab.engine_config import EngineConfig, EngineOptionError
from kvlab.registry import REGISTRIES, UnknownPluginError
from kvlab.schema import ConfigError, check_type, fields_of, import_target

PLUGIN_SECTIONS = ("policy", "draft", "quant")  # config section == registry kind
TARGET_SECTIONS = ("task", "workload", "logger")
NO_DRAFT = "none"
PACKAGED_MODELS = ("smollm2-135m", "gemma3-270m")

def job_dir_name(override_dirname: str, limit: int = 120) -> str:
    """A sweep job's folder name from its overrides: readable, one path component, never too long.

    Used as `hydra.sweep.subdir: ${kvlab_job_dir:${hydra.job.override_dirname}}`, so a job's
    folder depends only on its overrides and a rerun of the sweep finds it again.
    """
    name = (override_dirname or "default").replace("/", "_")
    if len(name) > limit:
        name = f"{name[:limit - 17]}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"
    return name


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("kvlab_job_dir", job_dir_name, replace=True)


_register_resolvers()  # at import: every process that runs a kvlab job imports this module


# -- where the composed config keeps EngineConfig's fields --------------------------------
# kvlab.engine_config.EngineConfig is flat and is the only schema of the engine's options; the
# composed config splits them into sections:
#   engine.<field>            every field not named below
#   model.name, model.dtype   fields `model`, `dtype`
#   seed                      field `seed` (top level: it seeds the tasks' sampling too)
#   <kind>.name, <kind>.*     fields `<kind>`, `<kind>_args` for kind in policy, quant, draft (draft "none": None)
OUTSIDE_ENGINE = {"model": ("model", "name"), "dtype": ("model", "dtype"), "seed": ("", "seed")}


def _plugin_kind(name: str) -> str | None:
    """The plugin section an EngineConfig field belongs to (`policy`, `policy_args` -> policy), else None."""
    kind = name.removesuffix("_args")
    return kind if kind in PLUGIN_SECTIONS else None


def engine_path(name: str) -> str:
    """The dotted path of EngineConfig field `name` in a composed config."""
    kind = _plugin_kind(name)
    if kind is not None:
        return kind if name.endswith("_args") else f"{kind}.name"
    section, key = OUTSIDE_ENGINE.get(name, ("engine", name))
    return f"{section}.{key}" if section else key


def section_fields(section: str) -> dict[str, tuple[Any, Any]]:
    """{key: (type, default)} of the EngineConfig fields that `section` ("engine", "model", "" = top level) holds."""
    out = {}
    for name, spec in fields_of(EngineConfig).items():
        where = OUTSIDE_ENGINE.get(name, ("engine", name))
        if _plugin_kind(name) is None and where[0] == section:
            out[where[1]] = spec
    return out


def engine_options(config: dict) -> dict:
    """EngineConfig's (and so kvlab.LLM's) keyword arguments from a validated config, every field from its place."""
    kwargs = {}
    for name in fields_of(EngineConfig):
        kind = _plugin_kind(name)
        if kind is not None and name.endswith("_args"):
            kwargs[name] = {k: v for k, v in config[kind].items() if k != "name"}
        elif kind is not None:
            plugin = config[kind]["name"]
            kwargs[name] = None if kind == "draft" and plugin == NO_DRAFT else plugin
        else:
            section, key = OUTSIDE_ENGINE.get(name, ("engine", name))
            kwargs[name] = (config[section] if section else config)[key]
    return kwargs


# -- the top level's own keys -------------------------------------------------------------


@dataclass
class RootConfig:
    name: str = "default"
    data_dir: Optional[str] = None
    progress: bool = True
    skip_existing: bool = True
    fail_fast: bool = False
    sweep_progress_s: float = 10.0


SECTIONS = ("model", "engine", *PLUGIN_SECTIONS, *TARGET_SECTIONS)


# -- the checks ------------------------------------------------------------------


def validate(cfg: Any) -> dict:
    """Check a composed config; return it as a resolved dict with plugin defaults filled in."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        except Exception as exc:  # MissingMandatoryValue, InterpolationResolutionError
            key = getattr(exc, "full_key", "") or "config"
            raise ConfigError(f"{key}: {getattr(exc, 'msg', exc)}") from None
    cfg = dict(cfg)
    cfg.pop("hydra", None)
    root = {**fields_of(RootConfig), **section_fields("")}
    unknown = sorted(set(cfg) - set(root) - set(SECTIONS) - {"experiment", "study"})
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown top-level key; known: {', '.join(sorted(set(root) | set(SECTIONS)))}")
    out = check_fields("", {k: cfg[k] for k in root if k in cfg}, root, fill=True)
    for section in ("model", "engine"):
        if not isinstance(cfg.get(section), dict):
            raise ConfigError(f"{section}: missing or not a mapping (choose an option of the {section}/ group)")
    out["model"] = check_model(cfg["model"])
    out["engine"] = check_fields("engine", cfg["engine"], section_fields("engine"), fill=True)
    for kind in PLUGIN_SECTIONS:
        out[kind] = check_plugin(kind, cfg.get(kind) or {"name": NO_DRAFT if kind == "draft" else None})
    check_engine(out)
    for section in TARGET_SECTIONS:
        out[section] = check_target(section, cfg.get(section))
    out["study"] = check_study(cfg.get("study"))
    return out


def check_study(node: Any) -> dict | None:
    """The `study` section of a search (kvlab.study.study.Study), checked; null outside searches."""
    from kvlab.study.study import make_study

    try:
        study = make_study(node)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc) if str(exc).startswith("study") else f"study: {exc}") from None
    return None if study is None else dataclasses.asdict(study)


def check_model(node: dict) -> dict:
    out = check_fields("model", node, section_fields("model"), fill=True)
    name = out["name"]
    if name.startswith("random:"):
        from kvlab.models import RANDOM_SHAPES

        shape = name.split(":", 1)[1]
        if shape not in RANDOM_SHAPES:
            raise ConfigError(f"model.name: unknown random shape {shape!r}; known: {', '.join(sorted(RANDOM_SHAPES))}")
    elif name not in PACKAGED_MODELS:
        path = Path(name).expanduser()
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        if not path.exists() and (offline or "/" not in name or name.startswith((".", "/", "~"))):
            raise ConfigError(
                f"model.name: {name!r} is not a packaged model ({', '.join(PACKAGED_MODELS)}), random:<shape>, "
                f"an existing local folder or .gguf file" + (", nor (offline) a hub id" if offline else "")
            )
    return out


def check_engine(config: dict) -> None:
    """The engine's options as kvlab.LLM will get them (EngineConfig's checks, errors at their config path);
    then the allocator's parameters, defaults filled in."""
    try:
        EngineConfig(**engine_options(config))
    except EngineOptionError as exc:
        raise ConfigError(f"{engine_path(exc.key)}: {exc.problem}") from None
    engine = config["engine"]
    engine["allocator_args"] = check_plugin_args("allocator", engine["allocator"], engine["allocator_args"],
                                                 "engine.allocator", "engine.allocator_args")
    engine["prefix_eviction_args"] = check_plugin_args(
        "prefix_eviction", engine["prefix_eviction"], engine["prefix_eviction_args"],
        "engine.prefix_eviction", "engine.prefix_eviction_args")
    if "offload_placement" in engine:
        engine["offload_placement_args"] = check_plugin_args(
            "offload_placement", engine["offload_placement"], engine.get("offload_placement_args") or {},
            "engine.offload_placement", "engine.offload_placement_args")
    from kvlab.cache.tiers.offload import offload_problem

    problem = offload_problem(engine.get("offload"), engine.get("offload_args") or {})
    if problem:
        raise ConfigError(f"engine.offload_args: {problem}" if engine.get("offload") in (None, "host", "disk", "host_disk")
                          else f"engine.offload: {problem}")


def check_plugin(kind: str, node: dict) -> dict:
    """A `policy` / `draft` / `quant` section: {name: <registered>, **params}."""
    if not isinstance(node, dict):
        raise ConfigError(f"{kind}: expected a mapping with a `name`, got {node!r}")
    params = dict(node)
    name = params.pop("name", None)
    if kind == "draft" and name in (None, NO_DRAFT):
        if params:
            raise ConfigError(f"draft.{sorted(params)[0]}: draft 'none' takes no parameters")
        return {"name": NO_DRAFT}
    if not isinstance(name, str):
        raise ConfigError(f"{kind}.name: missing; registered: {', '.join(REGISTRIES[kind].names())}")
    return {"name": name, **check_plugin_args(kind, name, params, f"{kind}.name", kind)}


def check_plugin_args(kind: str, name: str, params: dict, name_path: str, path: str) -> dict:
    """Check `params` against plugin `name`'s dataclass, fill defaults, build it once (values)."""
    registry = REGISTRIES[kind]
    try:
        cls = registry.get(name)
    except UnknownPluginError as exc:
        raise ConfigError(f"{name_path}: {exc}") from None
    out = check_fields(path, params, cls, fill=True, what=f"{registry.kind} {name!r}")
    try:
        registry.build(name, **out)
    except Exception as exc:
        raise ConfigError(f"{path}: {registry.kind} {name!r} rejects its parameters: {exc}") from None
    return out


def check_target(section: str, node: Any) -> dict | None:
    """A `_target_` section (task, workload, logger): fields of the target class; None when disabled."""
    if node is None or node.get("_target_") is None:
        return None
    params = dict(node)
    target = params.pop("_target_")
    cls = import_target(target, f"{section}._target_")
    out = check_fields(section, params, cls, fill=True, what=f"{section} {cls.__name__}")
    try:
        cls(**out)
    except Exception as exc:
        raise ConfigError(f"{section}: {cls.__name__} rejects its parameters: {exc}") from None
    return {"_target_": target, **out}


# -- dataclass fields -----------------------------------------------------------


def plugin_defaults(cls: type) -> dict[str, Any]:
    """Config-friendly defaults of a plugin's init fields ('???' for required ones)."""
    return {k: to_config_value(d) for k, (_, d) in fields_of(cls).items()}


def to_config_value(value: Any) -> Any:
    if value is dataclasses.MISSING:
        return "???"
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (tuple, list)):
        return [to_config_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_config_value(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a wrapped plugin
        inner = {f.name: to_config_value(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {"name": getattr(type(value), "registry_name", type(value).__name__), **inner}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def check_fields(path: str, node: dict, schema: type | dict, fill: bool = False, what: str | None = None) -> dict:
    """Check `node`'s keys and value types against `schema` (a dataclass's init fields, or
    {key: (type, default)}); fill defaults if `fill`."""
    if not isinstance(node, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {node!r}")
    fields = schema if isinstance(schema, dict) else fields_of(schema) if dataclasses.is_dataclass(schema) else {}
    prefix = f"{path}." if path else ""
    for key in node:
        if key not in fields:
            known = ", ".join(fields) or "(none)"
            raise ConfigError(f"{prefix}{key}: unknown parameter of {what or path}; its parameters: {known}")
    out = {}
    for key, (annotation, default) in fields.items():
        if key in node:
            out[key] = check_type(f"{prefix}{key}", node[key], annotation)
        elif default is dataclasses.MISSING:
            raise ConfigError(f"{prefix}{key}: required parameter of {what or path} is missing")
        elif fill:
            out[key] = to_config_value(default)
    return out

"""Config checking: a composed config is validated before any model loads.

`validate(cfg)` checks every section of a composed kvlab config against a
schema: the fixed sections (`model`, `engine`, the top-level keys) against the
dataclasses below, the plugin sections (`policy`, `draft`, `quant`,
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
import importlib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from kvlab.registry import REGISTRIES, UnknownPluginError

PLUGIN_SECTIONS = ("policy", "draft", "quant")  # config section == registry kind
TARGET_SECTIONS = ("task", "workload", "logger")
NO_DRAFT = "none"
DTYPES = ("float32", "bfloat16", "float16")
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


class ConfigError(ValueError):
    """A config value that is wrong; the message starts with its dotted path."""


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


# -- schemas of the fixed sections ---------------------------------------------


@dataclass
class ModelConfig:
    name: str  # packaged name, random:<shape>, local folder or .gguf file, hub id (online)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass
class EngineConfig:
    allocator: str = "paged"
    allocator_args: dict = field(default_factory=dict)
    block_size: int = 16
    kv_cache_memory: Any = "256MiB"  # int bytes or "<n>KiB|MiB|GiB"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: Optional[int] = None
    kernel_backend: Literal["auto", "reference", "triton"] = "auto"


@dataclass
class RootConfig:
    name: str = "default"
    seed: int = 0
    data_dir: Optional[str] = None
    progress: bool = True
    skip_existing: bool = True
    fail_fast: bool = False


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
    root_fields = {f.name for f in dataclasses.fields(RootConfig)}
    unknown = sorted(set(cfg) - root_fields - set(SECTIONS) - {"experiment"})
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown top-level key; known: {', '.join(sorted(root_fields | set(SECTIONS)))}")
    out = check_fields("", {k: cfg[k] for k in root_fields if k in cfg}, RootConfig, fill=True)
    for section in ("model", "engine"):
        if not isinstance(cfg.get(section), dict):
            raise ConfigError(f"{section}: missing or not a mapping (choose an option of the {section}/ group)")
    out["model"] = check_model(cfg["model"])
    out["engine"] = check_engine(cfg["engine"])
    for kind in PLUGIN_SECTIONS:
        out[kind] = check_plugin(kind, cfg.get(kind) or {"name": NO_DRAFT if kind == "draft" else None})
    for section in TARGET_SECTIONS:
        out[section] = check_target(section, cfg.get(section))
    return out


def check_model(node: dict) -> dict:
    out = check_fields("model", node, ModelConfig, fill=True)
    name = out["name"]
    if name.startswith("random:"):
        from kvlab.models import RANDOM_SHAPES

        shape = name.split(":", 1)[1]
        if shape not in RANDOM_SHAPES:
            raise ConfigError(f"model.name: unknown random shape {shape!r}; known: {', '.join(sorted(RANDOM_SHAPES))}")
    elif name not in ("smollm2-135m", "gemma3-270m"):
        path = Path(name).expanduser()
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        if not path.exists() and (offline or "/" not in name or name.startswith((".", "/", "~"))):
            raise ConfigError(
                f"model.name: {name!r} is not a packaged model (smollm2-135m, gemma3-270m), random:<shape>, "
                f"an existing local folder or .gguf file" + (", nor (offline) a hub id" if offline else "")
            )
    return out


def check_engine(node: dict) -> dict:
    out = check_fields("engine", node, EngineConfig, fill=True)
    for key in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if out[key] < 1:
            raise ConfigError(f"engine.{key}: must be >= 1, got {out[key]}")
    if out["max_model_len"] is not None and out["max_model_len"] < 1:
        raise ConfigError(f"engine.max_model_len: must be >= 1 or null, got {out['max_model_len']}")
    parse_bytes(out["kv_cache_memory"], "engine.kv_cache_memory")
    out["allocator_args"] = check_plugin_args("allocator", out["allocator"], out["allocator_args"] or {},
                                              "engine.allocator", "engine.allocator_args")
    return out


def parse_bytes(value: Any, path: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string like '64MiB' / '1.5GiB'."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = _BYTES.match(value) if isinstance(value, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(f"{path}: expected a positive number of bytes (int) or a string like '64MiB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


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


def import_target(target: str, path: str) -> type:
    module, _, attr = str(target).rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot import {target!r} ({exc})") from None


# -- dataclass fields -----------------------------------------------------------


def plugin_fields(cls: type) -> dict[str, tuple[Any, Any]]:
    """{name: (type, default)} of a dataclass's init fields; default is dataclasses.MISSING if required."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotations (e.g. a torch type under a string annotation)
        hints = {}
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out[f.name] = (hints.get(f.name, Any), default)
    return out


def plugin_defaults(cls: type) -> dict[str, Any]:
    """Config-friendly defaults of a plugin's init fields ('???' for required ones)."""
    return {k: to_config_value(d) for k, (_, d) in plugin_fields(cls).items()}


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


def check_fields(path: str, node: dict, cls: type, fill: bool = False, what: str | None = None) -> dict:
    """Check `node`'s keys and value types against `cls`'s init fields; fill defaults if `fill`."""
    if not isinstance(node, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {node!r}")
    fields = plugin_fields(cls) if dataclasses.is_dataclass(cls) else {}
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


def check_type(path: str, value: Any, annotation: Any) -> Any:
    """`value` if it fits `annotation` (ints widen to float, lists to tuples' place); else ConfigError."""
    if value == "???":
        raise ConfigError(f"{path}: required value is missing (???)")
    ok, value = _fits(value, annotation)
    if not ok:
        raise ConfigError(f"{path}: expected {_type_name(annotation)}, got {type(value).__name__} {value!r}")
    return value


def _fits(value: Any, ann: Any) -> tuple[bool, Any]:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is Any or ann is object or isinstance(ann, (typing.TypeVar, str)):
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, v = _fits(value, arg)
            if ok:
                return True, v
        return False, value
    if ann is type(None):
        return value is None, value
    if origin is Literal:
        return value in args, value
    if ann is bool:
        return isinstance(value, bool), value
    if ann is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if ann is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if ann is str:
        return isinstance(value, str), value
    if origin in (list, tuple, typing.Sequence, set, frozenset) or ann in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        item = args[0] if args and (origin is not tuple or len(args) == 2 and args[1] is Ellipsis) else Any
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                return False, value
            checked = [_fits(v, a) for v, a in zip(value, args)]
        else:
            checked = [_fits(v, item) for v in value]
        return all(ok for ok, _ in checked), [v for _, v in checked]
    if origin is dict or ann is dict:
        return isinstance(value, dict), value
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return value in ann.__members__ or value in [m.value for m in ann], value
    return True, value  # other annotations (classes, protocols): not checked here


def _type_name(ann: Any) -> str:
    if typing.get_origin(ann) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(ann))
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(ann))
    if ann is type(None):
        return "null"
    return getattr(ann, "__name__", None) or str(ann).replace("typing.", "")

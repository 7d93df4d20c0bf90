"""Dataclass fields as a schema: their types and defaults, and values checked against them.

Shared by the runtime `kvlab.engine_config.EngineConfig` (which checks its own
fields) and the Hydra config checker `kvlab.study.config` (which checks every section
of a composed config against a dataclass: the engine's, a plugin's, a task's).
Torch-free and cheap to import.

    fields_of(EngineConfig)["block_size"]        # (int, 16)
    check_type("engine.block_size", "big", int)  # ConfigError: engine.block_size: expected int, got str 'big'
"""

from __future__ import annotations

import dataclasses
import importlib
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal


class ConfigError(ValueError):
    """A config value that is wrong; the message starts with its dotted path."""


def fields_of(cls: type) -> dict[str, tuple[Any, Any]]:
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


def check_type(path: str, value: Any, annotation: Any) -> Any:
    """`value` if it fits `annotation` (ints widen to float); else ConfigError naming `path`."""
    if value == "???":
        raise ConfigError(f"{path}: required value is missing (???)")
    ok, value = fits(value, annotation)
    if not ok:
        raise ConfigError(f"{path}: {type_problem(value, annotation)}")
    return value


def type_problem(value: Any, annotation: Any) -> str:
    return f"expected {type_name(annotation)}, got {type(value).__name__} {value!r}"


def fits(value: Any, ann: Any) -> tuple[bool, Any]:
    """(does `value` fit `ann`, the value as the annotation wants it: an int given for a float becomes one)."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is Any or ann is object or isinstance(ann, (typing.TypeVar, str)):
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, v = fits(value, arg)
            if ok:
                return True, v
        return False, value
    if ann is type(None):
        return value is None, value
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args), value
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
            checked = [fits(v, a) for v, a in zip(value, args)]
        else:
            checked = [fits(v, item) for v in value]
        return all(ok for ok, _ in checked), [v for _, v in checked]
    if origin in (dict, Mapping) or ann in (dict, Mapping):
        return isinstance(value, Mapping), value
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return value in ann.__members__ or value in [m.value for m in ann], value
    return True, value  # other annotations (classes, protocols): not checked here


def type_name(ann: Any) -> str:
    origin = typing.get_origin(ann)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(ann))
    if ann is type(None):
        return "null (None)"
    if origin in (dict, Mapping) or ann in (dict, Mapping):
        return "a mapping"
    return getattr(ann, "__name__", None) or str(ann).replace("typing.", "")


def import_target(target: str, path: str) -> type:
    """The object a config's dotted `_target_` names; a ConfigError naming `path` when it cannot be imported."""
    module, _, attr = str(target).rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot import {target!r} ({exc})") from None

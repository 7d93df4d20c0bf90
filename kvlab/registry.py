"""Plugin registries: one generic `Registry`, one instance per kind of plugin.

A plugin is a class registered under a short name with a decorator::

    @POLICIES.register("snapkv")
    @dataclass
    class SnapKV(Policy): ...

The decorator checks that the class implements the kind's interface (the
abstract methods of the registry's base class), so a broken plugin fails at
import time, not in the middle of a sweep. Names are usable everywhere: the
Python API (`LLM(allocator="paged")`), Hydra configs (`engine.allocator=paged`)
and `kvlab.registry.build(kind, name, **params)`.

Third-party packages add plugins through the entry-point group
``kvlab.plugins``: each entry point names a module (or a callable) that, when
loaded, registers its classes. Entry points are loaded once, lazily, on the
first lookup; one that fails to import is reported with a warning and skipped.

This module is torch-free.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings
from importlib.metadata import entry_points
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")

ENTRY_POINT_GROUP = "kvlab.plugins"

_BUILTIN_MODULES = (
    "kvlab.cache.allocators",
    "kvlab.cache.prefix_eviction",
    "kvlab.cache.tiers.placement",
    "kvlab.cache.quant",
    "kvlab.speculation.drafts",
    "kvlab.policies",
)

_plugins_loaded = False
_plugin_errors: dict[str, str] = {}


class UnknownPluginError(KeyError):
    """A name that no plugin of this kind is registered under."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class PluginInterfaceError(TypeError):
    """A class registered without implementing its kind's interface."""


class Registry(Generic[T]):
    """Name -> class for one kind of plugin (allocator, policy, draft, quant format)."""

    def __init__(self, kind: str, base: type | None = None, plural: str | None = None):
        self.kind = kind
        self.plural = plural or kind + "s"
        self.base = base
        self._classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator: register `cls` under `name` after checking its interface."""
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{self.kind} name {name!r} must be a short identifier")

        def deco(cls: type) -> type:
            self._check_interface(name, cls)
            existing = self._classes.get(name)
            if existing is not None and existing is not cls and _qualname(existing) != _qualname(cls):
                raise ValueError(
                    f"{self.kind} {name!r} is already registered by {_qualname(existing)}; "
                    f"{_qualname(cls)} cannot take the same name"
                )
            self._classes[name] = cls
            cls.registry_name = name
            return cls

        return deco

    def _check_interface(self, name: str, cls: type) -> None:
        if not inspect.isclass(cls):
            raise PluginInterfaceError(f"{self.kind} {name!r}: only classes can be registered, got {cls!r}")
        if self.base is not None and not issubclass(cls, self.base):
            raise PluginInterfaceError(
                f"{self.kind} {name!r}: {_qualname(cls)} must subclass {_qualname(self.base)}"
            )
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise PluginInterfaceError(
                f"{self.kind} {name!r}: {_qualname(cls)} does not implement {', '.join(missing)}"
            )

    def get(self, name: str) -> type:
        load_plugins()
        try:
            return self._classes[name]
        except KeyError:
            known = ", ".join(sorted(self._classes)) or "(none)"
            raise UnknownPluginError(
                f"unknown {self.kind} {name!r}; registered {self.plural}: {known}"
            ) from None

    def build(self, name: str, **params: Any) -> T:
        """Instantiate the plugin `name` with `params`, reporting unknown parameters by name."""
        cls = self.get(name)
        if dataclasses.is_dataclass(cls):
            fields = {f.name for f in dataclasses.fields(cls) if f.init}
            unknown = sorted(set(params) - fields)
            if unknown:
                raise TypeError(
                    f"{self.kind} {name!r} has no parameter(s) {', '.join(unknown)}; "
                    f"its parameters are: {', '.join(sorted(fields)) or '(none)'}"
                )
        return cls(**params)

    def names(self) -> list[str]:
        load_plugins()
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        load_plugins()
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._classes)})"


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def load_plugins(force: bool = False) -> dict[str, str]:
    """Import the built-in plugin modules and every `kvlab.plugins` entry point, once.

    Returns {entry point name: error message} for the entry points that failed.
    """
    global _plugins_loaded
    if _plugins_loaded and not force:
        return dict(_plugin_errors)
    _plugins_loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = ep.load()
            if callable(loaded) and not inspect.isclass(loaded) and not inspect.ismodule(loaded):
                loaded()
        except Exception as exc:  # a broken third-party plugin must not kill the run
            msg = f"{type(exc).__name__}: {exc}"
            _plugin_errors[ep.name] = msg
            warnings.warn(
                f"kvlab plugin entry point {ep.name!r} ({ep.value}) failed to load and was skipped: {msg}",
                RuntimeWarning,
                stacklevel=2,
            )
    return dict(_plugin_errors)


def plugin_errors() -> dict[str, str]:
    """Entry points that failed to load, with their error messages."""
    load_plugins()
    return dict(_plugin_errors)


# One registry per kind. Bases are attached by the modules that define them
# (kvlab.cache.allocators.base etc.) so that this file stays import-light.
ALLOCATORS: Registry = Registry("allocator")
POLICIES: Registry = Registry("policy", plural="policies")
DRAFTS: Registry = Registry("draft model")
QUANT_FORMATS: Registry = Registry("quantisation format")
PREFIX_EVICTIONS: Registry = Registry("prefix-cache eviction policy", plural="prefix-cache eviction policies")
PLACEMENTS: Registry = Registry("offload placement")

REGISTRIES: dict[str, Registry] = {
    "allocator": ALLOCATORS,
    "policy": POLICIES,
    "draft": DRAFTS,
    "quant": QUANT_FORMATS,
    "prefix_eviction": PREFIX_EVICTIONS,
    "offload_placement": PLACEMENTS,
}


def build(kind: str, name: str, **params: Any) -> Any:
    """Instantiate plugin `name` of `kind` ('allocator', 'policy', 'draft', 'quant')."""
    try:
        registry = REGISTRIES[kind]
    except KeyError:
        raise UnknownPluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(REGISTRIES)}") from None
    return registry.build(name, **params)

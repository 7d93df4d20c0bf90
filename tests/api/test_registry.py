"""Plugin registries: registration, interface checks, lookup errors, entry-point plugins.

Every test leaves the registries as it found them (the `clean_registries`
fixture snapshots and restores each registry's name -> class table and the
entry-point loading state).
"""

from __future__ import annotations

import re
import types
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass

import pytest

import kvlab.registry as registry
from kvlab.cache.allocators.base import Allocator
from kvlab.registry import (
    ALLOCATORS,
    POLICIES,
    REGISTRIES,
    PluginInterfaceError,
    Registry,
    UnknownPluginError,
)


@pytest.fixture(autouse=True)
def clean_registries(monkeypatch):
    registry.load_plugins()  # built-ins in place before the snapshot
    saved = {kind: dict(r._classes) for kind, r in REGISTRIES.items()}
    yield
    for kind, r in REGISTRIES.items():
        r._classes.clear()
        r._classes.update(saved[kind])


@pytest.fixture
def fake_entry_points(monkeypatch):
    """fake_entry_points(*eps): make `kvlab.plugins` list `eps` and force a fresh plugin load."""

    def install(*eps):
        monkeypatch.setattr(registry, "entry_points", lambda group: list(eps) if group == "kvlab.plugins" else [])
        monkeypatch.setattr(registry, "_plugins_loaded", False)
        monkeypatch.setattr(registry, "_plugin_errors", {})

    return install


@dataclass
class FakeEntryPoint:
    """The slice of importlib.metadata.EntryPoint that load_plugins uses."""

    name: str
    value: str
    loader: object

    def load(self):
        return self.loader()


# -- a torch-free kind of plugin for the interface checks ----------------------
class Widget(ABC):
    @abstractmethod
    def spin(self) -> int: ...

    @abstractmethod
    def stop(self) -> None: ...


@pytest.fixture
def widgets() -> Registry:
    return Registry("widget", base=Widget)


# -- registration ----------------------------------------------------------------
def test_register_makes_the_class_findable_by_name(widgets):
    @widgets.register("fast")
    class Fast(Widget):
        def spin(self):
            return 3

        def stop(self):
            pass

    assert widgets.get("fast") is Fast
    assert Fast.registry_name == "fast"
    assert "fast" in widgets and widgets.names() == ["fast"]
    assert widgets.build("fast").spin() == 3


def test_register_into_a_real_registry_and_build_with_params():
    @ALLOCATORS.register("test-bump")
    @dataclass
    class Bump(Allocator):
        step: int = 1

        def _reset(self): ...
        def can_allocate(self, num_tokens, max_tokens): return True
        def allocate(self, seq_id, num_tokens, max_tokens): ...
        def can_append(self, seq_id, num_new_tokens): return True
        def append_slots(self, seq_id, num_new_tokens): ...
        def free(self, seq_id): ...
        def fork(self, parent_id, child_id): ...
        def truncate(self, seq_id, num_tokens): ...
        def release_before(self, seq_id, token_index): return 0
        @property
        def num_free_blocks(self): return 0

    assert "test-bump" in ALLOCATORS.names()
    assert ALLOCATORS.build("test-bump", step=5).step == 5
    assert registry.build("allocator", "test-bump").step == 1


def test_class_missing_abstract_methods_fails_at_decoration_naming_them(widgets):
    with pytest.raises(PluginInterfaceError, match=r"widget 'half'.*Half does not implement spin, stop"):
        @widgets.register("half")
        class Half(Widget):
            pass

    assert "half" not in widgets


def test_class_missing_one_allocator_method_names_only_that_one():
    with pytest.raises(PluginInterfaceError, match=r"does not implement release_before$"):
        @ALLOCATORS.register("test-leaky")
        @dataclass
        class Leaky(Allocator):
            def _reset(self): ...
            def can_allocate(self, num_tokens, max_tokens): return True
            def allocate(self, seq_id, num_tokens, max_tokens): ...
            def can_append(self, seq_id, num_new_tokens): return True
            def append_slots(self, seq_id, num_new_tokens): ...
            def free(self, seq_id): ...
            def fork(self, parent_id, child_id): ...
            def truncate(self, seq_id, num_tokens): ...
            @property
            def num_free_blocks(self): return 0

    assert "test-leaky" not in ALLOCATORS


def test_class_not_subclassing_the_base_fails_naming_the_base(widgets):
    class Rogue:  # has the methods, but not the base
        def spin(self):
            return 1

        def stop(self):
            pass

    with pytest.raises(PluginInterfaceError, match=r"widget 'rogue': .*Rogue must subclass .*test_registry\.Widget"):
        widgets.register("rogue")(Rogue)
    with pytest.raises(PluginInterfaceError, match=r"must subclass kvlab\.cache\.allocators\.base\.Allocator"):
        ALLOCATORS.register("test-rogue")(Rogue)
    assert "rogue" not in widgets and "test-rogue" not in ALLOCATORS


def test_only_classes_can_be_registered(widgets):
    with pytest.raises(PluginInterfaceError, match="only classes"):
        widgets.register("fn")(lambda: None)


@pytest.mark.parametrize("name", ["", "has space", "semi;colon", "dot.ted"])
def test_register_rejects_names_that_are_not_identifiers(widgets, name):
    with pytest.raises(ValueError, match="short identifier"):
        widgets.register(name)


def test_a_name_cannot_be_taken_by_a_second_class():
    paged = ALLOCATORS.get("paged")

    with pytest.raises(ValueError, match=r"allocator 'paged' is already registered by .*PagedAllocator"):
        @ALLOCATORS.register("paged")
        @dataclass
        class Impostor(paged):
            pass

    assert ALLOCATORS.get("paged") is paged


# -- lookup errors ---------------------------------------------------------------
def test_unknown_name_lists_the_registered_names():
    names = ", ".join(ALLOCATORS.names())
    assert "contiguous, paged" in names
    with pytest.raises(UnknownPluginError, match=re.escape(f"unknown allocator 'nope'; registered allocators: {names}")):
        ALLOCATORS.get("nope")
    with pytest.raises(KeyError):  # still a KeyError for callers that catch that
        ALLOCATORS.build("nope")


def test_unknown_name_in_an_empty_registry_says_none(widgets):
    with pytest.raises(UnknownPluginError, match=r"registered widgets: \(none\)"):
        widgets.get("anything")


def test_unknown_kind_lists_the_kinds():
    with pytest.raises(UnknownPluginError, match=r"unknown plugin kind 'sampler'; kinds: allocator, policy, draft, quant"):
        registry.build("sampler", "x")


def test_build_with_unknown_parameters_names_them_and_the_real_ones():
    with pytest.raises(TypeError, match=r"allocator 'paged' has no parameter\(s\) bogus, watermrk; "
                                        r"its parameters are: watermark$"):
        ALLOCATORS.build("paged", watermrk=0.1, bogus=1)
    with pytest.raises(TypeError, match=r"its parameters are: reserve$"):
        ALLOCATORS.build("contiguous", num_blocks=8)  # init=False fields are not parameters
    assert ALLOCATORS.build("paged", watermark=0.25).watermark == 0.25


# -- entry-point plugins ---------------------------------------------------------
def _register_test_policy():
    from kvlab.policies.base import Policy

    @POLICIES.register("test-keep-recent")
    @dataclass
    class KeepRecent(Policy):
        window: int = 4

        def score(self, layer_idx, keys, values, queries, attn_stats):
            return None

    return KeepRecent


def test_entry_point_callable_registers_a_selectable_policy(fake_entry_points):
    registered = []
    fake_entry_points(FakeEntryPoint("recent", "acme.kv:register", lambda: lambda: registered.append(
        _register_test_policy())))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a working plugin warns about nothing
        cls = POLICIES.get("test-keep-recent")
    assert registered == [cls]
    assert POLICIES.build("test-keep-recent", window=8).window == 8
    assert "test-keep-recent" in POLICIES.names()
    assert registry.plugin_errors() == {}


def test_entry_point_module_registers_on_import(fake_entry_points):
    def import_module():
        _register_test_policy()  # importing the module runs its decorators
        return types.ModuleType("acme_kv")

    fake_entry_points(FakeEntryPoint("acme", "acme_kv", import_module))
    assert "test-keep-recent" in POLICIES


def test_entry_points_load_once(fake_entry_points):
    calls = []
    fake_entry_points(FakeEntryPoint("count", "acme:count", lambda: lambda: calls.append(1)))
    POLICIES.names()
    ALLOCATORS.get("paged")
    registry.plugin_errors()
    assert calls == [1]


def test_broken_entry_point_warns_and_is_skipped(fake_entry_points):
    def broken():
        raise ImportError("No module named 'acme_missing'")

    fake_entry_points(
        FakeEntryPoint("acme-broken", "acme_missing:plugin", broken),
        FakeEntryPoint("recent", "acme.kv:register", lambda: _register_test_policy),
    )
    with pytest.warns(RuntimeWarning, match=r"'acme-broken' \(acme_missing:plugin\) failed to load and was skipped"):
        cls = POLICIES.get("test-keep-recent")  # the plugin after the broken one still loads
    assert cls.registry_name == "test-keep-recent"
    assert registry.plugin_errors() == {"acme-broken": "ImportError: No module named 'acme_missing'"}
    assert POLICIES.get("full").registry_name == "full"  # built-ins unaffected


def test_entry_point_whose_registration_raises_is_reported(fake_entry_points):
    def bad_register():
        @POLICIES.register("test-incomplete")
        @dataclass
        class Incomplete(POLICIES.base):  # no score()
            pass

    fake_entry_points(FakeEntryPoint("incomplete", "acme.bad:register", lambda: bad_register))
    with pytest.warns(RuntimeWarning, match="'incomplete'"):
        errors = registry.plugin_errors()
    assert list(errors) == ["incomplete"]
    assert errors["incomplete"].startswith("PluginInterfaceError: policy 'test-incomplete'")
    assert "does not implement score" in errors["incomplete"]
    with pytest.raises(UnknownPluginError, match=r"unknown policy 'test-incomplete'; registered polic\w+: .*full"):
        POLICIES.get("test-incomplete")

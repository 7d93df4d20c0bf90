"""Registered plugins as Hydra group options, without hand-written YAML.

Every policy, draft model and quantisation format in the registries (built-in
and from `kvlab.plugins` entry points) becomes an option of its config group,
built from the plugin's dataclass defaults::

    @POLICIES.register("snapkv")
    @dataclass
    class SnapKV(Policy):
        budget: int = 256
        window: int = 32

    kvlab-run policy=snapkv policy.budget=128      # -> policy: {name: snapkv, budget: 128, window: 32}

A YAML file of the same name in conf/<group>/ takes the place of the generated
option (write one to document the parameters). Allocators are chosen
by value (`engine.allocator=contiguous`); their defaults are filled in by
kvlab.study.config.validate.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from kvlab.study.config import PLUGIN_SECTIONS, plugin_defaults
from kvlab.registry import REGISTRIES, load_plugins



def find_conf_dir() -> Path:
    """The Hydra configs: kvlab/conf in an installed package (package data), else the checkout's conf/."""
    package = Path(__file__).resolve().parents[1]  # kvlab/
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"kvlab's Hydra configs (config.yaml) are neither in {package / 'conf'} nor in "
                            f"{package.parent / 'conf'}")


CONF_DIR = find_conf_dir()


def plugin_options() -> dict[str, dict[str, dict]]:
    """{group: {option name: config node}} for every registered policy, draft and quant format."""
    load_plugins()
    options: dict[str, dict[str, dict]] = {}
    for group in PLUGIN_SECTIONS:
        registry = REGISTRIES[group]
        options[group] = {}
        for name in registry.names():
            try:
                options[group][name] = {"name": name, **plugin_defaults(registry.get(name))}
            except Exception as exc:  # a plugin whose defaults cannot be read must not break the CLI
                warnings.warn(f"{registry.kind} {name!r} has no config option: {exc}", RuntimeWarning, stacklevel=2)
    return options


def register_plugin_configs(conf_dir: Path = CONF_DIR) -> None:
    """Store every registered plugin without a YAML option in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for group, options in plugin_options().items():
        for name, node in options.items():
            if (conf_dir / group / f"{name}.yaml").exists():
                continue
            store.store(group=group, name=name, node=node, provider="kvlab")

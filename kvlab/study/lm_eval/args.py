"""`--model_args` of lm-eval's `kvlab` model -> kvlab.LLM's keyword arguments and the harness's own options.

    pretrained=smollm2-135m,policy=snapkv,compression_ratio=0.5,quant=int4,block_size=16,kv_cache_memory=1GiB

A key is, in this order:
  - a harness option (HARNESS_OPTIONS: batch size, generation length, BOS handling);
  - `pretrained` (lm-eval's name for the model) or any `kvlab.engine_config.EngineConfig` field;
  - a plugin section spelled whole, `policy_args={'budget': 64, 'window': 8}` (a dict, or its JSON /
    Python-literal text), or one of its parameters spelled `policy.budget=64` / `policy_args.budget=64` (also
    `quant.`, `draft.`, `allocator.`, `prefix_eviction.`);
  - a flat parameter of the chosen plugins (`compression_ratio=0.5` goes to the policy, `group_size=32`
    to the quant format): found by reading each chosen plugin's dataclass fields. A flat key that two
    chosen plugins both take is an error asking for the dotted spelling.
Anything else is an error naming every valid key. Plugin parameters are checked here (names, types,
`__post_init__`), engine options by EngineConfig, both before any model loads.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from kvlab.engine_config import PLUGIN_ARGS, EngineConfig
from kvlab.schema import ConfigError, fields_of

# harness options: (default, what it does)
HARNESS_OPTIONS: dict[str, tuple[Any, str]] = {
    "batch_size": (64, "requests per LLM.score / LLM.generate call (the engine batches them continuously)"),
    "max_gen_toks": (256, "generated tokens at most when a task does not say (lm-eval's default)"),
    "add_bos_token": (None, "None: the tokenizer's default; True / False forces the BOS token on or off"),
    "prefix_token_id": (None, "token scored from when a context is empty (None: BOS, else EOS)"),
    "dists_memory": ("256MiB", "bytes of next-token distributions held at once to decide is_greedy"),
}
ALIASES = {"pretrained": "model"}  # lm-eval's spelling -> EngineConfig's
SECTIONS = {**{n.removesuffix("_args"): n for n in PLUGIN_ARGS}, **{n: n for n in PLUGIN_ARGS}}  # policy(_args) -> policy_args


class ModelArgsError(ValueError):
    """A `model_args` key or value the kvlab model cannot take; the message names the valid keys."""


def split_model_args(model_args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(kvlab.LLM keyword arguments, harness options) from lm-eval's parsed `model_args`."""
    harness = {k: default for k, (default, _) in HARNESS_OPTIONS.items()}
    engine: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {name: {} for name in PLUGIN_ARGS}
    flat: dict[str, Any] = {}
    engine_fields = fields_of(EngineConfig)
    for key, value in model_args.items():
        name = ALIASES.get(key, key)
        kind, _, param = key.partition(".")
        if key in HARNESS_OPTIONS:
            harness[key] = value
        elif name in PLUGIN_ARGS:
            sections[name].update(as_mapping(key, value))
        elif name in engine_fields:
            engine[name] = value
        elif param and kind in SECTIONS:
            sections[SECTIONS[kind]][param] = value
        else:
            flat[key] = value
    for key, section in route_flat(flat, engine).items():
        sections[section][key] = flat[key]
    for section, params in sections.items():
        if params:
            engine[section] = check_section(section, engine, params)
    return engine, harness


def as_mapping(key: str, value: Any) -> dict[str, Any]:
    """A plugin section given as a dict, or as its JSON / Python-literal text ("{'budget': 64}")."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                raise ModelArgsError(f"{key}={value!r}: expected a mapping such as {key}={{'budget': 64}} "
                                     f"(or the dotted spelling {key.removesuffix('_args')}.budget=64)") from None
    if not isinstance(value, dict):
        raise ModelArgsError(f"{key}: expected a mapping, got {value!r}")
    return dict(value)


def chosen_plugins(engine: dict[str, Any]) -> dict[str, str]:
    """{section: registered plugin name} of the plugins this engine will build (draft only when set)."""
    defaults = EngineConfig.__dataclass_fields__
    out = {}
    for section in PLUGIN_ARGS:
        kind = section.removesuffix("_args")
        name = engine.get(kind, defaults[kind].default)
        if name is not None:
            out[section] = name
    return out


def plugin_fields(section: str, name: str) -> dict[str, tuple[Any, Any]]:
    """The dataclass fields of plugin `name` of `section`'s kind; an unknown name is a ModelArgsError."""
    from kvlab.registry import REGISTRIES, UnknownPluginError, load_plugins

    load_plugins()
    kind = section.removesuffix("_args")
    try:
        return fields_of(REGISTRIES[kind].get(name))
    except UnknownPluginError as exc:
        raise ModelArgsError(f"{kind}={name}: {exc}") from None


def route_flat(flat: dict[str, Any], engine: dict[str, Any]) -> dict[str, str]:
    """{flat key: the section of the one chosen plugin that takes it}; an unknown or ambiguous key raises."""
    if not flat:
        return {}
    owners = {section: plugin_fields(section, name) for section, name in chosen_plugins(engine).items()}
    routes = {}
    for key in flat:
        takers = [section for section, fields in owners.items() if key in fields]
        if len(takers) > 1:
            spelled = " or ".join(f"{s.removesuffix('_args')}.{key}={flat[key]}" for s in takers)
            raise ModelArgsError(f"model_args key {key!r} is a parameter of several chosen plugins; say which: {spelled}")
        if not takers:
            raise ModelArgsError(unknown_key_message(key, engine, owners))
        routes[key] = takers[0]
    return routes


def unknown_key_message(key: str, engine: dict[str, Any], owners: dict[str, dict]) -> str:
    chosen = chosen_plugins(engine)
    lines = [f"unknown model_args key {key!r} for the kvlab model; valid keys:",
             f"  harness: {', '.join(HARNESS_OPTIONS)}",
             f"  engine: pretrained (= model), {', '.join(k for k in fields_of(EngineConfig) if k not in PLUGIN_ARGS)}",
             f"  plugin sections: {', '.join(PLUGIN_ARGS)} (a mapping), or <section>.<parameter>"]
    for section, fields in owners.items():
        kind = section.removesuffix("_args")
        lines.append(f"  {kind} {chosen[section]!r}: {', '.join(fields) or '(no parameters)'}")
    return "\n".join(lines)


def check_section(section: str, engine: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """`params` checked against the chosen plugin's dataclass (names, types, its __post_init__)."""
    from kvlab.study.config import check_plugin_args

    kind = section.removesuffix("_args")
    name = chosen_plugins(engine).get(section)
    if name is None:
        raise ModelArgsError(f"{section}: {kind} parameters given but no {kind} chosen (set {kind}=<name>)")
    try:
        check_plugin_args(kind, name, params, kind, section)
    except ConfigError as exc:
        raise ModelArgsError(str(exc)) from None
    return params

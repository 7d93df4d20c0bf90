"""Every config option composes and validates; bad input fails at once, naming the path."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.errors import ConfigCompositionException, MissingConfigException

from kvlab.study.config import ConfigError, check_target, engine_path, to_config_value, validate
from kvlab.engine_config import EngineConfig
from kvlab.study.experiment import llm_kwargs
from kvlab.registry import REGISTRIES
from kvlab.schema import fields_of as plugin_fields

from exp_helpers import CONF_DIR, kvlab_cmd, run_env

GROUPS = ("model", "engine", "policy", "draft", "quant", "task", "workload", "logger", "experiment")


def group_options(group: str) -> list[str]:
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return GlobalHydra.instance().config_loader().get_group_options(group)


def all_options():
    from kvlab.study.conf_plugins import register_plugin_configs

    register_plugin_configs()
    return [(g, o) for g in GROUPS for o in group_options(g)]


def assert_contains(expected, actual, path: str) -> None:
    """Every key of `expected` (a YAML file's mapping) is in `actual` with the same value, recursively."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected a mapping, got {actual!r}"
        for key, value in expected.items():
            if key == "defaults":  # Hydra's composition list (e.g. engine variants inherit `default`), not a value
                continue
            assert key in actual, f"{path}.{key} is missing from the composed config"
            assert_contains(value, actual[key], f"{path}.{key}")
    else:
        assert actual == expected, f"{path}: composed {actual!r}, the YAML says {expected!r}"


@pytest.mark.parametrize("group,option", all_options())
def test_every_option_composes_validates_and_builds(compose, group, option):
    from omegaconf import OmegaConf

    if group == "experiment" and "hydra/sweeper: optuna" in (CONF_DIR / group / f"{option}.yaml").read_text():
        pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="a search: needs the `sweeps` extra")

    cfg = compose([f"{group}={option}"])
    composed = OmegaConf.to_container(cfg, resolve=False)
    path = CONF_DIR / group / f"{option}.yaml"
    yaml_node = yaml.safe_load(path.read_text()) if path.exists() else None
    if group == "experiment":  # a `# @package _global_` override: its values land at the top level
        body = {k: v for k, v in yaml_node.items() if k not in ("defaults", "hydra")}
        assert_contains(body, composed, "<root>")
        assert composed["name"] == option
        for override in yaml_node.get("defaults", []):  # `override /task: niah` selects that option's file...
            [(target, choice)] = override.items()
            if target.split()[-1].lstrip("/").startswith("hydra/"):  # Hydra's own groups (sweeper, sampler)
                continue
            target = target.split("/")[-1]
            option_file = CONF_DIR / target / f"{choice}.yaml"
            if option_file.exists():
                selected = OmegaConf.create(yaml.safe_load(option_file.read_text()))
            else:  # a registered plugin without a YAML file: its name and every parameter at their defaults
                selected = OmegaConf.create({"name": choice, **{k: to_config_value(d) for k, (_, d) in
                                                                plugin_fields(REGISTRIES[target].get(choice)).items()}})
            expected = OmegaConf.merge(selected, body.get(target) or {})  # ...and the experiment's values win
            assert_contains(OmegaConf.to_container(expected), composed[target], target)
    elif yaml_node is not None:
        assert_contains(yaml_node, composed[group], group)
    else:  # a registered plugin without a YAML file: its name and every parameter, at their defaults
        assert composed[group]["name"] == option
        fields = plugin_fields(REGISTRIES[group].get(option))
        assert {k: v for k, v in composed[group].items() if k != "name"} == {k: d for k, (_, d) in fields.items()}
    if group == "policy" and needs_budget(composed["policy"]):  # a policy that compresses with neither set
        with pytest.raises(ConfigError, match=rf"^policy: policy '{option}' needs a budget .* or a compression_ratio"):
            validate(cfg)
        cfg = compose([f"{group}={option}", "policy.compression_ratio=0.5"])
    config = validate(cfg)
    if group in ("task", "workload", "logger") and config[group] is not None:
        params = {k: v for k, v in config[group].items() if k != "_target_"}
        module, _, name = config[group]["_target_"].rpartition(".")
        built = getattr(importlib.import_module(module), name)(**params)  # cheap: reads no data, opens no run
        assert {k: getattr(built, k) for k in params} == params
    if group in ("policy", "quant") or (group == "draft" and option != "none"):
        params = {k: v for k, v in config[group].items() if k != "name"}
        built = REGISTRIES[group].build(config[group]["name"], **params)
        assert {k: getattr(built, k) for k in params} == params


def needs_budget(node: dict) -> bool:
    """A compressing policy's section that gives neither a budget nor a compression_ratio (refused)."""
    compresses = REGISTRIES["policy"].get(node["name"]).compresses
    return compresses and node.get("budget") is None and node.get("compression_ratio") is None


def test_default_experiment_composes(compose):
    config = validate(compose())
    assert config["model"]["name"] == "smollm2-135m"
    assert config["task"]["_target_"].endswith("Perplexity") and config["workload"]["_target_"].endswith("AzureReplay")
    assert config["logger"]["mode"] == "offline"


def test_every_registered_plugin_is_a_group_option():
    for kind in ("policy", "draft", "quant"):
        assert set(REGISTRIES[kind].names()) <= set(group_options(kind)), kind


@pytest.mark.parametrize("group", ["policy", "draft", "quant"])
def test_plugin_yaml_lists_every_parameter(group):
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        node = yaml.safe_load(path.read_text())
        if group == "draft" and node["name"] == "none":
            continue
        fields = set(plugin_fields(REGISTRIES[group].get(node["name"])))
        assert set(node) - {"name"} == fields, f"{path} must list exactly the parameters {sorted(fields)}"


def test_yaml_parameters_are_commented():
    for path in sorted(CONF_DIR.rglob("*.yaml")):
        for line in path.read_text().splitlines():
            if ":" in line and not line.lstrip().startswith(("#", "-")) and not line.rstrip().endswith(":"):
                assert "#" in line, f"{path.relative_to(CONF_DIR)}: uncommented parameter line {line!r}"


def test_target_yaml_lists_every_field():
    for group in ("task", "workload", "logger"):
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            node = yaml.safe_load(path.read_text())
            if node.get("_target_") is None:
                continue
            module, _, name = node["_target_"].rpartition(".")
            cls = getattr(importlib.import_module(module), name)
            assert set(node) - {"_target_"} == set(plugin_fields(cls)), path


def test_launchers_compose(compose):
    for option in ("basic", "joblib", "parallel", "slurm", "ray_cluster", "submitit_local"):
        cfg = compose([f"hydra/launcher={option}"], hydra=True)
        target = cfg.hydra.launcher._target_
        assert target.startswith("hydra"), target
    slurm = compose(["hydra/launcher=slurm"], hydra=True).hydra.launcher
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

    SlurmLauncher(**{k: v for k, v in slurm.items() if k != "_target_"})  # builds; submits nothing
    ray = compose(["hydra/launcher=ray_cluster"], hydra=True).hydra.launcher
    assert ray._target_ == "hydra_plugins.kvlab_launchers.ray_cluster.KvlabRayLauncher" and "init" in ray.ray
    assert ray.ray.remote.max_retries == 0  # a dead worker's job is recorded as failed, not silently rerun


def test_experiments_define_sweeps(compose):
    try:
        import hydra_plugins.hydra_optuna_sweeper  # noqa: F401
        searches = True
    except ImportError:
        searches = False
    untested = []
    for option in group_options("experiment"):
        if not searches and "hydra/sweeper: optuna" in (CONF_DIR / "experiment" / f"{option}.yaml").read_text():
            untested.append(option)
            continue
        cfg = compose([f"experiment={option}"], hydra=True)
        assert cfg.hydra.sweeper.params, f"experiment {option} has no sweep"
        assert cfg.name == option
    if untested:
        pytest.skip(f"experiments {untested} need hydra-optuna-sweeper (the `sweeps` extra); the others compose")


# -- bad input ---------------------------------------------------------------------------


def test_unknown_group_option_lists_valid_ones(compose):
    with pytest.raises(MissingConfigException) as err:
        compose(["policy=nope"])
    assert "Available options in 'policy'" in str(err.value) and "full" in str(err.value)


def test_unknown_key_is_refused_with_its_path(compose):
    with pytest.raises(ConfigCompositionException, match="block_sizee"):
        compose(["engine.block_sizee=8"])
    with pytest.raises(ConfigError, match=r"^engine\.block_sizee: unknown parameter"):
        validate(compose(["+engine.block_sizee=8"]))
    with pytest.raises(ConfigError, match=r"^policy\.budgett: unknown parameter of policy 'full'"):
        validate(compose(["+policy.budgett=8"]))


@pytest.mark.parametrize("override,message", [
    ("engine.block_size=big", r"^engine\.block_size: expected int, got str 'big'"),
    ("engine.block_size=0", r"^engine\.block_size: 0 is not allowed; choose one of \(1, 2, 4"),
    ("engine.block_size=24", r"^engine\.block_size: 24 is not allowed; choose one of \(1, 2, 4"),
    ("engine.block_size=16.0", r"^engine\.block_size: expected int, got float 16\.0"),
    ("engine.block_size=true", r"^engine\.block_size: expected int, got bool True"),
    ("engine.max_num_seqs=2.5", r"^engine\.max_num_seqs: expected int, got float 2\.5"),
    ("engine.max_num_seqs=0", r"^engine\.max_num_seqs: must be >= 1, got 0"),
    ("engine.max_model_len=64.5", r"^engine\.max_model_len: expected int or null"),
    ("engine.max_model_len=1", r"^engine\.max_model_len: must be >= 2"),
    ("engine.kv_cache_memory=lots", r"^engine\.kv_cache_memory: 'lots' is not a size"),
    ("engine.kv_cache_memory=0", r"^engine\.kv_cache_memory: must be positive, got 0"),
    ("engine.kernel_backend=reference", r"^engine\.kernel_backend: expected one of 'auto', 'torch', 'triton'"),
    ("engine.device=null", r"^engine\.device: expected str"),
    ("engine.allocator=nope", r"^engine\.allocator: unknown allocator 'nope'; .*paged"),
    ("+engine.allocator_args.watermark=2.0", r"^engine\.allocator_args: allocator 'paged' rejects .*watermark"),
    ("engine.prefix_eviction=mru", r"^engine\.prefix_eviction: unknown prefix-cache eviction policy 'mru'"),
    ("+engine.prefix_eviction_args.protected_fraction=2", r"^engine\.prefix_eviction_args\.protected_fraction: "
                                                          r"unknown parameter of prefix-cache eviction policy 'lru'"),
    ("engine.enable_prefix_caching=maybe", r"^engine\.enable_prefix_caching: expected bool"),
    ("model.name=no-such-model", r"^model\.name: 'no-such-model' is not a packaged model"),
    ("model.dtype=float8", r"^model\.dtype: expected one of 'float32'"),
    ("task.context_lengths=[0]", r"^task: Perplexity rejects its parameters: .*context_lengths"),
    ("task.num_windows=many", r"^task\.num_windows: expected int"),
    ("workload.arrival=later", r"^workload\.arrival: expected one of 'asap', 'real'"),
    ("logger.mode=sometimes", r"^logger\.mode: expected one of"),
    ("seed=zero", r"^seed: expected int"),
    ("seed=-1", r"^seed: must be an integer in \[0, 2\*\*63\), got -1"),
    ("engine.device=gpu0", r"^engine\.device: 'gpu0' is not a torch device"),
    ("policy=snapkv", r"^policy: policy 'snapkv' needs a budget \(tokens kept per layer"),
])
def test_bad_value_names_its_path(compose, override, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose([override]))


def test_engine_yaml_lists_every_engine_config_field_with_its_default():
    """One schema: every EngineConfig field is in engine/default.yaml (with the dataclass's default) unless the
    config keeps it in another section (model, seed, plugins), and engine/default.yaml has nothing else."""
    node = yaml.safe_load((CONF_DIR / "engine" / "default.yaml").read_text())
    fields = plugin_fields(EngineConfig)
    in_engine = {name for name in fields if engine_path(name) == f"engine.{name}"}
    assert set(node) == in_engine
    assert {name: node[name] for name in in_engine} == {name: fields[name][1] for name in in_engine}
    assert {engine_path(name) for name in set(fields) - in_engine} == {
        "model.name", "model.dtype", "seed", "policy.name", "policy", "quant.name", "quant", "draft.name", "draft"}


def test_engine_option_files_change_only_what_differs():
    for path in sorted((CONF_DIR / "engine").glob("*.yaml")):
        if path.stem != "default":
            node = yaml.safe_load(path.read_text())
            assert node["defaults"] == ["default"], path
            assert set(node) - {"defaults"} < set(yaml.safe_load((CONF_DIR / "engine" / "default.yaml").read_text()))


def test_llm_kwargs_map_every_section_onto_engine_config(compose):
    config = validate(compose(["model=random-llama-tiny", "model.dtype=bfloat16", "engine=contiguous", "seed=3",
                               "engine.block_size=8", "engine.kernel_backend=torch", "quant=bf16"]))
    kwargs = llm_kwargs(config)
    assert set(kwargs) == set(plugin_fields(EngineConfig))
    engine = EngineConfig(**kwargs)
    assert (engine.model, engine.dtype, engine.seed, engine.block_size) == ("random:llama-tiny", "bfloat16", 3, 8)
    assert (engine.allocator, engine.allocator_args) == ("contiguous", {"reserve": "request"})
    assert (engine.kernel_backend, engine.quant, engine.draft, engine.policy) == ("torch", "bf16", None, "full")
    assert engine.kv_cache_memory == 256 << 20 and engine.max_num_seqs == 256


def test_cli_value_outside_the_allowed_ones_is_a_config_error(tmp_path):
    out = subprocess.run(kvlab_cmd("engine.block_size=24", "model=random-llama-tiny", "logger=none"), cwd=tmp_path,
                         env=run_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().endswith("config error: engine.block_size: 24 is not allowed; "
                                       "choose one of (1, 2, 4, 8, 16, 32, 64, 128, 256)")


def test_prefix_caching_options_reach_the_engine(compose):
    config = validate(compose(["engine.enable_prefix_caching=true", "engine.prefix_eviction=slru"]))
    assert config["engine"]["prefix_eviction_args"] == {"protected_fraction": 0.8}
    engine = EngineConfig(**llm_kwargs(config))
    assert (engine.enable_prefix_caching, engine.prefix_eviction) == (True, "slru")


def test_validation_fills_plugin_defaults(compose):
    config = validate(compose(["engine.allocator=contiguous"]))
    assert config["engine"]["allocator_args"] == {"reserve": "request"}


def test_config_error_comes_before_any_model_load(compose, tmp_path, monkeypatch):
    import kvlab.study.experiment as experiment

    monkeypatch.setattr(experiment, "build_llm", lambda kwargs: pytest.fail("a model was built"))
    with pytest.raises(ConfigError, match="engine.block_size"):
        experiment.run_experiment(compose(["engine.block_size=big", "logger=none"]), tmp_path)
    record = experiment.read_record(tmp_path / "run.jsonl")
    assert record["finish"]["status"] == "failed" and "engine.block_size" in record["finish"]["error"]


def test_check_target_disabled_section():
    assert check_target("task", {"_target_": None}) is None
    with pytest.raises(ConfigError, match=r"^task\._target_: cannot import"):
        check_target("task", {"_target_": "kvlab.study.tasks.nope.Nope"})


def test_cli_unknown_option_and_default_compose(tmp_path):
    """`kvlab-run` (the console script) composes the default experiment; a bad option lists the valid ones."""
    bad = subprocess.run(kvlab_cmd("policy=nope"), cwd=tmp_path, env=run_env(), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "Available options in 'policy'" in bad.stderr and "full" in bad.stderr
    script = Path(sys.executable).with_name("kvlab-run")
    ok = subprocess.run([str(script), "--cfg", "job"] if script.exists() else kvlab_cmd("--cfg", "job"), cwd=tmp_path,
                        env=run_env(), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "name: smollm2-135m" in ok.stdout

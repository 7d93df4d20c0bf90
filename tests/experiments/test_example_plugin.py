"""The example policy package (experiments/example_plugin), installed through the `kvlab.plugins` entry
point, appears as a policy option, passes the conformance suite and runs in a sweep."""

from __future__ import annotations

import subprocess
import sys

import pytest
from exp_helpers import REPO, kvlab_cmd, run_env

PLUGIN = REPO / "experiments" / "example_plugin"


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    target = tmp_path_factory.mktemp("plugin_site")
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                          str(PLUGIN)], capture_output=True, text=True, timeout=300)
    if pip.returncode and "satisfies the requirement" in pip.stderr:  # no index to build in isolation from
        pytest.skip(f"pip cannot get the build backend here: {pip.stderr.strip().splitlines()[-1]}")
    assert pip.returncode == 0, pip.stderr[-3000:]
    return run_env(PYTHONPATH=str(target))


def test_the_plugin_policy_is_a_config_option_and_conforms(plugin_env, tmp_path):
    out = subprocess.run(kvlab_cmd("--cfg", "job", "policy=value_norm", "policy.budget=16"), cwd=tmp_path,
                         env=plugin_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "name: value_norm" in out.stdout and "budget: 16" in out.stdout and "recent: 4" in out.stdout
    check = ("from kvlab.testing import check_policy; "
             "check_policy('value_norm', {'budget': 32}, checks=('budget', 'memory', 'determinism', 'no_op'))")
    run = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=plugin_env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.heavy
def test_the_plugin_policy_runs_in_a_sweep(plugin_env, tmp_path):
    out = subprocess.run(kvlab_cmd("-m", "policy=value_norm,knorm", "policy.budget=16", "model=random-llama-tiny",
                                   "task=agreement", "workload=none", "logger=none",
                                   f"hydra.sweep.dir={tmp_path / 'sweep'}"),
                         cwd=tmp_path, env=plugin_env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 jobs: 2 finished, 0 failed, 0 skipped" in out.stdout + out.stderr

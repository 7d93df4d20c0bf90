"""A non-editable install carries the Hydra configs: `python -m kvlab --cfg job` composes outside the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from exp_helpers import REPO, kvlab_cmd, run_env

pytestmark = pytest.mark.process  # another Python process: in the default suite, out of `make test-unit`


def test_installed_package_ships_its_configs(tmp_path):
    source, target, elsewhere = tmp_path / "source", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    # build from a copy: setuptools leaves build/ and *.egg-info beside the sources
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "outputs", "multirun",
                                                                "wandb", "__pycache__", "tests", "experiments"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                          str(source)], capture_output=True, text=True, timeout=300)
    if pip.returncode and "satisfies the requirement" in pip.stderr:  # no index to build in isolation from
        pytest.skip(f"pip cannot get the build backend here: {pip.stderr.strip().splitlines()[-1]}")
    assert pip.returncode == 0, pip.stderr[-3000:]
    assert (target / "kvlab" / "conf" / "engine" / "contiguous.yaml").is_file()
    assert (target / "kvlab" / "conf" / "hydra" / "launcher" / "parallel.yaml").is_file()
    assert (target / "kvlab" / "kernels" / "cpu" / "decode_attention.cpp").is_file()  # built on first use
    roots = {"kvlab": "kvlab", "policies": "kvlab/policies", "kernels": "kvlab/kernels"}
    for root, installed in roots.items():  # every package of the checkout ships (pyproject lists them)
        for init in (REPO / root).rglob("__init__.py"):
            sub = init.parent.relative_to(REPO / root)
            assert (target / installed / sub / "__init__.py").is_file(), f"{root}/{sub} is not in pyproject's packages"

    env = run_env(PYTHONPATH=str(target))  # the installed copy first, not the checkout
    where = subprocess.run([sys.executable, "-c", "import kvlab.study.conf_plugins as c; print(c.CONF_DIR)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip() == str(target / "kvlab" / "conf"), where.stderr
    out = subprocess.run(kvlab_cmd("--cfg", "job", "engine=contiguous"), cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "name: smollm2-135m" in out.stdout and "reserve: request" in out.stdout

"""The source tree's kernels/ and policies/ never pass for top-level packages (kvlab.source_tree).

Each case starts `python -c` in the repository's root, which puts the root on sys.path ('' first), as
`python -m kvlab`, pytest or a notebook started there do.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvlab

ROOT = Path(kvlab.__file__).resolve().parent.parent
pytestmark = [pytest.mark.process, pytest.mark.skipif(
    not (ROOT / "kernels" / "__init__.py").exists(),
    reason="kvlab is installed from a wheel: no source tree to shadow anything")]


@pytest.fixture
def installed(tmp_path) -> str:
    """A folder holding an installed-looking `kernels` package (as Hugging Face's, in site-packages)."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("WHO = 'installed'\n")
    return str(tmp_path)


def run(code: str, env_path: str | None = None) -> str:
    env = None if env_path is None else {**os.environ, "PYTHONPATH": env_path}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_bare_names_are_not_the_source_folders():
    out = run("""
        import importlib.util, sys
        assert sys.path[0] == '', sys.path[:2]          # the root is on sys.path, as in any session started there
        import kvlab
        for name in ("kernels", "policies"):
            spec = importlib.util.find_spec(name)
            ours = importlib.util.find_spec("kvlab." + name).origin
            assert spec is None or spec.origin != ours, (name, spec)
        import kvlab.kernels, kvlab.policies             # the shipped packages still load
        print("ok")
    """)
    assert out == "ok"


def test_an_installed_package_of_that_name_is_found(installed):
    """A `kernels` package later on sys.path than the root (Hugging Face's, in site-packages) is the one imported."""
    out = run("""
        import kvlab, kernels
        print(kernels.WHO)
    """, env_path=installed)
    assert out == "installed"


def test_a_bare_import_before_kvlab_is_undone(installed):
    """transformers may have imported the folder as `kernels` before kvlab was imported: that module is dropped."""
    out = run("""
        import sys
        import kernels, kernels.attention_plan           # the source folder, under its bare name
        assert not hasattr(kernels, "WHO")
        import kvlab
        import kernels
        assert "kernels.attention_plan" not in sys.modules
        print(kernels.WHO)
    """, env_path=installed)
    assert out == "installed"

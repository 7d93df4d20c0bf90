"""Keep the source tree's `kernels/` and `policies/` folders from passing for top-level packages.

kvlab ships the folders `kernels/` and `policies/` as `kvlab.kernels` and `kvlab.policies` (a package-dir mapping).
When the repository's root is on `sys.path` (`python -m ...` or an interactive session started there, pytest's
rootdir), Python also finds them under their bare names. `kernels` is the name of Hugging Face's kernel-hub
package, which transformers probes for and imports (`transformers.integrations.hub_kernels`): it would get
kvlab's folder instead (transformers 5.25 then fails with "cannot import name 'CUDAProperties' from 'kernels'";
5.24 imports kvlab's folder a second time under that name).

`hide()` (run by `import kvlab`, before kvlab loads transformers) makes the bare names resolve as if the root were
not on `sys.path`: to the installed package of that name when there is one, else to nothing (`import kernels`
raises ModuleNotFoundError, `importlib.util.find_spec` returns None). Nothing else on `sys.path` changes. Torch-free.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

NAMES = ("kernels", "policies")  # folders shipped as kvlab.<name>


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def _root_entry(entry: str, root: Path) -> bool:
    """Whether a sys.path entry ('' is the working directory) is the source tree's root."""
    try:
        return Path(entry or ".").resolve() == root
    except OSError:
        return False


class _Elsewhere(importlib.abc.MetaPathFinder):
    """Finds `name` on sys.path without the source tree's root (found afresh each time)."""

    def __init__(self, name: str, root: Path):
        self.name, self.root = name, root

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        entries = [p for p in sys.path if not _root_entry(p, self.root)]
        return importlib.machinery.PathFinder.find_spec(fullname, entries)


def hide(names: tuple[str, ...] = NAMES) -> list[str]:
    """Hide each shadowing folder; returns the names it acted on (empty outside a source checkout)."""
    acted = []
    for name in names:
        ours = importlib.util.find_spec(f"kvlab.{name}")
        if ours is None or ours.origin is None:
            continue
        loaded = sys.modules.get(name)
        if loaded is not None and _same(getattr(loaded, "__file__", None), ours.origin):
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]  # imported under the bare name before kvlab was, with its submodules
        elif name in sys.modules:
            continue  # already the real package, or already hidden
        bare = importlib.machinery.PathFinder.find_spec(name, sys.path)
        if bare is None or not _same(bare.origin, ours.origin):
            continue
        root = Path(ours.origin).resolve().parent.parent
        finder = _Elsewhere(name, root)
        if finder.find_spec(name) is None:
            sys.modules[name] = None  # nothing of that name is installed: importing it fails, as outside the tree
        elif not any(isinstance(f, _Elsewhere) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, finder)
        acted.append(name)
    return acted

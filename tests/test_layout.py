"""The package's rooms (docs/design.md, "Rooms"): a room imports only itself and the rooms below it,
lazy imports included, and no two modules import each other in a loop."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"kvlab": ROOT / "kvlab", "kvlab.policies": ROOT / "policies", "kvlab.kernels": ROOT / "kernels"}
ORDER = ["kernels", "cache", "policies", "speculation", "engine", "study"]  # bottom to top
SHARED = {"engine_config", "sampling_params", "sequence", "sampler", "registry", "schema", "models", "outputs",
          "metrics", "stop_strings"}  # kvlab/*.py records every room may use: they import no room


def modules() -> dict[str, Path]:
    out = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            if prefix == "kvlab" and parts and parts[0] in ("policies", "kernels", "conf"):
                continue
            out[".".join([prefix, *parts])] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The kvlab modules `path` imports anywhere in it (the longest known module of each dotted name)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n.startswith("kvlab.") and n != name:
                found.add(n)
    return found


def room(module: str) -> str | None:
    part = module.split(".")[1] if "." in module else ""
    return part if part in ORDER else ("shared" if part in SHARED else None)


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, m, set(mods)) for m, p in mods.items()}


def test_no_room_imports_a_room_that_builds_on_it():
    wrong = []
    for src, targets in graph().items():
        a = room(src)
        for dst in targets:
            b = room(dst)
            if a == "shared" and b in ORDER:
                wrong.append(f"{src} -> {dst} (a shared record imports a room)")
            elif a in ORDER and b in ORDER and ORDER.index(b) > ORDER.index(a):
                wrong.append(f"{src} -> {dst} ({a} builds below {b})")
            elif a in ORDER and a != "study" and b is None:  # the study room drives the engine through kvlab.LLM
                wrong.append(f"{src} -> {dst} (a room imports the API above it)")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle():
    g = graph()
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_rooms_exist_and_the_check_sees_their_imports():
    g = graph()
    assert {room(m) for m in g} >= set(ORDER) | {"shared"}
    assert "kvlab.cache.block_manager" in g["kvlab.engine.scheduler"]  # a module-level import
    assert "kvlab.kernels.attention_plan" in g["kvlab.engine.attention"]

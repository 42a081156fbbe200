"""The package's layers import one way, without cycles, and only the Lightning layer loads Lightning.

docs/DESIGN.md, "Layout": runtime <- transport <- replicas, checkpoint <- tools <- the Lightning layer (strategy,
callbacks, models, data, cli). Read from the sources (every import, function-level ones included), and checked
by importing every module that does not import Lightning itself in a fresh interpreter.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lit_efficient"
# Layer of each top-level part of the package: a module may import its own layer and the layers below.
LAYERS = {
    "runtime": 0, "protocol": 0, "checks": 0, "nested": 0, "rank_reaper": 0,
    "transport": 1,
    "replicas": 2, "checkpoint": 2,
    "tools": 3,
    "strategy": 4, "callbacks": 4, "models": 4, "data": 4, "cli": 4, "__init__": 5,
    "__main__": 5,  # python -m lit_efficient: the command, beside the package's face
}  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, name: str) -> set[str]:
    """Every module of the package ``path`` imports, anywhere in it (function-level imports count)."""
    modules = _modules()
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import: the package, up ``level - 1`` parents, then the module
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parents + ([base] if base else []))
            submodules = {f"{base}.{a.name}" for a in node.names} & set(modules)
            found |= submodules
            if len(submodules) < len(node.names):  # a name defined by the module (or package __init__) itself
                found.add(base)
    return {m for m in found if m in modules and m != name}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    return {name: _imports(path, name) for name, path in _modules().items()}


def test_every_module_belongs_to_a_layer():
    assert {_part(m) for m in _modules()} <= set(LAYERS), "a new top-level part needs a layer in LAYERS"


def test_imports_go_to_the_same_layer_or_below():
    upward = [
        f"{m} ({_part(m)}) imports {d} ({_part(d)})"
        for m, deps in _graph().items()
        for d in sorted(deps)
        if LAYERS[_part(d)] > LAYERS[_part(m)] and not (m == "lit_efficient" and _part(d) != "__init__")
    ]
    assert upward == [], "imports that run up the layers:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = _graph()
    graph["lit_efficient"] = set()  # the package's lazy names point at everything by design, at run time only
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _imports_lightning(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        if any(n == "lightning" or n.startswith(("lightning.", "pytorch_lightning")) for n in names):
            return True
    return False


@pytest.mark.timeout(120)
def test_modules_that_do_not_import_lightning_load_none():
    """Importing a runtime, transport, checkpoint, replicas or tools module (and the package itself) loads no
    Lightning, through the package ``__init__`` or anything else."""
    modules = _modules()
    lightning_free = {m for m, p in modules.items() if LAYERS[_part(m)] < 4 and not _imports_lightning(p)}
    assert {_part(m) for m in lightning_free} >= {"runtime", "transport", "checkpoint", "replicas", "tools"}
    script = (
        "import importlib, json, sys\n"
        f"loaded = {{}}\n"
        f"for name in {sorted(['lit_efficient', *lightning_free])!r}:\n"
        "    importlib.import_module(name)\n"
        "    loaded[name] = sorted(m for m in sys.modules if m == 'lightning' or m.startswith('lightning.'))[:3]\n"
        "print(json.dumps(loaded))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    offenders = {name: mods for name, mods in loaded.items() if mods}
    assert offenders == {}, f"importing these loaded Lightning: {offenders}"
    assert len(loaded) == len(lightning_free) + 1

"""Layering: a package imports only from the layers below it and declares each one it imports.

Also checks that third-party modules imported at module level are declared dependencies (imports
inside functions or ``try`` blocks are optional features and may come from extras).
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ["kernels", "parallel", "models", "train", "bridge"]
# import name -> distribution name, for third-party packages whose names differ
DIST_OF = {"yaml": "pyyaml", "pynvml": "nvidia-ml-py", "huggingface_hub": "huggingface-hub"}
STDLIB = set(sys.stdlib_module_names)


def _pyproject(layer: str) -> dict:
    return tomllib.loads((ROOT / "packages" / f"mcore-{layer}" / "pyproject.toml").read_text())


def _declared(layer: str) -> set[str]:
    deps = _pyproject(layer)["project"].get("dependencies", [])
    return {re.split(r"[<>=!;\[ ]", d, maxsplit=1)[0].strip().lower() for d in deps}


def _imports(path: pathlib.Path):
    """Yield (module name, line, is_top_level) for every absolute import in a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    top_level_nodes = set()
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            top_level_nodes.add(id(node))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top_level_nodes
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "mcore":
                for alias in node.names:
                    yield f"mcore.{alias.name}", node.lineno, id(node) in top_level_nodes
            else:
                yield node.module, node.lineno, id(node) in top_level_nodes


def _problems(layer: str) -> list[str]:
    rank = LAYERS.index(layer)
    src = ROOT / "packages" / f"mcore-{layer}" / "src" / "mcore" / layer
    declared = _declared(layer)
    problems = []
    for f in sorted(src.rglob("*.py")):
        rel = f.relative_to(ROOT)
        for module, line, top in _imports(f):
            parts = module.split(".")
            if parts[0] == "mcore":
                other = parts[1] if len(parts) > 1 else None
                if other not in LAYERS:
                    problems.append(f"{rel}:{line}: imports {module}, which is no mcore layer")
                elif LAYERS.index(other) > rank:
                    problems.append(f"{rel}:{line}: mcore.{layer} imports mcore.{other}, a layer above it")
                elif other != layer and f"mcore-{other}" not in declared:
                    problems.append(f"{rel}:{line}: imports mcore.{other} but mcore-{layer} does not depend on it")
            elif top and parts[0] not in STDLIB and parts[0] != "__future__":
                dist = DIST_OF.get(parts[0], parts[0]).lower().replace("_", "-")
                if dist not in declared:
                    problems.append(f"{rel}:{line}: module-level import of {parts[0]} ({dist}) is not declared")
    return problems


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_imports_only_below_and_declared(layer):
    assert _problems(layer) == []


def test_namespace_has_no_init():
    for layer in LAYERS:
        assert not (ROOT / "packages" / f"mcore-{layer}" / "src" / "mcore" / "__init__.py").exists()


def test_checker_catches_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "packages" / "mcore-kernels" / "src" / "mcore" / "kernels"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("from mcore.models import gpt\nimport yaml\n")
    (tmp_path / "packages" / "mcore-kernels" / "pyproject.toml").write_text(
        '[project]\nname = "mcore-kernels"\ndependencies = ["torch"]\n'
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    problems = _problems("kernels")
    assert any("a layer above it" in p for p in problems)
    assert any("yaml" in p for p in problems)


def test_each_package_declares_its_version_once():
    for layer in LAYERS:
        meta = _pyproject(layer)
        assert "version" in meta["project"]["dynamic"]
        assert meta["tool"]["hatch"]["version"]["path"] == f"src/mcore/{layer}/__init__.py"


# ------------------------------------------------------------------------------------------------ import cycles
def _module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of every package (``pkg/__init__.py`` is ``pkg``)."""
    out = {}
    for layer in LAYERS:
        src = root / "packages" / f"mcore-{layer}" / "src"
        for f in src.rglob("*.py"):
            parts = list(f.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _module_imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file (functions and ``TYPE_CHECKING`` blocks
    included: a cycle hidden inside a function is still two modules that need each other)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _import_cycles(root: pathlib.Path = ROOT) -> list[list[str]]:
    """Strongly connected components of more than one module in the import graph (Tarjan's algorithm)."""
    modules = _module_files(root)
    graph = {name: sorted(_module_imports(name, path, modules)) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle_between_modules():
    assert _import_cycles() == [], "modules that import each other (move what both need into a third module)"


def test_cycle_checker_finds_a_cycle_inside_a_function(tmp_path):
    fake = tmp_path / "packages" / "mcore-train" / "src" / "mcore" / "train"
    fake.mkdir(parents=True)
    (fake / "a.py").write_text("from mcore.train.b import thing\n")
    (fake / "b.py").write_text("def thing():\n    from mcore.train import a\n")
    (fake / "c.py").write_text("from . import a\n")
    assert _import_cycles(tmp_path) == [["mcore.train.a", "mcore.train.b"]]


# ------------------------------------------------------------------------------------------------ both ways
def _all_dependencies(layer: str) -> tuple[set[str], dict[str, set[str]]]:
    """(required distributions, extra name -> its distributions) of one package."""
    project = _pyproject(layer)["project"]

    def names(items: list[str]) -> set[str]:
        return {re.split(r"[<>=!;\[ ]", d, maxsplit=1)[0].strip().lower() for d in items}

    extras = {name: names(items) for name, items in project.get("optional-dependencies", {}).items()}
    return names(project.get("dependencies", [])), extras


# Declared distributions that a package needs without importing them by name: torch imports them for it.
USED_THROUGH_TORCH = {
    ("train", "nvidia-ml-py"): "torch.cuda.utilization/temperature/power_draw import pynvml (gpu_stats.py)",
    ("train", "tensorboard"): "torch.utils.tensorboard imports tensorboard (metrics.py)",
}


def _imported_distributions(layer: str) -> set[str]:
    src = ROOT / "packages" / f"mcore-{layer}" / "src" / "mcore" / layer
    found = set()
    for f in src.rglob("*.py"):
        for module, _, _ in _imports(f):
            parts = module.split(".")
            if parts[0] == "mcore" and len(parts) > 1:
                found.add(f"mcore-{parts[1]}")
            elif parts[0] not in STDLIB and parts[0] != "__future__":
                found.add(DIST_OF.get(parts[0], parts[0]).lower().replace("_", "-"))
    return found - {f"mcore-{layer}"}


@pytest.mark.parametrize("layer", LAYERS)
def test_declared_dependencies_equal_imports(layer):
    """Every import anywhere (optional ones too) is declared, as a dependency or in an extra, and every
    declared distribution is imported somewhere (or is listed in USED_THROUGH_TORCH with the reason)."""
    required, extras = _all_dependencies(layer)
    declared = required | set().union(*extras.values())
    imported = _imported_distributions(layer)
    indirect = {dist for (lay, dist) in USED_THROUGH_TORCH if lay == layer}
    assert sorted(imported - declared) == [], "imported but not declared"
    assert sorted(declared - imported - indirect) == [], "declared but never imported"

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

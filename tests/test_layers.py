"""The package's folders are its architecture (docs/architecture.md): each layer imports only
from the layers before it, and the flat layout's module paths still import, with a warning."""
from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

import ms_memopt
from ms_memopt._moved import MOVED

PACKAGE = Path(ms_memopt.__file__).parent
#: the layers in data-flow order; a module may import from its own layer and the ones before it
ORDER = ["core", "io", "config", "allocators", "native", "analysis", "engine", "report"]
#: the adapter, the command line and the demo sit on top and may import any layer
TOP = {"mindspore", "cli", "demo", "__main__", "__init__", "_moved"}


def _layer(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import of the package in ``path``, lazy ones included;
    ``from ms_memopt import x`` counts as ``ms_memopt.x``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ms_memopt"):
            if node.module == "ms_memopt":
                out += [(node.lineno, f"ms_memopt.{alias.name}") for alias in node.names]
            else:
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("ms_memopt.")]
    return out


def _modules() -> list[tuple[str, Path]]:
    return [(".".join(("ms_memopt", *path.relative_to(PACKAGE).with_suffix("").parts)), path)
            for path in sorted(PACKAGE.rglob("*.py")) if "mindformers_register" not in path.parts]


def test_every_module_sits_in_a_known_layer():
    unknown = {_layer(name) for name, _ in _modules()} - set(ORDER) - TOP
    assert not unknown, f"folders outside the layering of docs/architecture.md: {sorted(unknown)}"


def test_layers_import_only_from_the_layers_before_them():
    wrong = []
    for name, path in _modules():
        layer = _layer(name)
        if layer in TOP:
            continue
        for line, target in _imports(path):
            other = _layer(target)
            if other in TOP or ORDER.index(other) > ORDER.index(layer):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {layer} imports {target} ({other})")
    assert not wrong, "imports against the data flow:\n" + "\n".join(wrong)


def test_no_relative_imports_hide_a_layer():
    """Imports name their layer (``from ms_memopt.core.layout import ...``), so the test above sees them."""
    relative = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}" for _, path in _modules()
                for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative, relative


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_flat_layout_still_imports_with_a_warning(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)     # an earlier test may have imported it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert any(issubclass(w.category, DeprecationWarning) and MOVED[old] in str(w.message) for w in caught)


def test_an_old_submodule_path_imports_too(monkeypatch):
    monkeypatch.delitem(sys.modules, "ms_memopt.traces.ms_pool_log", raising=False)
    with pytest.warns(DeprecationWarning, match="ms_memopt.io.traces.ms_pool_log"):
        old = importlib.import_module("ms_memopt.traces.ms_pool_log")
    assert old.PoolLogParser is importlib.import_module("ms_memopt.io.traces.ms_pool_log").PoolLogParser


def test_the_old_report_module_names_are_the_report_package_names():
    from ms_memopt.report import build_report, read_layouts
    from ms_memopt.io.layouts import read_layouts as reader
    assert read_layouts is reader and callable(build_report)

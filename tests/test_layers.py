"""The package's folders are its architecture (docs/architecture.md): each layer imports only
from the layers before it, no module imports another that imports it back, and no private name
crosses a module boundary."""
from __future__ import annotations

import ast
from pathlib import Path


import ms_memopt

PACKAGE = Path(ms_memopt.__file__).parent
#: the layers in data-flow order; a module may import from its own layer and the ones before it
ORDER = ["core", "io", "config", "allocators", "native", "analysis", "replay", "workload", "templates",
         "simulation", "doctor", "report"]
#: the adapter, the command line and the demo sit on top and may import any layer
TOP = {"mindspore", "cli", "demo", "__main__", "__init__"}


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


def test_the_old_report_module_names_are_the_report_package_names():
    from ms_memopt.report import build_report, read_layouts
    from ms_memopt.io.layouts import read_layouts as reader
    assert read_layouts is reader and callable(build_report)


def _module_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (lazy imports included), by dotted name."""
    names = {name for name, _ in _modules()}
    graph = {}
    for name, path in _modules():
        targets = set()
        for _, target in _imports(path):
            while target not in names and "." in target:      # ``from ms_memopt.x import y``: y may be a name
                target = target.rsplit(".", 1)[0]
            if target in names and target != name and not target.endswith("__init__"):
                targets.add(target)
        graph[name] = targets
    return graph


def test_no_module_imports_another_that_imports_it_back():
    """No import circle, however long (lazy imports count: they are a circle deferred)."""
    graph = _module_graph()
    packages = {name for name, path in _modules() if path.name == "__init__.py"}
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt in packages:          # a package's __init__ re-exports; its submodules are the edges
                continue
            if state.get(nxt) == 1:
                circles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif not state.get(nxt):
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if not state.get(name):
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_private_name_crosses_a_module_boundary():
    """``from ms_memopt.a import _helper`` means the helper is shared: it belongs where both import it,
    under a public name."""
    modules = {name for name, _ in _modules()} | {   # and the compiled ones (``_fastpool.cpython-311-....so``)
        ".".join(("ms_memopt", *path.relative_to(PACKAGE).parent.parts, path.name.split(".")[0]))
        for path in PACKAGE.rglob("*.so")}
    crossing = []
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ms_memopt")
                    and node.module != name):
                crossing += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.module}.{a.name}"
                             for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
                             and f"{node.module}.{a.name}" not in modules]     # a package's private module
    assert not crossing, "private names imported from another module:\n" + "\n".join(crossing)

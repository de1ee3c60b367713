"""The docs name only modules and files that exist, and carry no path of the machine they were written on."""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ms_memopt"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: a bare ``mindspore/...`` is MindSpore's own tree (its sources, its wheel): ours is written ``ms_memopt/mindspore/``
LAYERS = "core|io|config|allocators|native|analysis|replay|workload|templates|simulation|doctor|report|cli"
_DOTTED = re.compile(r"(?<![\w/.])ms_memopt(?:\.\w+)+")
_SLASHED = re.compile(rf"(?<![\w/.-])(?:ms_memopt/[\w/]*\w|(?:{LAYERS})/[\w/]*\w)(?:\.py)?(?:\.\w+)?")
#: a home, a checkout or a session's folder of some machine (``/tmp/...`` in an example command is fine)
_ABSOLUTE = re.compile(r"(?<![\w.~])/(?:work|root|home|Users|opt|mnt|data)/[\w.-]+")


@lru_cache(maxsize=None)
def _names(path: Path) -> frozenset[str]:
    """Top-level names a module defines or imports (what ``module.name`` may refer to)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if node.__dict__.get("value") is not None and any(getattr(t, "id", "") == "_EXPORTS" for t in targets):
            try:        # a package that exports lazily (``__getattr__``) names its exports in ``_EXPORTS``
                names |= set(ast.literal_eval(node.value))
            except ValueError:
                pass
    return frozenset(names)


def _module_file(parts: list[str]) -> Path | None:
    base = PACKAGE.parent.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    if base.parent.is_dir() and any(base.parent.glob(base.name + ".*.so")):      # a compiled module
        return base
    return None


def _dotted_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(parts[:cut])
        if module is None:
            continue
        rest = parts[cut:]
        return not rest or module.suffix != ".py" or rest[0] in _names(module)
    return False


def _slashed_exists(text: str) -> bool:
    path = text if text.startswith("ms_memopt/") else "ms_memopt/" + text
    target = ROOT / path
    if target.exists() or target.with_suffix(".py").exists():
        return True
    # ``replay/replay.default_allocator``: a module path and a name in it
    stem, _, name = path.rpartition(".")
    module = ROOT / (stem + ".py")
    return bool(stem) and module.is_file() and name in _names(module)


def _mentions(pattern: re.Pattern) -> list[tuple[str, int, str]]:
    found = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            found += [(doc.name, number, m.group(0)) for m in pattern.finditer(line)]
    return found


def test_the_docs_exist():
    assert (ROOT / "docs" / "architecture.md").is_file() and len(DOCS) > 5


def test_every_dotted_module_path_in_the_docs_exists():
    missing = [f"{doc}:{line}: {text}" for doc, line, text in _mentions(_DOTTED) if not _dotted_exists(text)]
    assert not missing, "the docs name modules or names that do not exist:\n" + "\n".join(missing)


def test_every_package_path_in_the_docs_exists():
    missing = [f"{doc}:{line}: {text}" for doc, line, text in _mentions(_SLASHED) if not _slashed_exists(text)]
    assert not missing, "the docs name files that do not exist:\n" + "\n".join(missing)


def test_no_doc_carries_an_absolute_path_of_a_machine():
    found = [f"{doc}:{line}: {text}" for doc, line, text in _mentions(_ABSOLUTE)]
    assert not found, "absolute paths in the docs (write them relative to the checkout):\n" + "\n".join(found)


@pytest.mark.parametrize("text, exists", [("ms_memopt.replay.replay.replay", True),
                                          ("ms_memopt.engine.replay", False),
                                          ("ms_memopt.simulation.spec.job_from_recipe", True),
                                          ("ms_memopt.simulation.spec.no_such_name", False)])
def test_the_check_itself_tells_a_module_from_a_ghost(text, exists):
    assert _dotted_exists(text) is exists

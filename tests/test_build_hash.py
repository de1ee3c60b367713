"""Stale builds: every compiled library carries the hash of the C sources it was built from, and
a loader refuses one whose sources in the tree changed since (ms_memopt/core/_build_hash.py).

CI fails here on a forgotten rebuild; an edited copy of the sources (one byte changed) stands
for an edit without rebuilding: each of the three loaders (ms_memopt/native, the planner's
search, the allocators' fast path) then warns, names the rebuild command and runs the
pure-Python reference, which gives the library's results.
"""
from __future__ import annotations

import ctypes
import fnmatch
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from ms_memopt.core import _build_hash

from ms_memopt import native
from ms_memopt.allocators import create, fast
from ms_memopt.analysis.planner import Buffer, _native
from ms_memopt.analysis.planner.search import search_place
from ms_memopt.core._build_hash import EXTENSIONS, StaleBuildWarning

REPO = Path(__file__).resolve().parent.parent
LIB, FASTPOOL = "ms_memopt.native._lib", "ms_memopt.allocators.fast._fastpool"
HAVE_GCC = shutil.which("gcc") is not None
SWITCHED_OFF = os.environ.get("MS_MEMOPT_NATIVE", "1") == "0" or \
    os.environ.get("MS_MEMOPT_PURE_PYTHON", "") not in ("", "0")


def _library_file(extension: str) -> Path | None:
    spec = importlib.util.find_spec(extension)
    return Path(spec.origin) if spec is not None and spec.origin else None


def _built_hash(extension: str) -> str | None:
    """The hash the built library carries, read straight from it (no loader involved)."""
    if extension == LIB:
        path = native._library_path()
        return None if path is None else native._source_hash(ctypes.CDLL(str(path)))
    return getattr(importlib.import_module(extension), "SOURCE_HASH", None)


def _needs_built(extension: str) -> None:
    present = native._library_path() is not None if extension == LIB else _library_file(extension) is not None
    if not present:
        if HAVE_GCC:
            pytest.fail(f"{extension} is not built although gcc is here (`make setup` / `pip install -e .`)")
        pytest.skip(f"{extension} is not built (no C compiler)")


# ---------------------------------------------------------------- the installed build

@pytest.mark.parametrize("extension", sorted(EXTENSIONS))
def test_built_libraries_carry_the_hash_of_the_sources_in_the_tree(extension):
    """A forgotten rebuild after a .c edit fails here (and in CI), not only as a warning."""
    _needs_built(extension)
    expected = _build_hash.tree_hash(extension)
    assert expected is not None, f"the sources of {extension} are missing from the checkout"
    assert _built_hash(extension) == expected, _build_hash.stale_reason(extension, _built_hash(extension))


@pytest.mark.skipif(SWITCHED_OFF, reason="MS_MEMOPT_NATIVE=0 / MS_MEMOPT_PURE_PYTHON=1 turn the libraries off")
def test_the_loaders_take_the_fresh_libraries():
    for extension in EXTENSIONS:
        _needs_built(extension)
    assert native.available(), native.unavailable_reason()
    assert _native.library() is not None, _native.unavailable_reason()
    assert fast.FAST_MODELS and fast.AVAILABLE


def test_every_c_source_is_hashed_built_and_a_prerequisite_of_the_makefile_stamp():
    listed = {source for sources in EXTENSIONS.values() for source in sources}
    in_tree = {path.relative_to(REPO).as_posix() for pattern in ("*.c", "*.h") for path in (REPO / "ms_memopt").rglob(pattern)}
    assert in_tree == listed, "a C source or header that setup.py does not build and hash (or a listed one that is gone)"
    makefile = (REPO / "Makefile").read_text()
    rule = re.search(r"^\$\(STAMP\):(.*)$", makefile, re.M)
    prerequisites = [pattern for word in re.findall(r"\$\(wildcard [^)]*\)|\S+", rule.group(1))
                     for pattern in re.sub(r"^\$\(wildcard (.*)\)$", r"\1", word).split()]
    for source in sorted(listed) + ["ms_memopt/core/_build_hash.py", "setup.py"]:
        assert any(fnmatch.fnmatch(source, p) for p in prerequisites), f"`make test` would not rebuild after editing {source}"
    fast_files = {p for p in listed if p.startswith("ms_memopt/allocators/fast/")}
    assert {Path(p).name for p in fast_files} >= {"fastpool.h", "common.c", "_fastpool.c", "mindspore.c", "mindspore_vmm.c",
                                                  "torch.c", "torch_expandable.c", "pool.c"}
    assert "ms_memopt/allocators/fast/*.h" in prerequisites, "a header edit must rebuild too"
    setup = (REPO / "setup.py").read_text()
    assert setup.count("build_hash.EXTENSIONS[") >= 2, "setup.py must build the sources _build_hash hashes"


def test_stale_reason_names_the_library_and_the_rebuild_command():
    expected = _build_hash.tree_hash(LIB)
    assert _build_hash.stale_reason(LIB, expected) is None
    for carried in (None, "", "0" * 64):
        reason = _build_hash.stale_reason(LIB, carried, "/x/_lib.so")
        assert reason.startswith("ms_memopt.native._lib (/x/_lib.so) is stale")
        assert "make setup" in reason and "pip install -e ." in reason
    assert "carries no source hash" in _build_hash.stale_reason(LIB, None)


# ---------------------------------------------------------------- a simulated edit

def _copy_sources(root: Path, edit: str | None = None) -> Path:
    """Every hashed source copied under ``root``, ``edit`` (one of them) with one byte changed."""
    for source in {s for sources in EXTENSIONS.values() for s in sources}:
        target = root / source
        target.parent.mkdir(parents=True, exist_ok=True)
        data = bytearray((REPO / source).read_bytes())
        if source == edit:
            data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    return root


@pytest.fixture
def fresh_loaders(monkeypatch):
    """A function that makes the lazy loaders forget what they loaded, called once here
    (monkeypatch puts the loaded state back afterwards)."""
    def forget() -> None:
        for name, value in (("_loaded", False), ("_lib", None), ("_reason", None)):
            monkeypatch.setattr(native, name, value)
        for name, value in (("_loaded", None), ("_reason", None), ("_tried", False)):
            monkeypatch.setattr(_native, name, value)
    forget()
    return forget


@pytest.fixture
def edit(tmp_path, monkeypatch, fresh_loaders):
    """``edit(source)``: the tree's sources as they would be after an edit of ``source``, seen
    by loaders that load afresh."""
    def apply(source: str) -> Path:
        root = _copy_sources(tmp_path / "tree", source)
        monkeypatch.setattr(_build_hash, "ROOT", root)
        fresh_loaders()
        return root
    return apply


def _compaction(seed: int = 0):
    """A small arena filled, half freed and compacted: its bytes and offsets."""
    from ms_memopt.analysis.arena import Arena, ArenaFull

    arena, rng = Arena(1 << 18), np.random.default_rng(seed)
    arena.backend.buffer[:] = rng.integers(0, 256, arena.capacity, dtype=np.uint8)
    handles = []
    while True:
        try:
            handles.append(arena.alloc(int(rng.integers(1, 6000))))
        except ArenaFull:
            break
    for handle in handles[::2]:
        arena.free(handle)
    report = arena.compact()
    return arena.backend.buffer.copy(), [h.offset for h in arena.handles()], report.runs


def test_an_edited_native_source_makes_ms_memopt_native_fall_back(edit):
    _needs_built(LIB)
    if SWITCHED_OFF:
        pytest.skip("the library is switched off here")
    assert native.available()
    with_library = _compaction()
    edit("ms_memopt/native/move_runs.c")
    with pytest.warns(StaleBuildWarning, match=r"ms_memopt\.native\._lib \(.*_lib.*\) is stale.*make setup.*pip install -e \."):
        assert not native.available()
    assert native.library() is None and "is stale" in native.unavailable_reason()
    with pytest.raises(RuntimeError, match="is stale"):
        native.move_runs(0, np.zeros(0), np.zeros(0), np.zeros(0))
    fallback = _compaction()                                   # the run-by-run memmoves
    np.testing.assert_array_equal(fallback[0], with_library[0])
    assert fallback[1:] == with_library[1:]


_TINY = [Buffer("a", 0, 3, 4), Buffer("b", 1, 4, 3), Buffer("c", 2, 6, 2), Buffer("d", 4, 6, 5), Buffer("e", 0, 2, 2)]


def test_an_edited_search_source_makes_the_planner_fall_back(edit):
    _needs_built(LIB)
    if SWITCHED_OFF:
        pytest.skip("the library is switched off here")
    compiled = search_place(_TINY, 9, engine="native")
    edit("ms_memopt/analysis/planner/_search.c")
    with pytest.warns(StaleBuildWarning, match=r"ms_memopt\.native\._lib .* is stale.*make setup"):
        assert _native.library() is None
    assert "is stale" in _native.unavailable_reason() and "make setup" in _native.unavailable_reason()
    with pytest.raises(RuntimeError, match="is stale"):
        search_place(_TINY, 9, engine="native")
    fallback = search_place(_TINY, 9)                          # "auto": the Python search
    assert (fallback.offsets, fallback.exhausted, fallback.nodes) == (compiled.offsets, compiled.exhausted, compiled.nodes)
    assert fallback.offsets is not None


_TINY_CALLS = """
def run(create):
    pool = create("mindspore", capacity=1 << 30)
    a = pool.malloc(1000); b = pool.malloc(3000); c = pool.malloc(5 << 20)
    pool.free(b)
    d = pool.malloc(2000)
    pool.free(a)
    return {"module": type(pool).__module__, "addrs": [a, b, c, d, pool.malloc(700)],
            "counters": [pool.reserved, pool.allocated, pool.peak_reserved, pool.peak_allocated, pool.largest_free()]}
"""


def _tiny_run(create_function) -> dict:
    scope: dict = {}
    exec(_TINY_CALLS, scope)
    return scope["run"](create_function)


@pytest.mark.parametrize("source", EXTENSIONS[FASTPOOL], ids=lambda s: Path(s).name)
def test_an_edited_fastpool_source_makes_the_allocators_fall_back(edit, source):
    """Any of the fast path's files: each model's .c, the shared code, the module, the header."""
    _needs_built(FASTPOOL)
    compiled = _tiny_run(create)
    assert compiled["module"] == "ms_memopt.allocators.fast"
    root = edit(source)
    with pytest.warns(StaleBuildWarning, match=r"ms_memopt\.allocators\.fast\._fastpool \(.*_fastpool.*\) is stale.*make setup.*pip install -e \."):
        assert fast._compiled_core() is None
    # the decision is taken when ms_memopt.allocators.fast is imported: a fresh interpreter
    script = f"""
import json, sys, warnings
from pathlib import Path
from ms_memopt.core import _build_hash
_build_hash.ROOT = Path(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from ms_memopt.allocators import create, fast
{_TINY_CALLS}
result = run(create)
result.update(fast_models=list(fast.FAST_MODELS), available=fast.AVAILABLE,
              warnings=[(w.category.__name__, str(w.message)) for w in caught])
print(json.dumps(result))
"""
    done = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, check=True)
    fallback = json.loads(done.stdout)
    assert fallback["module"] == "ms_memopt.allocators.mindspore"      # the pure-Python reference
    assert fallback["fast_models"] == [] and fallback["available"] is False
    assert [category for category, _ in fallback["warnings"]] == ["StaleBuildWarning"]
    assert "_fastpool" in fallback["warnings"][0][1] and "make setup" in fallback["warnings"][0][1]
    assert (fallback["addrs"], fallback["counters"]) == (compiled["addrs"], compiled["counters"])


# ---------------------------------------------------------------- when not to check

def test_without_sources_an_installed_library_just_loads(tmp_path, monkeypatch, fresh_loaders):
    """An installed wheel carries no .c files: nothing to compare with, the library is used."""
    _needs_built(LIB)
    _needs_built(FASTPOOL)
    if SWITCHED_OFF:
        pytest.skip("the library is switched off here")
    monkeypatch.setattr(_build_hash, "ROOT", tmp_path)
    assert _build_hash.tree_hash(LIB) is None and _build_hash.tree_hash(FASTPOOL) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.available() and _native.library() is not None
        assert fast._compiled_core() is not None


def test_the_switches_still_turn_the_libraries_off_without_a_stale_warning(edit, monkeypatch):
    edit("ms_memopt/native/adamw.c")
    monkeypatch.setenv("MS_MEMOPT_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native.available() and native.unavailable_reason() == "MS_MEMOPT_NATIVE=0 is set"
        assert _native.library() is None and "MS_MEMOPT_NATIVE=0" in _native.unavailable_reason()
    monkeypatch.delenv("MS_MEMOPT_NATIVE")
    monkeypatch.setenv("MS_MEMOPT_PURE_PYTHON", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native.library() is None and "MS_MEMOPT_PURE_PYTHON" in _native.unavailable_reason()

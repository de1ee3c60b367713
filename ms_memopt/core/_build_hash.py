"""Which C sources each compiled library is built from, and whether a built library is stale.

``setup.py`` loads this file by path (it imports nothing but the standard library) to take the
source lists of its extensions from :data:`EXTENSIONS` and to compile :func:`tree_hash` of them
into each library (the ``MS_MEMOPT_SOURCE_HASH`` macro: ``ms_memopt_source_hash()`` in
``ms_memopt.native._lib``, ``SOURCE_HASH`` in ``ms_memopt.allocators.fast._fastpool`` and
``ms_memopt.io.traces._pickle_scan``). At load time the four loaders (``ms_memopt/native/__init__.py``,
``ms_memopt/analysis/planner/_native.py`` through it, ``ms_memopt/allocators/fast/__init__.py``,
``ms_memopt/io/traces/torch_snapshot.py``) call :func:`check`: when the sources are present (a source
tree, an editable install) and their hash differs from the library's, someone edited a ``.c``
without rebuilding, and the loader refuses the stale library, with a :class:`StaleBuildWarning`
naming it and the rebuild command, and runs the pure-Python reference instead. Without the
sources (an installed wheel) the library is used as it is.

Example:
    >>> sorted(EXTENSIONS)
    ['ms_memopt.allocators.fast._fastpool', 'ms_memopt.io.traces._pickle_scan', 'ms_memopt.native._lib']
    >>> len(source_hash([]))
    64
"""
from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

__all__ = ["EXTENSIONS", "REBUILD", "ROOT", "StaleBuildWarning", "source_hash", "tree_hash", "stale_reason", "check"]

#: extension -> its C sources, relative to :data:`ROOT`: every ``.c`` (setup.py compiles exactly
#: these) and ``.h`` (its ``depends``) the library is built from, all of them hashed
EXTENSIONS: dict[str, tuple[str, ...]] = {
    "ms_memopt.native._lib": ("ms_memopt/native/move_runs.c", "ms_memopt/native/adamw.c",
                              "ms_memopt/analysis/planner/_search.c"),
    # one module from several C files (one per model, ms_memopt/allocators/fast/fastpool.h says
    # which is which) and the header they share: an edit of any of them makes the build stale
    "ms_memopt.allocators.fast._fastpool": tuple(f"ms_memopt/allocators/fast/{name}" for name in (
        "fastpool.h", "common.c", "mindspore.c", "mindspore_vmm.c", "torch.c", "torch_expandable.c", "torch_npu.c", "pool.c",
        "_fastpool.c")),
    # the pickle nesting guard (ms_memopt/io/traces/torch_snapshot.py: pickle_nesting)
    "ms_memopt.io.traces._pickle_scan": ("ms_memopt/io/traces/_pickle_scan.c",),
}

#: what rebuilds the compiled libraries
REBUILD = "`make setup` (or `pip install -e .`)"

#: the folder holding the ``ms_memopt`` package (and, in a source tree, setup.py); read at each
#: call, so a test can point it at an edited copy of the sources
ROOT = Path(__file__).resolve().parents[2]


class StaleBuildWarning(UserWarning):
    """A compiled library was built from other C sources than the tree's; it is not used."""


def source_hash(paths) -> str:
    """sha256 (hex) over the files ``paths`` in order: each one's name as given, size and bytes."""
    digest = hashlib.sha256()
    for path in paths:
        data = Path(ROOT, path).read_bytes()
        digest.update(f"{Path(path).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def tree_hash(extension: str) -> str | None:
    """:func:`source_hash` of ``extension``'s sources under :data:`ROOT`, or None when one of
    them is absent (an installed wheel without sources: nothing to compare with)."""
    sources = EXTENSIONS[extension]
    if not all(Path(ROOT, source).is_file() for source in sources):
        return None
    return source_hash(sources)


def stale_reason(extension: str, built: str | None, path=None) -> str | None:
    """Why the library of ``extension`` (at ``path``) that carries the hash ``built`` must not be
    used, or None: it matches its sources, or they are absent."""
    expected = tree_hash(extension)
    if expected is None or built == expected:
        return None
    where = f" ({path})" if path else ""
    carried = f"was built from sources with hash {built[:12]}" if built else "carries no source hash"
    return (f"{extension}{where} is stale: it {carried}, but {', '.join(EXTENSIONS[extension])} in "
            f"{ROOT} hash to {expected[:12]}; the pure-Python reference runs instead. "
            f"Rebuild it with {REBUILD}.")


def check(extension: str, built: str | None, path=None) -> str | None:
    """:func:`stale_reason`, warned as a :class:`StaleBuildWarning` when there is one."""
    reason = stale_reason(extension, built, path)
    if reason is not None:
        warnings.warn(reason, StaleBuildWarning, stacklevel=3)
    return reason

"""Load the compiled twin of the exact search (``_search.c``), building it on first use.

The C file is compiled with the machine's C compiler (``$CC``, else ``cc`` or ``gcc``) into a
per-user cache directory (``$XDG_CACHE_HOME/ms_memopt`` or ``~/.cache/ms_memopt``), named by
a hash of the source, so a fresh clone needs nothing done by hand and an edited source is
rebuilt. Without a compiler (or with ``MS_MEMOPT_PURE_PYTHON=1`` or ``MS_MEMOPT_NATIVE=0``,
the switches the package's other compiled paths honour) :func:`library` returns None and the
pure-Python search runs instead: same nodes, same answers, 10-20x fewer nodes per second.

Example:
    >>> lib = library()  # None when no compiler is available
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

__all__ = ["library", "unavailable_reason"]

_SOURCE = Path(__file__).with_name("_search.c")
_loaded: ctypes.CDLL | None = None
_reason: str | None = None  # why the library is not available (None: not tried yet or loaded)
_tried = False


def unavailable_reason() -> str | None:
    """Why :func:`library` returned None (e.g. "no C compiler found"), or None."""
    return _reason


def library() -> ctypes.CDLL | None:
    """The compiled search library, or None (the caller then uses the Python search)."""
    global _loaded, _reason, _tried
    if os.environ.get("MS_MEMOPT_PURE_PYTHON", "") not in ("", "0") or \
            os.environ.get("MS_MEMOPT_NATIVE", "1") == "0":
        _reason = "MS_MEMOPT_PURE_PYTHON or MS_MEMOPT_NATIVE=0 is set"  # the package's switches
        return None
    if _tried:
        return _loaded
    _tried = True
    try:
        path = _build()
        lib = ctypes.CDLL(str(path))
    except _NoCompiler as error:
        _reason = str(error)  # documented: the Python search runs, nothing to warn about
        return None
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        _reason = str(error) or type(error).__name__
        warnings.warn(f"planner: the compiled search could not be built, using the (slower) Python "
                      f"search: {_reason}", RuntimeWarning, stacklevel=2)
        return None
    function = lib.ms_memopt_search
    pointer = ctypes.c_void_p
    function.argtypes = [ctypes.c_int64] * 3 + [pointer] * 14 + [ctypes.c_int64, ctypes.c_double, pointer]
    function.restype = ctypes.c_int
    _loaded = lib
    return lib


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ms_memopt"


class _NoCompiler(RuntimeError):
    pass


def _compiler() -> str:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name.split()[0]):
            return name
    raise _NoCompiler("no C compiler found (tried $CC, cc, gcc, clang)")


def _build() -> Path:
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    target = _cache_dir() / f"planner_search_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = _compiler()
    # build beside the target and rename: concurrent first uses never see a half-written file
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        result = subprocess.run([*compiler.split(), "-O2", "-shared", "-fPIC", "-o", partial, str(_SOURCE)],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {_SOURCE.name}: {result.stderr.strip()[:500]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target

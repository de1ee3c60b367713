"""The compiled twin of the exact search (``_search.c``).

``setup.py`` builds it at install time into the package's one ctypes library,
``ms_memopt.native._lib`` (with the compaction copy and the AdamW pass), so a fresh clone's
``make`` builds it like the other compiled parts. Without it (no C compiler at install time,
or ``MS_MEMOPT_PURE_PYTHON=1`` or ``MS_MEMOPT_NATIVE=0``, the switches the package's other
compiled paths honour) :func:`library` returns None and the pure-Python search runs instead:
same nodes, same answers, 10-20x fewer nodes per second. So it does when the library is stale
(built from other C sources than the tree's, e.g. ``_search.c`` edited without rebuilding):
``ms_memopt.native`` refuses it with a warning naming the rebuild command, and
:func:`unavailable_reason` says so.

Example:
    >>> lib = library()  # None when no compiler is available
"""
from __future__ import annotations

import ctypes
import os

__all__ = ["library", "unavailable_reason"]

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
    from ms_memopt import native

    lib = native.library()
    if lib is None:
        _reason = native.unavailable_reason()   # not built, or stale (native warned)
        return None
    if not hasattr(lib, "ms_memopt_search"):
        _reason = "the compiled library (ms_memopt.native._lib, built by setup.py) has no search"
        return None
    function = lib.ms_memopt_search
    pointer = ctypes.c_void_p
    function.argtypes = [ctypes.c_int64] * 3 + [pointer] * 17 + [ctypes.c_int64, ctypes.c_double, pointer]
    function.restype = ctypes.c_int
    _loaded = lib
    return lib

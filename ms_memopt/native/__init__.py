"""Compiled helpers on host memory, loaded with ctypes (no Python C API, no MindSpore).

The C sources next to this file are built into one shared library by ``pip install``
(``setup.py``: extension ``ms_memopt.native._lib``). Each helper has a pure-Python/numpy
reference elsewhere in the package, used when the library is not built (an install without a
C compiler, or a source tree nobody installed); property tests hold the two to identical
results (tests/test_native.py).

* :func:`move_runs` — many memmoves in one call (compaction runs; ``move_runs.c``).
* :func:`adamw` — one AdamW pass (float32, or float16/bfloat16 with a float32 master)
  (``FusedAdamW`` on CPU; ``adamw.c``).

``available()`` says whether the library loaded; ``MS_MEMOPT_NATIVE=0`` in the environment
turns it off (the references run instead). A stale library, built from other C sources than the
tree's (a ``.c`` edited without rebuilding), is not used either: a
:class:`~ms_memopt.core._build_hash.StaleBuildWarning` names it and the rebuild command, and
``unavailable_reason()`` says why (``ms_memopt/core/_build_hash.py``).

Example:
    >>> import numpy as np
    >>> buf = np.arange(16, dtype=np.uint8)
    >>> if available():
    ...     _ = move_runs(buf.ctypes.data, np.array([8]), np.array([0]), np.array([8]))
    ... else:
    ...     buf[0:8] = buf[8:16]
    >>> buf[:8].tolist()
    [8, 9, 10, 11, 12, 13, 14, 15]
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path

import numpy as np

from ms_memopt.core import _build_hash
__all__ = ["available", "library", "unavailable_reason", "move_runs", "adamw", "adamw_reference", "round_bfloat16", "FLOAT32", "FLOAT16", "BFLOAT16", "STREAM_MIN_BYTES", "STREAM_TOTAL_BYTES"]

#: a run is copied with non-temporal stores when it is at least this long ...
STREAM_MIN_BYTES = 4096
#: ... and the whole call moves at least this much (more than a last-level cache's worth:
#: smaller compactions stay in cache, where ordinary stores are faster)
STREAM_TOTAL_BYTES = 64 << 20

_c_int64_p = ctypes.POINTER(ctypes.c_int64)
_c_float_p = ctypes.POINTER(ctypes.c_float)
_lib: ctypes.CDLL | None = None
_loaded = False
_reason: str | None = None   # why _lib is None once loading was tried
_EXTENSION = "ms_memopt.native._lib"


def _library_path() -> Path | None:
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_lib{suffix}"
        if candidate.exists():
            return candidate
    return None


def _source_hash(lib: ctypes.CDLL) -> str | None:
    """The hash of the C sources ``lib`` was built from (None: a build older than the hash)."""
    if not hasattr(lib, "ms_memopt_source_hash"):
        return None
    lib.ms_memopt_source_hash.restype = ctypes.c_char_p
    lib.ms_memopt_source_hash.argtypes = []
    return lib.ms_memopt_source_hash().decode()


def _load() -> ctypes.CDLL | None:
    global _lib, _loaded, _reason
    if _loaded:
        return _lib
    _loaded = True
    _lib = None
    path = _library_path()
    if os.environ.get("MS_MEMOPT_NATIVE", "1") == "0":
        _reason = "MS_MEMOPT_NATIVE=0 is set"
        return None
    if path is None:
        _reason = (f"the compiled library ({_EXTENSION}, built by setup.py) is not built "
                   "(pip install the package with a C compiler)")
        return None
    lib = ctypes.CDLL(str(path))
    _reason = _build_hash.check(_EXTENSION, _source_hash(lib), path)
    if _reason is not None:     # stale: built from other sources than the tree's
        return None
    lib.mm_move_runs.restype = ctypes.c_int64
    lib.mm_move_runs.argtypes = [ctypes.c_void_p, _c_int64_p, _c_int64_p, _c_int64_p,
                                 ctypes.c_int64, ctypes.c_int64]
    lib.mm_adamw.restype = None
    lib.mm_adamw.argtypes = [ctypes.c_int64] + [_c_int64_p] * 7 + [_c_float_p] * 2 + [ctypes.c_float] * 3
    _lib = lib
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled library (``None`` when it is not built, stale or ``MS_MEMOPT_NATIVE=0``); other
    modules bind their own functions of it (the planner's search: ``planner/_native.py``)."""
    return _load()


def available() -> bool:
    """Whether the compiled library is built, matches its sources and is enabled."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`library` returns None (not built, stale, ``MS_MEMOPT_NATIVE=0``), or None."""
    _load()
    return _reason


def _int64_pointer(array: np.ndarray):
    return array.ctypes.data_as(_c_int64_p)


def move_runs(base: int, src: np.ndarray, dst: np.ndarray, size: np.ndarray, *,
              stream: bool | None = None) -> int:
    """Move ``size[k]`` bytes from ``base + src[k]`` to ``base + dst[k]``, k in order, each
    with memmove semantics, in one call; returns the bytes moved.

    The caller checks the bounds (nothing is checked here). ``stream`` (default: when the
    total is at least :data:`STREAM_TOTAL_BYTES`) copies runs of at least
    :data:`STREAM_MIN_BYTES` that move down with non-temporal stores. Raises ``RuntimeError``
    when the library is not available.
    """
    lib = _load()
    if lib is None:
        raise RuntimeError(f"ms_memopt.native is unavailable: {_reason}")
    src = np.ascontiguousarray(src, dtype=np.int64)
    dst = np.ascontiguousarray(dst, dtype=np.int64)
    size = np.ascontiguousarray(size, dtype=np.int64)
    if not len(src) == len(dst) == len(size):
        raise ValueError("src, dst and size differ in length")
    if stream is None:
        stream = int(size.sum()) >= STREAM_TOTAL_BYTES
    return int(lib.mm_move_runs(ctypes.c_void_p(base), _int64_pointer(src), _int64_pointer(dst),
                                _int64_pointer(size), len(src), STREAM_MIN_BYTES if stream else 0))


#: ``kind`` codes of :func:`adamw`
FLOAT32, FLOAT16, BFLOAT16 = 0, 1, 2


def adamw(w, m, v, g, n, decay, step, beta1: float, beta2: float, eps: float, *,
          out=None, kind=None) -> None:
    """AdamW in place over pieces given by address: piece ``k`` is ``n[k]`` elements at ``w[k]``
    (float32 weights, or the float32 master of a 16-bit parameter), ``m[k]``, ``v[k]`` (float32
    moments) and ``g[k]`` (gradient, read only, in the parameter's dtype), with its own
    ``decay[k]`` (lr * weight decay) and ``step[k]`` (bias-corrected lr). Per element, in
    float32: ``w -= decay*w; m += (g-m)*(1-beta1); v += (g*g-v)*(1-beta2);
    w -= step*m / (sqrt(v) + eps)``. ``kind[k]`` (default all :data:`FLOAT32`) is
    :data:`FLOAT16` or :data:`BFLOAT16` for a 16-bit parameter: its gradient is widened on the
    fly and ``out[k]``, the parameter, is written once from the new ``w``, rounded to nearest
    even. One pass over memory, AVX2 for float32 pieces where the CPU has it.

    The caller guarantees the addresses (nothing is checked here). Raises ``RuntimeError`` when
    the library is not available.
    """
    lib = _load()
    if lib is None:
        raise RuntimeError(f"ms_memopt.native is unavailable: {_reason}")
    count = len(w)
    out = np.zeros(count, np.int64) if out is None else out
    kind = np.zeros(count, np.int64) if kind is None else kind
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (w, m, v, g, out, n, kind)]
    if any(len(a) != count for a in arrays) or len(decay) != count or len(step) != count:
        raise ValueError("every per-piece array needs one entry per piece")
    decay = np.ascontiguousarray(decay, dtype=np.float32)
    step = np.ascontiguousarray(step, dtype=np.float32)
    lib.mm_adamw(count, *(_int64_pointer(a) for a in arrays), decay.ctypes.data_as(_c_float_p),
                 step.ctypes.data_as(_c_float_p), beta1, beta2, eps)


def adamw_reference(w: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, decay: float,
                    step: float, beta1: float, beta2: float, eps: float) -> None:
    """:func:`adamw` on one float32 piece of numpy arrays, in numpy (the readable reference; same
    operations in the same order, so the same bits). For a 16-bit piece pass
    ``g.astype(np.float32)`` and round ``w`` afterwards (:func:`round_bfloat16` for bfloat16,
    ``astype(np.float16)`` for float16)."""
    f32 = np.float32
    g = np.asarray(g, dtype=f32)
    decay, step, c1, c2, eps = f32(decay), f32(step), f32(1) - f32(beta1), f32(1) - f32(beta2), f32(eps)
    w -= decay * w
    m += (g - m) * c1
    v += (g * g - v) * c2
    w -= step * m / (np.sqrt(v) + eps)


def round_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (``uint16``), rounded to nearest even; NaN stays NaN."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)

"""Compiled helpers on host memory, loaded with ctypes (no Python C API, no MindSpore).

The C sources next to this file are built into one shared library by ``pip install``
(``setup.py``: extension ``ms_memopt.native._lib``). Each helper has a pure-Python/numpy
reference elsewhere in the package, used when the library is not built (an install without a
C compiler, or a source tree nobody installed); property tests hold the two to identical
results (tests/test_native.py).

* :func:`move_runs` — many memmoves in one call (compaction runs; ``move_runs.c``).
* :func:`adamw_f32` — one AdamW pass over float32 buffers (``FusedAdamW`` on CPU; ``adamw.c``).

``available()`` says whether the library loaded; ``MS_MEMOPT_NATIVE=0`` in the environment
turns it off (the references run instead).

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

__all__ = ["available", "move_runs", "adamw_f32", "adamw_f32_reference", "STREAM_MIN_BYTES", "STREAM_TOTAL_BYTES"]

#: a run is copied with non-temporal stores when it is at least this long ...
STREAM_MIN_BYTES = 4096
#: ... and the whole call moves at least this much (more than a last-level cache's worth:
#: smaller compactions stay in cache, where ordinary stores are faster)
STREAM_TOTAL_BYTES = 64 << 20

_c_int64_p = ctypes.POINTER(ctypes.c_int64)
_c_float_p = ctypes.POINTER(ctypes.c_float)
_lib: ctypes.CDLL | None = None
_loaded = False


def _library_path() -> Path | None:
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_lib{suffix}"
        if candidate.exists():
            return candidate
    return None


def _load() -> ctypes.CDLL | None:
    global _lib, _loaded
    if _loaded:
        return _lib
    _loaded = True
    path = _library_path()
    if path is None or os.environ.get("MS_MEMOPT_NATIVE", "1") == "0":
        return None
    lib = ctypes.CDLL(str(path))
    lib.mm_move_runs.restype = ctypes.c_int64
    lib.mm_move_runs.argtypes = [ctypes.c_void_p, _c_int64_p, _c_int64_p, _c_int64_p,
                                 ctypes.c_int64, ctypes.c_int64]
    lib.mm_adamw_f32.restype = None
    lib.mm_adamw_f32.argtypes = [ctypes.c_int64] + [_c_int64_p] * 5 + [_c_float_p] * 2 + [ctypes.c_float] * 3
    _lib = lib
    return lib


def available() -> bool:
    """Whether the compiled library is built and enabled."""
    return _load() is not None


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
        raise RuntimeError("ms_memopt.native is not built (pip install the package with a C compiler)")
    src = np.ascontiguousarray(src, dtype=np.int64)
    dst = np.ascontiguousarray(dst, dtype=np.int64)
    size = np.ascontiguousarray(size, dtype=np.int64)
    if not len(src) == len(dst) == len(size):
        raise ValueError("src, dst and size differ in length")
    if stream is None:
        stream = int(size.sum()) >= STREAM_TOTAL_BYTES
    return int(lib.mm_move_runs(ctypes.c_void_p(base), _int64_pointer(src), _int64_pointer(dst),
                                _int64_pointer(size), len(src), STREAM_MIN_BYTES if stream else 0))


def adamw_f32(w: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, n: np.ndarray,
              decay: np.ndarray, step: np.ndarray, beta1: float, beta2: float, eps: float) -> None:
    """AdamW in place over float32 pieces given by address: piece ``k`` is ``n[k]`` elements at
    ``w[k]`` (weights), ``m[k]``, ``v[k]`` (moments) and ``g[k]`` (gradient, read only), with its
    own ``decay[k]`` (lr * weight decay) and ``step[k]`` (bias-corrected lr). Per element, in
    float32: ``w -= decay*w; m += (g-m)*(1-beta1); v += (g*g-v)*(1-beta2);
    w -= step*m / (sqrt(v) + eps)``. One pass over memory, AVX2 where the CPU has it.

    The caller guarantees the addresses (nothing is checked here). Raises ``RuntimeError`` when
    the library is not available.
    """
    lib = _load()
    if lib is None:
        raise RuntimeError("ms_memopt.native is not built (pip install the package with a C compiler)")
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (w, m, v, g, n)]
    count = len(arrays[0])
    if any(len(a) != count for a in arrays) or len(decay) != count or len(step) != count:
        raise ValueError("every per-piece array needs one entry per piece")
    decay = np.ascontiguousarray(decay, dtype=np.float32)
    step = np.ascontiguousarray(step, dtype=np.float32)
    lib.mm_adamw_f32(count, *(_int64_pointer(a) for a in arrays), decay.ctypes.data_as(_c_float_p),
                     step.ctypes.data_as(_c_float_p), beta1, beta2, eps)


def adamw_f32_reference(w: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, decay: float,
                        step: float, beta1: float, beta2: float, eps: float) -> None:
    """:func:`adamw_f32` on one piece of numpy float32 arrays, in numpy (the readable reference;
    same operations in the same order, so the same bits)."""
    f32 = np.float32
    decay, step, c1, c2, eps = f32(decay), f32(step), f32(1) - f32(beta1), f32(1) - f32(beta2), f32(eps)
    w -= decay * w
    m += (g - m) * c1
    v += (g * g - v) * c2
    w -= step * m / (np.sqrt(v) + eps)

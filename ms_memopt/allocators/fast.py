"""Compiled fast paths of allocator models: the same rules, millions of events per second.

The pure-Python models are the readable reference. For the models below, a C extension
(``_fastpool.c``, built by ``pip install`` with gcc and the Python headers, nothing else)
keeps the state and runs ``malloc``/``free`` without Python-level work per event;
:func:`ms_memopt.allocators.create` picks it when it is built, unless the environment sets
``MS_MEMOPT_PURE_PYTHON=1``. ``tests/test_fastpool.py`` holds each fast model to identical
addresses, counters and layouts as its reference on random traces and on every recorded trace.

==================== ================================ =========================================
name                 fast class                       reference
==================== ================================ =========================================
``mindspore``        :class:`FastMindSporePool`       :class:`~.mindspore.MindSporePool`
``mindspore-bestfit`` :class:`FastMindSporeBestFitPool` :class:`~.mindspore.MindSporeBestFitPool`
==================== ================================ =========================================

Example:
    >>> pool = FastMindSporePool(capacity=8 * 2**30)          # doctest: +SKIP
    >>> a = pool.malloc(1000); b = pool.malloc(3000)          # doctest: +SKIP
    >>> (a, b - a, pool.reserved)                             # doctest: +SKIP
    (4294967296, 1024, 1073741824)
"""
from __future__ import annotations

import os

from ..layout import Block, Layout, Segment
from .base import AllocatorModel
from .mindspore import check_options, initial_block, restore_pieces

__all__ = ["AVAILABLE", "FAST_MODELS", "FastMindSporePool", "FastMindSporeBestFitPool"]

try:
    from ._fastpool import MindSporePoolCore
except ImportError:          # not built (a source tree without ``pip install``): pure Python only
    MindSporePoolCore = None

#: whether the compiled fast path is built and allowed (``MS_MEMOPT_PURE_PYTHON`` unset)
AVAILABLE = MindSporePoolCore is not None and not os.environ.get("MS_MEMOPT_PURE_PYTHON")

#: model name -> fast class (what :func:`~ms_memopt.allocators.create` uses when AVAILABLE)
FAST_MODELS: dict[str, type] = {}

if MindSporePoolCore is not None:

    class FastMindSporePool(MindSporePoolCore, AllocatorModel):
        """:class:`~ms_memopt.allocators.mindspore.MindSporePool` in C; same arguments.

        ``malloc``, ``free``, ``empty_cache``, ``note_segment_alloc``, ``release_segment`` and
        ``largest_free`` are the C methods; the counters (``reserved``, ``allocated``,
        ``peak_*``, ``segment_allocs``) live in the C state.
        """

        name = "mindspore"
        default_tie = "address"

        def __init__(self, capacity: int | None = None, increase_size: int = 1 << 30, init_size: int = 0,
                     pregrow: bool = False, grow: str = "double", small_pool: bool = False,
                     tie: str | None = None) -> None:
            self.tie = tie = check_options(increase_size, grow, tie or self.default_tie)
            half = initial_block(capacity, init_size, pregrow)
            MindSporePoolCore.__init__(self, capacity, int(increase_size), grow == "add", bool(small_pool),
                                       tie == "idle_order")
            AllocatorModel.__init__(self, capacity)
            self.increase_size = int(increase_size)
            self.grow = grow
            self.small_pool = small_pool
            if half:
                self._pregrow(half)

        def restore(self, layout: Layout) -> None:
            """Start from ``layout`` (as the reference's :meth:`restore`)."""
            for segment in sorted(layout.segments, key=lambda s: s.addr):
                self._add_segment(segment.addr, segment.size, segment.stream, segment.pool == "persistent",
                                  segment.pool == "small", restore_pieces(segment))
            self._note_usage()

        def layout(self) -> Layout:
            segments = [Segment(addr, size, [Block(a, s, used) for a, s, used in blocks], stream=stream, pool=pool)
                        for addr, size, stream, pool, blocks in self._segments()]
            segments.sort(key=lambda s: s.addr)
            return Layout(segments, capacity=self.capacity)

    class FastMindSporeBestFitPool(FastMindSporePool):
        """:class:`~ms_memopt.allocators.mindspore.MindSporeBestFitPool` in C (idle-order ties)."""

        name = "mindspore-bestfit"
        default_tie = "idle_order"

    FAST_MODELS.update({"mindspore": FastMindSporePool, "mindspore-bestfit": FastMindSporeBestFitPool})

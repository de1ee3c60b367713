"""Compiled fast paths of allocator models: the same rules, millions of events per second.

The pure-Python models are the readable reference. For the models below, a C extension
(one C file per model in this folder, ``fastpool.h`` lists them, built as one module
``_fastpool`` by ``pip install`` with gcc and the Python headers, nothing else)
keeps the state and runs ``malloc``/``free`` without Python-level work per event;
:func:`ms_memopt.allocators.create` picks it when it is built, unless the environment sets
``MS_MEMOPT_PURE_PYTHON=1``. ``tests/test_fastpool.py`` holds each fast model to identical
addresses, counters and layouts as its reference on random traces and on every recorded trace.
A stale extension, built from other C sources than the tree's (any ``.c`` or ``.h`` here
edited without rebuilding), is not used: a :class:`~ms_memopt.core._build_hash.StaleBuildWarning` names it and the
rebuild command, and the pure-Python models run (``ms_memopt/core/_build_hash.py``).

Fast classes (reference in brackets):

* ``mindspore``: :class:`FastMindSporePool` (:class:`~.mindspore.MindSporePool`)
* ``mindspore-bestfit``: :class:`FastMindSporeBestFitPool` (:class:`~.mindspore.MindSporeBestFitPool`)
* ``mindspore-vmm``: :class:`FastMindSporeVMMPool` (:class:`~.mindspore_vmm.MindSporeVMMPool`)
* ``torch``: :class:`FastTorchCachingAllocator` (:class:`~.torch.TorchCachingAllocator`, every
  option)
* ``torch-expandable``: :class:`FastTorchExpandableAllocator`
  (:class:`~.torch_expandable.TorchExpandableAllocator`)
* ``torch-npu``, ``torch-npu-expandable``: :class:`FastTorchNpuCachingAllocator`,
  :class:`FastTorchNpuExpandableAllocator` (:mod:`~.torch_npu`'s models: the same C models as
  ``torch`` and ``torch-expandable`` with torch_npu's pad, page sizes and alignment)
* ``pool``: :class:`FastPoolModeAllocator` (:class:`~.pool.PoolModeAllocator`: its regions,
  routing, ``malloc``/``free`` with the cache's eviction, and the batch loop in C)

Example:
    >>> pool = FastMindSporePool(capacity=8 * 2**30)          # doctest: +SKIP
    >>> a = pool.malloc(1000); b = pool.malloc(3000)          # doctest: +SKIP
    >>> (a, b - a, pool.reserved)                             # doctest: +SKIP
    (4294967296, 1024, 1073741824)
"""
from __future__ import annotations

import os
from collections import OrderedDict

from ms_memopt.allocators.base import AllocatorModel
from ms_memopt.allocators.mindspore import check_options, initial_block, restore_pieces
from ms_memopt.allocators.mindspore_vmm import CHUNK, MindSporeVMMPool, ChunkSet, ranges_largest_free, ranges_layout
from ms_memopt.allocators.mindspore_vmm import restore_pieces as vmm_restore_pieces
from ms_memopt.allocators.pool import PoolModeAllocator
from ms_memopt.allocators.torch import (TorchCachingAllocator, check_divisions, is_small_segment, merged_blocks,
                                        serving_pool)
from ms_memopt.allocators.torch_npu import PAD as NPU_PAD
from ms_memopt.allocators.torch_expandable import page_size, range_size_for, restore_ranges
from ms_memopt.allocators.torch_npu import TorchNpuCachingAllocator, TorchNpuExpandableAllocator, npu_page_size
from ms_memopt.core import _build_hash
from ms_memopt.core.events import FIELDS, ROW_INDEX
from ms_memopt.core.layout import Block, Layout, Segment

__all__ = ["AVAILABLE", "FAST_MODELS", "batch_runner", "FastMindSporePool", "FastMindSporeBestFitPool", "FastTorchCachingAllocator"]


def _compiled_core():
    """The extension's ``ModelCore``, or None: not built (a source tree without ``pip
    install``), or stale (built from other C sources than the tree's; warned)."""
    try:
        from ms_memopt.allocators.fast import _fastpool
    except ImportError:
        return None
    stale = _build_hash.check("ms_memopt.allocators.fast._fastpool", getattr(_fastpool, "SOURCE_HASH", None),
                              getattr(_fastpool, "__file__", None))
    if stale:
        return None
    # the loop reads rows (plain tuples of Event's fields) at the positions Event defines
    _fastpool.set_row_layout(len(FIELDS), tuple(ROW_INDEX[name] for name in
                                                ("action", "id", "size", "addr", "stream", "pool", "tag")))
    return _fastpool.ModelCore


ModelCore = _compiled_core()

#: whether the compiled fast path is built and allowed (``MS_MEMOPT_PURE_PYTHON`` unset)
AVAILABLE = ModelCore is not None and not os.environ.get("MS_MEMOPT_PURE_PYTHON")

#: model name -> fast class (what :func:`~ms_memopt.allocators.create` uses when AVAILABLE and
#: the class ``supports`` the options)
FAST_MODELS: dict[str, type] = {}



def batch_runner(model: AllocatorModel):
    """The model's ``_run`` (a stretch of allocs and frees in one call, see ``_fastpool.c``'s
    ``Core_run``),
    or ``None``: not a compiled model, or one whose ``malloc``/``free`` a caller has wrapped on
    the instance (the wrapper must see every call)."""
    run = getattr(model, "_run", None)
    if run is None:
        return None
    patched = getattr(model, "__dict__", {})
    return None if "malloc" in patched or "free" in patched else run


_LIVE, _UNMAPPED = 1, 2      # buffer states of the compiled expandable model (0: free)

if ModelCore is not None:

    class FastMindSporePool(ModelCore, AllocatorModel):
        """:class:`~ms_memopt.allocators.mindspore.MindSporePool` in C; same arguments.

        ``malloc``, ``free``, ``empty_cache``, ``note_segment_alloc``, ``release_segment`` and
        ``largest_free`` are the C methods; the counters (``reserved``, ``allocated``,
        ``peak_*``, ``segment_allocs``, ``segment_frees``, ``slow_path_events``) live in the C
        state (the VMM model adds ``eager_frees``).
        """

        name = "mindspore"
        default_tie = "address"

        @staticmethod
        def supports(options: dict) -> bool:
            return True

        def __init__(self, capacity: int | None = None, increase_size: int = 1 << 30, init_size: int = 0,
                     pregrow: bool = False, grow: str = "double", small_pool: bool = False,
                     tie: str | None = None) -> None:
            self.tie = tie = check_options(increase_size, grow, tie or self.default_tie)
            half = initial_block(capacity, init_size, pregrow)
            ModelCore.__init__(self, capacity, int(increase_size), grow == "add", bool(small_pool),
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

    class FastTorchCachingAllocator(ModelCore, AllocatorModel):
        """:class:`~ms_memopt.allocators.torch.TorchCachingAllocator` in C, with every option."""

        name = "torch"
        core_kind = "torch"     # its C Model record (torch.c)
        reference = TorchCachingAllocator
        supports = FastMindSporePool.supports

        def __init__(self, capacity: int | None = None, max_split_size_mb: int | None = None,
                     roundup_power2_divisions: int | None = None,
                     garbage_collection_threshold: float | None = None) -> None:
            self._init_core(capacity, max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold)

        def _init_core(self, capacity: int | None, max_split_size_mb: int | None, divisions: int | None,
                       gc_threshold: float | None, **options) -> None:
            # the reference checks the options and derives what C takes
            checked = self.reference(None, max_split_size_mb, divisions, gc_threshold, **options)
            ModelCore.__init__(self, capacity, kind=self.core_kind, divisions=checked.divisions,
                               max_split=checked.max_split_size or 0, gc_threshold=checked.gc_threshold or 0.0,
                               **{self._CORE_OPTIONS.get(k, k): v for k, v in options.items()})
            AllocatorModel.__init__(self, capacity)
            self.max_split_size, self.gc_threshold = checked.max_split_size, checked.gc_threshold
            self.divisions = checked.divisions

        #: the reference's option -> ModelCore's keyword
        _CORE_OPTIONS = {"page_size_1g": "page_1g"}

        def restore(self, layout: Layout) -> None:
            """Start from ``layout`` (as the reference's :meth:`restore`)."""
            self._reset()
            for seg in sorted(layout.segments, key=lambda s: s.addr):
                self._add_segment(seg.addr, seg.size, seg.stream, False, is_small_segment(seg), merged_blocks(seg))
            self._note_usage()

        layout = FastMindSporePool.layout
        pad = 0
        serving_pool = serving_pool

    class FastTorchExpandableAllocator(ModelCore, AllocatorModel):
        """:class:`~ms_memopt.allocators.torch_expandable.TorchExpandableAllocator` in C."""

        name = "torch-expandable"
        virtual = True
        supports = FastMindSporePool.supports
        pad = 0
        serving_pool = serving_pool
        core_kind = "expandable"    # its C Model record (torch_expandable.c)

        def __init__(self, capacity: int | None = None, roundup_power2_divisions: int | None = None) -> None:
            self._init_core(capacity, roundup_power2_divisions)

        def _init_core(self, capacity: int | None, divisions: int | None, **core_options) -> None:
            check_divisions(divisions)
            ModelCore.__init__(self, capacity, kind=self.core_kind, divisions=divisions or 0, **core_options)
            AllocatorModel.__init__(self, capacity)
            self.divisions = divisions or 0

        def _page_size(self, small: bool) -> int:
            return page_size(small)

        def restore(self, layout: Layout) -> None:
            """Start from ``layout``: the ranges :func:`~.torch_expandable.restore_ranges` plans."""
            self._reset()
            for base, size, page, stream, small, fixed, pieces in restore_ranges(layout, self._page_size,
                                                                                 range_size_for(self.capacity)):
                self._add_range(base, size, stream, small, pieces, page, fixed)
            self._restored()
            self._note_usage()

        def layout(self) -> Layout:
            """Each run of mapped buffers of a range is one segment (as the reference)."""
            segments = []
            for _, stream, small, pieces in self._ranges():
                run: list[Block] = []
                for addr, size, state in pieces + [(0, 0, _UNMAPPED)]:
                    if state != _UNMAPPED:
                        run.append(Block(addr, size, state == _LIVE))
                    elif run:
                        segments.append(Segment(run[0].addr, run[-1].end - run[0].addr, run, stream=stream,
                                                pool="small" if small else "large"))
                        run = []
            return Layout(segments, capacity=self.capacity)

    class FastTorchNpuCachingAllocator(FastTorchCachingAllocator):
        """:class:`~ms_memopt.allocators.torch_npu.TorchNpuCachingAllocator` in C (torch.c with
        the 32-byte pad and ``page_size:1g``), with every option."""

        name = "torch-npu"
        core_kind = "torch_npu"     # torch_npu.c: torch.c's model with the 32-byte pad
        reference = TorchNpuCachingAllocator
        pad = NPU_PAD

        def __init__(self, capacity: int | None = None, max_split_size_mb: int | None = None,
                     roundup_power2_divisions: int | None = None,
                     garbage_collection_threshold: float | None = None, page_size_1g: bool = False) -> None:
            self.page_size_1g = page_size_1g
            self._init_core(capacity, max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold,
                            page_size_1g=page_size_1g)

    class FastTorchNpuExpandableAllocator(FastTorchExpandableAllocator):
        """:class:`~ms_memopt.allocators.torch_npu.TorchNpuExpandableAllocator` in C
        (torch_expandable.c with the pad, the large page and the 16 KiB alignment)."""

        name = "torch-npu-expandable"
        core_kind = "npu_expandable"    # torch_npu.c: torch_expandable.c's model with the pad
        pad = NPU_PAD

        def __init__(self, capacity: int | None = None, roundup_power2_divisions: int | None = None,
                     base_addr_aligned_kb: int = 16, segment_size_mb: int | None = None,
                     page_size_1g: bool = False) -> None:
            reference = TorchNpuExpandableAllocator(None, roundup_power2_divisions, base_addr_aligned_kb,
                                                    segment_size_mb, page_size_1g)
            self.align, self.large_page = reference.align, reference.large_page
            self.page_size_1g, self.segment_size_mb = page_size_1g, segment_size_mb
            self._init_core(capacity, roundup_power2_divisions, align=self.align, large_page=self.large_page or 0)

        def _page_size(self, small: bool) -> int:
            return npu_page_size(small, self.large_page)

    class FastMindSporeVMMPool(ModelCore, AllocatorModel):
        """:class:`~ms_memopt.allocators.mindspore_vmm.MindSporeVMMPool` in C; its layout and
        ``largest_free`` are the reference's functions over the C state."""

        name = "mindspore-vmm"
        virtual = True
        supports = FastMindSporePool.supports
        _record_oom = MindSporeVMMPool._record_oom

        def __init__(self, capacity: int | None = None) -> None:
            ModelCore.__init__(self, capacity, kind="vmm")
            AllocatorModel.__init__(self, capacity)

        def restore(self, layout: Layout) -> None:
            """Start from ``layout`` (as the reference's :meth:`restore`)."""
            for segment in sorted(layout.segments, key=lambda s: s.addr):
                if segment.addr % CHUNK:
                    raise ValueError(f"VMM segments start on 2 MiB boundaries; {segment.addr:#x} does not")
                size = (segment.size + CHUNK - 1) // CHUNK * CHUNK
                self._add_vrange(segment.addr, size, segment.stream, segment.pool == "persistent",
                                 vmm_restore_pieces(segment, size), segment.end)
            self._note_usage()

        def range_pieces(self) -> list:
            """As :meth:`MindSporeVMMPool.range_pieces`."""
            return sorted(self._vmm_state()[0], key=lambda r: (r[0], r[1]))

        def layout(self) -> Layout:
            ranges, runs = self._vmm_state()
            mapped = ChunkSet()
            for start, end in runs:
                mapped.add(start, end)
            return ranges_layout(sorted(ranges, key=lambda r: (r[0], r[1])), mapped, self.capacity)

        def largest_free(self) -> int:
            return ranges_largest_free(self.range_pieces(), self.capacity)

    class FastRegion(ModelCore):
        """A pool-mode region (:class:`~ms_memopt.allocators.pool._Region`) in C: ``take``,
        ``release``, ``open_chunk``, ``close_chunk``, ``largest_free``, ``size_of`` and the
        ``free_keys``/``allocated`` it reports are the C state's."""

        def __init__(self, name: str, addr: int, size: int, chunked: bool = False) -> None:
            ModelCore.__init__(self, None, kind="region")
            self._region_init(addr, size, chunked)
            self.name, self.addr, self.size, self.chunked = name, addr, size, chunked
            self.order: OrderedDict[int, int] = OrderedDict()   # evicting: live addr -> size, oldest first
            self.evicting = self.ring = False

        def segment(self) -> Segment:
            blocks = [Block(addr, size, used, tag=self.name)
                      for *_, pieces in self._segments() for addr, size, used in pieces]
            return Segment(self.addr, self.size, blocks, pool=self.name)

    class FastPoolModeAllocator(ModelCore, PoolModeAllocator):
        """:class:`~ms_memopt.allocators.pool.PoolModeAllocator` with compiled regions and a
        compiled ``malloc``/``free``/``_run``: all of pool mode's rules are C (``fast/pool.c``):
        routing (the reference's :meth:`region_for` over the route table handed to C once, at
        init; :meth:`region_for` here asks C), the regions' placement, the cache region's FIFO
        eviction, ``drain_evicted`` and the counters (``allocated``, ``peak_allocated``,
        ``evictions``); an address belongs to the region whose range holds it (the reference's
        ``_owner`` map, which the compiled model does not keep). Layouts, metrics and the
        dispatch of chunk marks to the rings are the reference's Python code reading the
        :class:`FastRegion` objects."""

        region_class = FastRegion
        # the reference's, not ModelCore's (which knows nothing of regions)
        largest_free = PoolModeAllocator.largest_free
        empty_cache = AllocatorModel.empty_cache
        note_segment_alloc = AllocatorModel.note_segment_alloc
        release_segment = AllocatorModel.release_segment

        def __init__(self, capacity: int | None = None, regions=None, route: dict[str, str] | None = None,
                     chunked: bool = False) -> None:
            ModelCore.__init__(self, capacity, kind="poolmode")
            PoolModeAllocator.__init__(self, capacity, regions, route, chunked)
            del self._owner, self._evicted, self._region_cache   # kept in C (see the class docstring)
            self._by_index = regions = tuple(self.regions.values())
            # the route table goes to C once: a later edit of self.route does not reroute
            self._pool_init(regions, tuple((1 if r.evicting else 0) | (2 if r.ring else 0) for r in regions),
                            tuple(self.regions), dict(self.route))

        def region_for(self, tag: str | None, pool: str | None) -> FastRegion | None:
            """The region serving a request (the reference's rule, answered by the C routing)."""
            index = self._route(tag, pool)
            return None if index < 0 else self._by_index[index]

    FAST_MODELS.update({"mindspore": FastMindSporePool, "mindspore-bestfit": FastMindSporeBestFitPool,
                        "mindspore-vmm": FastMindSporeVMMPool, "torch": FastTorchCachingAllocator,
                        "torch-expandable": FastTorchExpandableAllocator,
                        "torch-npu": FastTorchNpuCachingAllocator,
                        "torch-npu-expandable": FastTorchNpuExpandableAllocator,
                        "pool": FastPoolModeAllocator})

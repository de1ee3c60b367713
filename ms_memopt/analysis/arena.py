"""An arena: one contiguous buffer handing out handles, compactable in place.

Code keeps :class:`Handle` objects (offset, nbytes, dtype, shape) instead of raw addresses and
asks :meth:`Arena.view` for the data when it needs it. :meth:`Arena.compact` slides live blocks
toward offset 0 with the shared planner (:mod:`ms_memopt.analysis.compaction`), moves the bytes run by
run and rewrites the handles' offsets in the same pass — the analogue of CANN's
``aclUpdateDataBufferAddr``: the handle objects stay the same, only their ``offset`` changes.

Guarantees (tests/test_arena.py):

* every live handle reads the same bytes after a compaction;
* a pinned handle never moves;
* an exception in the middle of a compaction (from the backend or between runs) leaves every
  handle pointing at its correct bytes and the arena usable. Runs execute in planner order
  (memmove-safe: a run never overwrites bytes a later run still has to read), and before
  :meth:`Arena.compact` returns or raises, exactly the handles of the runs whose copy completed
  get their new offsets (*copy, then commit*). A run may overwrite its own source (a short
  slide), but its bytes are then complete at the destination, which is where its handles point
  after the commit. The backend's ``move`` must therefore either copy everything or raise
  before writing (true of ``memmove``/``np.copyto``).

Views are valid until the next compaction; call :meth:`Arena.view` again after it
(``arena.generation`` counts compactions).

Backends: :class:`NumpyBackend` (host memory, here); a MindSpore device-tensor backend lives
in :mod:`ms_memopt.mindspore.compaction` (the core never imports MindSpore).

Example:
    >>> arena = Arena(1024)
    >>> a = arena.alloc(256); b = arena.alloc(shape=(4,), dtype="float32")
    >>> arena.view(b)[:] = [1, 2, 3, 4]
    >>> arena.free(a)
    >>> report = arena.compact()
    >>> b.offset, arena.view(b).tolist(), report.bytes_moved
    (0, [1.0, 2.0, 3.0, 4.0], 64)
"""
from __future__ import annotations

import bisect
import ctypes
import gc
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from ms_memopt import native
from ms_memopt.analysis.compaction.planner import cheapest_window, run_bounds, slide_targets
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.core.metrics import frag_ratio

__all__ = ["Arena", "ArenaBackend", "ArenaCompactionReport", "ArenaFull", "Handle", "NumpyBackend"]


class ArenaFull(MemoryError):
    """No hole of the requested size (the arena may still have that much free in pieces)."""


class ArenaBackend(Protocol):
    """Where the arena's bytes live. ``move`` has memmove semantics (source and destination
    may overlap) and is all-or-nothing: it raises before writing or copies every byte."""

    capacity: int

    def move(self, src: int, dst: int, nbytes: int) -> None: ...

    def view(self, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> Any: ...

    def read(self, offset: int, nbytes: int) -> np.ndarray: ...


class NumpyBackend:
    """Host memory: one ``uint8`` numpy buffer. ``move`` is the C library's ``memmove`` on the
    buffer (bounds checked here): the same copy ``np.copyto`` does on overlapping slices, without
    building two array views per move (a few microseconds each, which adds up over the thousands
    of runs of a large compaction)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        # cache-line aligned (numpy gives 16 bytes): runs of a 64-aligned arena then start and
        # end on cache lines, which the streaming copy of move_runs writes whole
        raw = np.zeros(self.capacity + 64, dtype=np.uint8)
        start = -raw.ctypes.data % 64
        self.buffer = raw[start:start + self.capacity]
        self._base = self.buffer.ctypes.data

    def move(self, src: int, dst: int, nbytes: int) -> None:
        if src < 0 or dst < 0 or nbytes < 0 or src + nbytes > self.capacity or dst + nbytes > self.capacity:
            raise IndexError(f"move of {nbytes} bytes {src:#x} -> {dst:#x} leaves the arena")
        ctypes.memmove(self._base + dst, self._base + src, nbytes)

    def move_runs(self, src: np.ndarray, dst: np.ndarray, size: np.ndarray) -> bool:
        """Every run in one compiled call (:func:`ms_memopt.native.move_runs`: the same bytes
        as :meth:`move` run by run, large compactions streamed past the cache). Returns
        ``False``, having moved nothing, when that path is unavailable (library not built, or
        a subclass overrides :meth:`move`, whose per-run behaviour then stands); the caller
        then moves run by run. All or nothing: bounds are checked before the first byte."""
        if not native.available() or type(self).move is not NumpyBackend.move:
            return False
        if len(src) and (min(src.min(), dst.min(), size.min()) < 0
                         or max((src + size).max(), (dst + size).max()) > self.capacity):
            raise IndexError("a compaction run leaves the arena")
        native.move_runs(self._base, src, dst, size)
        return True

    def view(self, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        return self.buffer[offset:offset + nbytes].view(dtype).reshape(shape)

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buffer[offset:offset + nbytes].copy()


@dataclass(eq=False, slots=True)
class Handle:
    """A live allocation: ``nbytes`` at ``offset`` in the arena, viewed as ``dtype``/``shape``.

    ``offset`` changes when the arena compacts; everything else is fixed. ``span`` is the
    aligned size the arena reserved (``>= nbytes``).
    """

    id: int
    offset: int
    nbytes: int
    span: int
    dtype: np.dtype
    shape: tuple[int, ...]
    pinned: bool = False
    tag: str | None = None
    alive: bool = True


@dataclass(slots=True)
class ArenaCompactionReport:
    """What one :meth:`Arena.compact` did; sizes in bytes, time in seconds."""

    free_total: int
    largest_free_before: int
    largest_free_after: int
    frag_ratio_before: float | None
    frag_ratio_after: float | None
    bytes_moved: int
    moves: int
    runs: int
    seconds: float
    plan_seconds: float
    stopped_by: str | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


class Arena:
    """A compactable arena of ``capacity`` bytes.

    Args:
        capacity: bytes in the buffer.
        alignment: every allocation's span is rounded up to this many bytes (default 64), so
            views of any numpy dtype stay aligned after compaction.
        backend: where the bytes live (default :class:`NumpyBackend`).

    Free space is served first fit (lowest address), so fragmentation builds up as in a real
    pool when lifetimes interleave; :meth:`compact` undoes it.
    """

    def __init__(self, capacity: int, *, alignment: int = 64,
                 backend: ArenaBackend | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.backend = backend if backend is not None else NumpyBackend(capacity)
        self.capacity = int(capacity)
        self.alignment = alignment
        self.generation = 0
        self._handles: dict[int, Handle] = {}
        self._ids = itertools.count(1)
        self._hole_starts: list[int] = [0]
        self._hole_sizes: dict[int, int] = {0: self.capacity}
        #: called with (run index, runs) after each run's commit; tests inject failures here.
        self.after_run: Callable[[int, int], None] | None = None

    # --- allocation -------------------------------------------------------------------------
    def alloc(self, nbytes: int | None = None, *, shape: tuple[int, ...] | int | None = None,
              dtype: Any = np.uint8, pinned: bool = False, tag: str | None = None) -> Handle:
        """Reserve ``nbytes`` (or ``prod(shape) * itemsize``) and return its handle.

        Raises :class:`ArenaFull` when no hole is large enough.
        """
        dtype = np.dtype(dtype)
        if shape is not None:
            shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
            needed = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if nbytes is None:
                nbytes = needed
            elif nbytes != needed:
                raise ValueError(f"nbytes={nbytes} does not match shape {shape} of {dtype} ({needed})")
        if nbytes is None or nbytes < 0:
            raise ValueError("give nbytes or shape")
        if shape is None:
            if nbytes % dtype.itemsize:
                raise ValueError(f"{nbytes} bytes is not a whole number of {dtype}")
            shape = (nbytes // dtype.itemsize,)
        span = max(-(-nbytes // self.alignment) * self.alignment, self.alignment)
        for start in self._hole_starts:
            size = self._hole_sizes[start]
            if size >= span:
                self._take(start, size, span)
                handle = Handle(next(self._ids), start, int(nbytes), span, dtype, shape, pinned, tag)
                self._handles[handle.id] = handle
                return handle
        raise ArenaFull(f"no hole of {span} bytes (free {self.free_total}, largest {self.largest_free})")

    def free(self, handle: Handle) -> None:
        """Give the handle's bytes back; the handle must not be used afterwards."""
        if self._handles.pop(handle.id, None) is not handle:
            raise KeyError(f"handle {handle.id} is not live in this arena")
        handle.alive = False
        self._give(handle.offset, handle.span)

    def view(self, handle: Handle) -> Any:
        """The handle's data (a numpy array on the host backend), valid until the next compaction."""
        if not handle.alive:
            raise KeyError(f"handle {handle.id} was freed")
        return self.backend.view(handle.offset, handle.nbytes, handle.dtype, handle.shape)

    def read(self, handle: Handle) -> np.ndarray:
        """A host copy of the handle's bytes (``uint8``), e.g. for checksums."""
        return self.backend.read(handle.offset, handle.nbytes)

    def pin(self, handle: Handle, pinned: bool = True) -> None:
        """Mark a handle as in use by a pending stream or collective: compaction leaves it alone."""
        handle.pinned = pinned

    def handles(self) -> list[Handle]:
        """Live handles, by offset."""
        return sorted(self._handles.values(), key=lambda h: h.offset)

    # --- state ------------------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        """Bytes reserved by live handles (aligned spans)."""
        return self.capacity - self.free_total

    @property
    def free_total(self) -> int:
        return sum(self._hole_sizes.values())

    @property
    def largest_free(self) -> int:
        return max(self._hole_sizes.values(), default=0)

    def frag_ratio(self) -> float | None:
        return frag_ratio(self.free_total, self.largest_free)

    def layout(self) -> Layout:
        """The arena as one segment (pool ``"arena"``) for scans and the planner."""
        blocks = [Block(h.offset, h.span, True, id=h.id, tag=h.tag, pinned=h.pinned)
                  for h in self._handles.values()]
        blocks += [Block(start, self._hole_sizes[start], False) for start in self._hole_starts]
        blocks.sort(key=lambda b: b.addr)
        return Layout([Segment(0, self.capacity, blocks, pool="arena")], capacity=self.capacity)

    # --- compaction -------------------------------------------------------------------------
    def compact(self, *, max_bytes: int | None = None,
                target_largest_free: int | None = None) -> ArenaCompactionReport:
        """Slide live handles toward offset 0 (pinned ones stay) and update them in one pass.

        ``max_bytes`` bounds the bytes moved; ``target_largest_free`` moves only the cheapest
        range of handles that opens one hole of that size (as the planner does). Views taken before are stale afterwards. Python's garbage collector is
        paused meanwhile: a collection over thousands of handles would cost as much as copying
        tens of megabytes.
        """
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._compact(max_bytes, target_largest_free)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _compact(self, max_bytes: int | None, target_largest_free: int | None) -> ArenaCompactionReport:
        t0 = time.perf_counter()
        free_total = self.free_total
        largest_before = self.largest_free
        unordered = list(self._handles.values())
        n = len(unordered)
        offsets = np.fromiter([h.offset for h in unordered], dtype=np.int64, count=n)
        order = np.argsort(offsets, kind="stable")
        handles = [unordered[i] for i in order.tolist()]
        addrs = offsets[order]
        spans = np.fromiter([h.span for h in handles], dtype=np.int64, count=n)
        pinned = np.fromiter([h.pinned for h in handles], dtype=bool, count=n)
        stopped_by = None
        targets = None
        if target_largest_free is not None:
            if largest_before >= target_largest_free:
                targets = addrs
            else:
                found = cheapest_window(addrs, spans, pinned, 0, self.capacity, target_largest_free)
                if found is not None and (max_bytes is None or found[1] <= max_bytes):
                    targets, stopped_by = found[0], "target_largest_free"
        if targets is None:
            targets, stopped_by = slide_targets(addrs, spans, pinned, 0, self.capacity, max_bytes=max_bytes)
        moving = np.flatnonzero(targets != addrs)
        src, dst, size = addrs[moving], targets[moving], spans[moving]
        starts, stops = run_bounds(src, dst, size)
        run_src_array = src[starts]
        run_dst_array = dst[starts]
        run_size_array = src[stops - 1] + size[stops - 1] - run_src_array
        moved_handles = [handles[i] for i in moving.tolist()]
        new_offsets = dst.tolist()
        run_stops = stops.tolist()
        if len(moving) and (dst.min() < 0 or int((dst + size).max()) > self.capacity):
            raise AssertionError("compaction plan leaves the arena")  # pragma: no cover
        t1 = time.perf_counter()
        done = 0   # runs whose copy completed
        try:
            hook = self.after_run
            move_runs = getattr(self.backend, "move_runs", None)
            # one compiled call when nobody watches between runs (it cannot stop half way)
            if hook is None and move_runs is not None and move_runs(run_src_array, run_dst_array, run_size_array):
                done = len(run_stops)
            else:
                move = self.backend.move
                run_src, run_dst, run_size = run_src_array.tolist(), run_dst_array.tolist(), run_size_array.tolist()
                for index in range(len(run_stops)):
                    move(run_src[index], run_dst[index], run_size[index])
                    done = index + 1
                    if hook is not None:
                        hook(index, len(run_stops))
        finally:
            # commit, before anyone sees the handles: exactly the runs whose bytes are complete
            # at their destination get their new offsets
            committed = run_stops[done - 1] if done else 0
            for k in range(committed):
                moved_handles[k].offset = new_offsets[k]
            self.generation += 1
            if done == len(run_stops):
                self._set_holes(targets, spans)
            else:
                self._rebuild_holes()
        bytes_moved = int(run_size_array.sum())
        t2 = time.perf_counter()
        return ArenaCompactionReport(
            free_total=free_total, largest_free_before=largest_before,
            largest_free_after=self.largest_free,
            frag_ratio_before=frag_ratio(free_total, largest_before),
            frag_ratio_after=self.frag_ratio(), bytes_moved=bytes_moved, moves=len(moving),
            runs=len(run_stops), seconds=t2 - t0, plan_seconds=t1 - t0, stopped_by=stopped_by)

    # --- free-space bookkeeping ---------------------------------------------------------------
    def _take(self, start: int, size: int, span: int) -> None:
        index = bisect.bisect_left(self._hole_starts, start)
        del self._hole_starts[index]
        del self._hole_sizes[start]
        if size > span:
            self._hole_starts.insert(index, start + span)
            self._hole_sizes[start + span] = size - span

    def _give(self, start: int, span: int) -> None:
        index = bisect.bisect_left(self._hole_starts, start)
        end = start + span
        if index < len(self._hole_starts) and self._hole_starts[index] == end:
            span += self._hole_sizes.pop(end)
            del self._hole_starts[index]
        if index > 0:
            before = self._hole_starts[index - 1]
            if before + self._hole_sizes[before] == start:
                self._hole_sizes[before] += span
                return
        self._hole_starts.insert(index, start)
        self._hole_sizes[start] = span

    def _rebuild_holes(self) -> None:
        """Free space = the complement of the live spans (after a failed compaction)."""
        n = len(self._handles)
        starts = np.fromiter((h.offset for h in self._handles.values()), dtype=np.int64, count=n)
        spans = np.fromiter((h.span for h in self._handles.values()), dtype=np.int64, count=n)
        order = np.argsort(starts, kind="stable")
        self._set_holes(starts[order], spans[order])

    def _set_holes(self, starts: np.ndarray, spans: np.ndarray) -> None:
        """Free space = the complement of live spans given sorted by start."""
        n = len(starts)
        ends = starts + spans
        gap_starts = np.concatenate(([0], ends))
        gap_ends = np.concatenate((starts, [self.capacity]))
        if n and (np.any(gap_ends[1:-1] < gap_starts[1:-1]) or gap_starts[-1] > self.capacity):
            raise AssertionError("live handles overlap after compaction")
        keep = gap_ends > gap_starts
        self._hole_starts = gap_starts[keep].tolist()
        self._hole_sizes = dict(zip(self._hole_starts, (gap_ends[keep] - gap_starts[keep]).tolist()))

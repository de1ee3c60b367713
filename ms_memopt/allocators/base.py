"""What every allocator model is: the interface the replay engine, simulator and scans drive.

A model owns a simulated address space. ``malloc`` returns the address it chose, or ``None``
after recording an :class:`OOMRecord` when the request cannot be served within ``capacity``
(models never raise on OOM: the caller decides what a failed request means). ``layout()``
exports the current state as a :class:`~ms_memopt.core.layout.Layout` for the metrics.

Subclasses keep ``reserved`` and ``allocated`` current (bytes) and call :meth:`_note_usage`
after every change so peaks are tracked.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import ClassVar

from ms_memopt.core.layout import Layout
from ms_memopt.core.metrics import LayoutMetrics, measure, pool_largest_free

__all__ = ["AllocatorModel", "OOMRecord", "oom_kind"]


def oom_kind(size: int, free_total: int, device_free: int | None = None, held_elsewhere: int | None = None) -> str:
    """What kind of OOM a failed request of ``size`` bytes is: ``"fragmentation"`` or ``"capacity"``
    (or ``"outside"``, only when ``held_elsewhere`` is given).

    The one rule every OOM label comes from (:attr:`OOMRecord.kind`, the simulator's
    ``oom_kind``): ``"fragmentation"`` when ``size <= free_total + device_free``, else
    ``"capacity"``. ``free_total`` is the reserved bytes no live tensor holds and
    ``device_free`` the device memory the pool has not reserved yet (``None``: unknown or
    unbounded, counted as 0); see docs/metrics.md.

    Why both: an OOM is a request the model cannot serve without exceeding the configured
    capacity, and the memory still free under that capacity is ``free_total + device_free``.
    When that covers the request, it would have been served had the free memory been one
    contiguous piece: what failed it is how the free memory is split (every hole in the pool
    too small, and the unreserved rest too small for a new block), i.e. fragmentation, which
    compaction or pool mode can fix. When it does not, no placement could have served it: the
    demand exceeds the card (capacity). Counting only ``free_total`` would call a request
    that fits in the holes plus the unreserved memory a capacity problem, which it is not.

    Example: a 6 GiB card with 2 GiB of holes inside the pool and 2 GiB not reserved yet;
    3 GiB fit in the 4 GiB free, not in one piece:

        >>> GiB = 2**30
        >>> oom_kind(3 * GiB, free_total=2 * GiB, device_free=2 * GiB)
        'fragmentation'
        >>> oom_kind(5 * GiB, free_total=2 * GiB, device_free=2 * GiB)
        'capacity'
        >>> oom_kind(4 * GiB, free_total=2 * GiB, device_free=2 * GiB)  # exactly all that is free
        'fragmentation'

    ``held_elsewhere``: device memory neither this pool nor its free device memory could use
    (other processes, a memory fraction or ``max_device_memory`` withholding it), as a crash log
    prints it. A request beyond ``free_total + device_free`` that the card would have held
    without that memory is ``"outside"`` the allocator: the card had the room, something else
    kept it. Without the argument the answer is one of the two kinds above, as before.

        >>> oom_kind(5 * GiB, free_total=2 * GiB, device_free=2 * GiB, held_elsewhere=3 * GiB)
        'outside'
        >>> oom_kind(8 * GiB, free_total=2 * GiB, device_free=2 * GiB, held_elsewhere=3 * GiB)
        'capacity'
    """
    free = free_total + (device_free or 0)
    if size <= free:
        return "fragmentation"
    if held_elsewhere and size <= free + held_elsewhere:
        return "outside"
    return "capacity"


@dataclass(slots=True)
class OOMRecord:
    """A request the model could not serve; sizes in bytes, measured at the moment of failure.

    ``kind`` is ``"fragmentation"`` when ``size <= free_total + device_free`` (enough memory
    in total, but not in one piece), else ``"capacity"``: :func:`oom_kind`. Under a capacity the
    free memory counted is at most ``capacity - allocated``: a pool restored from a recording
    can start above the card, and what it holds beyond the card is not the card's to give.

    ``pool``: the pool inside the model that serves a request of this size on this stream
    (``"small"``/``"large"`` in PyTorch's and torch_npu's allocators, a pool-mode region; ``None``
    when any of the model's pools may serve it); ``pool_largest_free``: the largest hole there,
    the one piece that could have held the request (``largest_free`` is over every pool).
    """

    size: int
    stream: int
    free_total: int
    largest_free: int
    reserved: int
    allocated: int
    capacity: int | None
    device_free: int | None = None
    tag: str | None = None
    event_index: int | None = None
    pool: str | None = None
    pool_largest_free: int | None = None

    @property
    def usable_free(self) -> int:
        """Free memory inside the pool that the card could give, bytes: ``free_total`` capped at
        ``capacity - allocated`` (they differ only when the pool holds more than the card)."""
        if self.capacity is None:
            return self.free_total
        return max(0, min(self.free_total, self.capacity - self.allocated))

    @property
    def kind(self) -> str:
        return oom_kind(self.size, self.usable_free, self.device_free)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["kind"] = self.kind
        return out


class AllocatorModel(ABC):
    """Base class of the allocator models (see :mod:`ms_memopt.allocators`).

    Args:
        capacity: device memory the pool may reserve in total, in bytes (``None``: unbounded).
    """

    name: ClassVar[str] = "abstract"
    #: True when free ranges are contiguous in *virtual* space across physical chunks.
    virtual: ClassVar[bool] = False
    #: True when each stream has pools of its own (PyTorch, MindSpore); pool mode's regions serve all
    pools_per_stream: ClassVar[bool] = True
    #: failed requests recorded in full, each building and measuring the layout (``free_total``,
    #: ``largest_free``, the serving pool's largest hole); ``None``: every one, else at least 1.
    #: Past it a failure is only counted (:attr:`ooms_counted`), and the compiled loop goes on past
    #: it without a hook: on a card far too small a replay fails at most of its requests, and a
    #: record at each took doctor minutes (it reads the first failure and the count)
    full_oom_records: int | None = None

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self.segment_allocs = 0
        #: requests that took the allocator's slow path: a request that did not fit on the
        #: first try and went through the retry path, whether or not the retry succeeded.
        #: PyTorch: cached memory released and the device asked again (``num_alloc_retries``),
        #: counted by the caching-allocator models (pure-Python and compiled), not the expandable ones. MindSpore (every MindSpore model,
        #: pure-Python and compiled): the sync-and-retry of ``AbstractDynamicMemPool::AllocMemBuf``
        #: (``DoSyncAllEvents``; with VMM first ``SyncAllStreams`` + ``FreeIdleMemsByEagerFree``),
        #: see :mod:`~ms_memopt.allocators.mindspore`. A surviving setting can still pay for
        #: fragmentation in time (``slow_path_seconds``).
        self.slow_path_events = 0
        #: idle blocks given back to the device (``MemBufAllocator::ReleaseFreeBlocks``: the
        #: MindSpore pools' ``empty_cache()`` and recorded ``segment_free`` events), one per
        #: block; priced at ``device_free_seconds``. Counted by the non-VMM MindSpore models
        #: (pure-Python and compiled); the VMM model gives memory back as 2 MiB chunk unmaps
        #: (counted through ``reserved``) and the PyTorch models report 0.
        self.segment_frees = 0
        self.ooms: list[OOMRecord] = []
        #: failed requests past :attr:`full_oom_records`, counted without a record
        self.ooms_counted = 0

    # --- requests -----------------------------------------------------------------------
    @abstractmethod
    def malloc(self, size: int, *, stream: int = 0, pool: str | None = None,
               tag: str | None = None) -> int | None:
        """Serve ``size`` bytes; return the block's address, or ``None`` (and record an OOM)."""

    @abstractmethod
    def free(self, addr: int) -> None:
        """Free the live block at ``addr`` (its memory is reusable right away)."""

    def empty_cache(self) -> None:
        """Return idle whole segments to the device (``empty_cache()``); default: nothing."""

    # --- recorded context (replay of real traces) -----------------------------------------
    def note_segment_alloc(self, addr: int, size: int, stream: int = 0) -> None:
        """The recording saw a new segment at ``addr``; models may place their next segment there."""

    def release_segment(self, addr: int, size: int, stream: int = 0) -> None:
        """The recording released the segment at ``addr``; models release it if it is idle."""

    def note_segment_map(self, addr: int, size: int, stream: int = 0) -> None:
        """The recording mapped pages ``[addr, addr + size)`` into a virtual range it reserved
        (an expandable segment's ``segment_map``); models with such ranges may start the next
        range there. Default: nothing."""

    def unmap_range(self, addr: int, size: int, stream: int = 0) -> None:
        """The recording unmapped ``[addr, addr + size)`` (``segment_unmap``); models with
        virtual ranges unmap their idle pages there. Default: nothing."""

    def note_mark(self, tag: str | None, size: int = 0) -> None:
        """A named moment inside a step (``forward:3``, ``optimizer_end``; ``size`` in bytes
        when the moment announces an amount, e.g. what a micro-batch's forward will keep);
        models that place by phase (pool mode's activation chunks) use it; default: nothing."""

    def restore(self, layout: Layout) -> None:
        """Start from a recorded state (segments and live blocks at their addresses)."""
        raise NotImplementedError(f"the {self.name} model cannot start from a recorded state")

    # --- state ----------------------------------------------------------------------------
    @abstractmethod
    def layout(self) -> Layout:
        """The current segments and blocks."""

    def metrics(self) -> LayoutMetrics:
        """:func:`~ms_memopt.core.metrics.measure` of the current layout."""
        return measure(self.layout())

    def largest_free(self) -> int:
        """The largest hole a request could get without growing the pool, in bytes."""
        return self.metrics().largest_free

    # --- helpers for subclasses -------------------------------------------------------------
    def _note_usage(self) -> None:
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated

    def serving_pool(self, size: int, stream: int = 0, tag: str | None = None) -> str | None:
        """The pool (a :attr:`Segment.pool` name) that alone serves a request of ``size`` bytes on
        ``stream``; ``None`` (the default) when any of the model's pools may serve it."""
        return None

    def _record_oom(self, size: int, stream: int, tag: str | None) -> None:
        """Record a failed request, with the pool that serves it (:meth:`serving_pool`) and the
        largest hole there, the piece that was too small (the compiled twins call this too)."""
        if self._counted_oom(size, stream, tag):
            return
        pool = self.serving_pool(size, stream, tag)
        layout = self.layout()
        m = measure(layout)
        device_free = None if self.capacity is None else max(self.capacity - self.reserved, 0)
        self.ooms.append(OOMRecord(size=size, stream=stream, free_total=m.free_total,
                                   largest_free=m.largest_free, reserved=m.reserved,
                                   allocated=m.allocated, capacity=self.capacity,
                                   device_free=device_free, tag=tag, pool=pool,
                                   pool_largest_free=None if pool is None else pool_largest_free(
                                       layout, pool, stream if self.pools_per_stream else None)))

    def _counted_oom(self, size: int, stream: int, tag: str | None) -> bool:
        """Count a failed request when :attr:`full_oom_records` are made already (True), else
        nothing (False: the caller records it in full)."""
        if self.full_oom_records is None or len(self.ooms) < self.full_oom_records:
            return False
        self.ooms_counted += 1
        return True

    @property
    def oom_count(self) -> int:
        """Failed requests so far: those recorded in :attr:`ooms` and those only counted."""
        return len(self.ooms) + self.ooms_counted

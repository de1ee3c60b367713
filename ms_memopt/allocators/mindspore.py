"""MindSpore's dynamic device-memory pool (``AbstractDynamicMemPool``), VMM off.

Rules, as read in MindSpore's source (``runtime/memory/mem_pool/abstract_dynamic_mem_pool.cc``
and ``.h``, ``plugin/ascend/.../abstract_ascend_memory_pool_support.cc``, 2.4-2.6 era; the
names below are MindSpore's):

* **Alignment**: every request is rounded up to a multiple of 512 B (``AlignMemorySize``,
  ``kDynamicMemAlignSize``); a 0-byte request takes 512 B.
* **Allocators**: one ``MemBufAllocator`` per ``(stream, persistent?, small?)``
  (``AllocatorInfo``). ``pool="persistent"`` selects the persistent allocator (weights,
  optimizer states), anything else the common one. The small pool (requests <= 1 MiB from
  the common side) exists only with ``MS_ALLOC_CONF=enable_small_pool:True``: option
  ``small_pool`` (default off, as in MindSpore).
* **Best fit**: free buffers of an allocator are ordered by ``(size, address)``
  (``MemBufComparator``); a request takes the first one >= its size (``lower_bound``), i.e.
  the smallest, lowest address on ties. The older ``DynamicMemPoolBestFit`` (the CPU pool,
  and Ascend's with ``MS_ALLOC_CONF=older_pool:True``) keeps them in a ``std::multimap``
  keyed by size alone: among equal sizes the buffer that became idle *first* wins (option
  ``tie="idle_order"``; :class:`MindSporeBestFitPool`).
* **Split**: when the remainder is >= 512 B the buffer is split; the request takes the low
  part (``MapAndSplitMemBuf``). A remainder below 512 B cannot occur after alignment.
* **Merge**: a freed buffer merges with idle neighbours in the same pool block (segment);
  blocks never merge with each other, even when the device placed them back to back.
* **Growth** (``CalMemBlockAllocSize`` of the Ascend pool): a new block is one unit
  (``increase_size``, 1 GiB by default, ``set_memory(increase_size=)``) doubled until the
  request fits (in graph-sink mode it grows by adding units instead: option
  ``grow="add"``), then capped at the free device memory; when free device memory is below
  the request the block cannot be made. An allocator with no block yet grows on its first
  request.
* **On failure** (``AbstractDynamicMemPool::AllocMemBuf``):
  - common request: own free buffers -> grow a new block -> borrow a free buffer of the
    persistent allocator (same stream) -> OOM;
  - persistent request: own free buffers (growing if the allocator has no block yet) ->
    the common allocator's free buffers -> grow a new block *of the common allocator*
    (MindSpore reassigns the allocator before expanding) -> OOM.
  Event syncs (``DoSyncAllEvents``) are not modelled: frees in a trace take effect at once.
* **The slow path** (``slow_path_events``; MindSpore 2.10,
  ``mindspore/ccsrc/runtime/memory/mem_pool/abstract_dynamic_mem_pool.cc``,
  ``AbstractDynamicMemPool::AllocMemBuf``; the older pool's ``DynamicMemPoolBestFit::AllocTensorMem``
  in ``mem_dynamic_allocator.cc`` does the same with ``SyncAllEventsInner``): without VMM or
  eager free a first failure does *not* sync anything: it borrows and grows. Only when the
  borrows and the new block have all failed does MindSpore log "Alloc tensor mem failed and
  try to sync all events to release memory", run ``DoSyncAllEvents`` (wait for every event
  still holding a freed buffer, free those buffers) and retry ``allocator->Malloc`` once;
  failing that the request fails. That request is one slow-path event, whether or not its
  retry succeeds. Here frees take effect at once, so nothing waits on an event and the retry
  finds nothing new: every slow-path event of this model ends in an OOM.
* **Idle blocks are kept**: memory returns to the device only through ``empty_cache()``
  (``AbstractDynamicMemPool::ReleaseFreeBlocks`` -> ``MemBufAllocator::ReleaseFreeBlocks``:
  every block that is one whole idle buffer goes back through ``mem_block_cleaner_`` ->
  ``FreeDeviceMem``) or a recorded ``segment_free`` — never on its own, not even on the
  failure path above. Each block given back counts one ``segment_frees``.
* **set_memory(init_size=...)** (``Initialize``): ``init_size`` is split in half: the
  persistent and the common allocator of stream 0 each start with one block of
  ``init_size / 2`` (512-aligned). ``pregrow=True`` means ``init_size = capacity`` — which in
  MindSpore gives *two* half-capacity blocks, not one.

Data structures (what makes it fast): each allocator keeps its free buffers as one sorted
Python list of integer keys ``size << 64 | tie`` searched with :func:`bisect.bisect_left`
(best fit is one bisect, one pop); ``tie`` is the address (``tie="address"``) or the
buffer's turn in the order buffers became idle (``tie="idle_order"``); buffers are small
lists ``[addr, size, used, prev, next, segment, tie]`` doubly linked inside their block and
found by address in one dict (by ``tie`` in a second dict for ``idle_order``), so a free and
its merges are O(1) apart from the sorted-list insert/remove (memmove, fast for the
thousands of free buffers real pools hold).

Example:
    >>> pool = MindSporePool(capacity=8 * 2**30, increase_size=2**30)
    >>> a = pool.malloc(1000); b = pool.malloc(3000)
    >>> (a, b - a, pool.reserved)
    (4294967296, 1024, 1073741824)
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque

from ms_memopt.allocators.base import AllocatorModel
from ms_memopt.core.errors import InputError
from ms_memopt.core.layout import Block, Layout, Segment

__all__ = ["MindSporePool", "MindSporeBestFitPool", "ALIGN", "SMALL_SIZE", "TIE_RULES", "align_size"]

ALIGN = 512                 # kDynamicMemAlignSize
SMALL_SIZE = 1 << 20        # kSmallSize: largest request of the (opt-in) small pool
_SHIFT = 64
_MASK = (1 << _SHIFT) - 1
_BASE_ADDR = 1 << 32        # where simulated device addresses start
_SEG_ALIGN = 2 << 20        # device blocks start on 2 MiB boundaries
#: how equal-size free buffers are ordered: by address (``AbstractDynamicMemPool``'s
#: ``MemBufComparator``) or by when they became idle (``DynamicMemPoolBestFit``'s multimap)
TIE_RULES = ("address", "idle_order")

# buffer fields (a list per buffer: cheaper than objects in the hot loop)
_ADDR, _SIZE, _USED, _PREV, _NEXT, _SEG, _TIE = range(7)


def align_size(size: int) -> int:
    """MindSpore's ``AlignMemorySize``: round up to 512 B, at least 512 B.

    Example:
        >>> align_size(0), align_size(1), align_size(513)
        (512, 512, 1024)
    """
    if size <= 0:
        return ALIGN
    return (size + ALIGN - 1) & ~(ALIGN - 1)


class _Segment:
    """One pool block (``MemBlock``): its range and its first buffer."""

    __slots__ = ("addr", "size", "stream", "pool", "head", "owner")

    def __init__(self, addr: int, size: int, stream: int, pool: str, owner: "_Allocator") -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.pool = pool
        self.head: list | None = None
        self.owner = owner


class _Allocator:
    """One ``MemBufAllocator``: its blocks and its free buffers sorted by (size, addr)."""

    __slots__ = ("stream", "persistent", "small", "segments", "free_keys")

    def __init__(self, stream: int, persistent: bool, small: bool) -> None:
        self.stream = stream
        self.persistent = persistent
        self.small = small
        self.segments: list[_Segment] = []
        self.free_keys: list[int] = []

    @property
    def pool_name(self) -> str:
        if self.persistent:
            return "persistent"
        return "small" if self.small else "common"


class MindSporePool(AllocatorModel):
    """MindSpore's default device pool (best fit, blocks grown by doubling); see the module doc.

    Args:
        capacity: device memory the pool may take in total, bytes (``None``: unbounded).
        increase_size: the growth unit (``set_memory(increase_size=)``), bytes; 1 GiB default.
        init_size: ``set_memory(init_size=)``: split in half between the persistent and the
            common allocator of stream 0 at start.
        pregrow: shorthand for ``init_size=capacity``.
        grow: ``"double"`` (PyNative / kernel-by-kernel, the default) or ``"add"`` (graph sink).
        small_pool: model ``MS_ALLOC_CONF=enable_small_pool:True``.
        tie: which of several equal-size free buffers a request takes: ``"address"`` (the
            lowest; ``AbstractDynamicMemPool``) or ``"idle_order"`` (the one idle longest;
            ``DynamicMemPoolBestFit``).
    """

    name = "mindspore"
    default_tie = "address"

    def __init__(self, capacity: int | None = None, increase_size: int = 1 << 30, init_size: int = 0,
                 pregrow: bool = False, grow: str = "double", small_pool: bool = False,
                 tie: str | None = None) -> None:
        super().__init__(capacity)
        self.tie = tie = check_options(increase_size, grow, tie or self.default_tie)
        # idle_order: free buffers by their turn (the key's low half); address: by address (_bufs)
        self._idle_by_turn: dict[int, list] | None = {} if tie == "idle_order" else None
        self._turn = 0
        self.increase_size = int(increase_size)
        self.grow = grow
        self.small_pool = small_pool
        self._allocators: dict[tuple[int, bool, bool], _Allocator] = {}
        self._bufs: dict[int, list] = {}        # every buffer (live or idle) by address
        self._next_addr = _BASE_ADDR
        self._recorded_addrs: deque[int] = deque()
        half = initial_block(capacity, init_size, pregrow)
        if half:
            for persistent in (True, False):
                allocator = self._allocator(0, persistent, False)
                self._new_segment(allocator, min(half, self._device_free()))

    # --- requests -----------------------------------------------------------------------
    def malloc(self, size: int, *, stream: int = 0, pool: str | None = None,
               tag: str | None = None) -> int | None:
        """Serve ``size`` bytes (512-aligned) following MindSpore's order; ``None`` on OOM."""
        size = align_size(size)
        persistent = pool == "persistent"
        small = self.small_pool and not persistent and size <= SMALL_SIZE
        allocators = self._allocators
        allocator = allocators.get((stream, persistent, small))
        if allocator is None:
            allocator = self._allocator(stream, persistent, small)
        buf = self._take(allocator, size)
        if buf is None:
            if persistent:
                common = allocators.get((stream, False, False)) or self._allocator(stream, False, False)
                buf = self._take(common, size)
                allocator = common
            if buf is None:
                buf = self._expand(allocator, size)
                if buf is None and not persistent:
                    other = allocators.get((stream, True, False)) or self._allocator(stream, True, False)
                    buf = self._take(other, size)
                if buf is None:
                    # DoSyncAllEvents and one more allocator->Malloc: the slow path; with frees
                    # already applied the retry cannot find more than the first try did
                    self.slow_path_events += 1
                    self._record_oom(size, stream, tag)
                    return None
        self.allocated += buf[_SIZE]
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return buf[_ADDR]

    def free(self, addr: int) -> None:
        """Free the live buffer at ``addr``; it merges with idle neighbours in its block."""
        buf = self._bufs.get(addr)
        if buf is None or not buf[_USED]:
            return
        self.allocated -= buf[_SIZE]
        buf[_USED] = False
        free_keys = buf[_SEG].owner.free_keys
        prev = buf[_PREV]
        if prev is not None and not prev[_USED]:
            self._unindex(prev, free_keys)
            prev[_SIZE] += buf[_SIZE]
            nxt = buf[_NEXT]
            prev[_NEXT] = nxt
            if nxt is not None:
                nxt[_PREV] = prev
            del self._bufs[addr]
            buf = prev
        nxt = buf[_NEXT]
        if nxt is not None and not nxt[_USED]:
            self._unindex(nxt, free_keys)
            buf[_SIZE] += nxt[_SIZE]
            after = nxt[_NEXT]
            buf[_NEXT] = after
            if after is not None:
                after[_PREV] = buf
            del self._bufs[nxt[_ADDR]]
        self._index(buf, free_keys)

    def empty_cache(self) -> None:
        """``ReleaseFreeBlocks``: give back every block that is one whole idle buffer."""
        for allocator in self._allocators.values():
            for seg in list(allocator.segments):
                self._release_if_idle(seg)

    # --- recorded context -------------------------------------------------------------------
    def note_segment_alloc(self, addr: int, size: int, stream: int = 0) -> None:
        """Place the next new block at ``addr`` (the recording's device address), if it is free."""
        self._recorded_addrs.append(addr)

    def release_segment(self, addr: int, size: int, stream: int = 0) -> None:
        for allocator in self._allocators.values():
            for seg in allocator.segments:
                if seg.addr == addr:
                    self._release_if_idle(seg)
                    return

    def restore(self, layout: Layout) -> None:
        """Start from ``layout``: its segments become pool blocks of the allocator named by
        ``segment.pool`` (``"persistent"`` or common) and ``segment.stream``; live blocks keep
        their addresses, free ranges are merged and indexed."""
        for segment in sorted(layout.segments, key=lambda s: s.addr):
            persistent = segment.pool == "persistent"
            small = segment.pool == "small"
            allocator = self._allocators.get((segment.stream, persistent, small)) or \
                self._allocator(segment.stream, persistent, small)
            seg = _Segment(segment.addr, segment.size, segment.stream, allocator.pool_name, allocator)
            allocator.segments.append(seg)
            self.reserved += segment.size
            self.segment_allocs += 1
            prev = None
            for addr, size, live in restore_pieces(segment):
                buf = [addr, size, live, prev, None, seg, addr]
                if prev is None:
                    seg.head = buf
                else:
                    prev[_NEXT] = buf
                self._bufs[addr] = buf
                if live:
                    self.allocated += size
                prev = buf
            buf = seg.head
            while buf is not None:
                if not buf[_USED]:
                    self._index(buf, allocator.free_keys)
                buf = buf[_NEXT]
            self._next_addr = max(self._next_addr, _round_up(segment.end, _SEG_ALIGN))
        self._note_usage()

    # --- state ----------------------------------------------------------------------------
    def layout(self) -> Layout:
        segments = []
        for allocator in self._allocators.values():
            for seg in allocator.segments:
                blocks = []
                buf = seg.head
                while buf is not None:
                    blocks.append(Block(buf[_ADDR], buf[_SIZE], buf[_USED]))
                    buf = buf[_NEXT]
                segments.append(Segment(seg.addr, seg.size, blocks, stream=seg.stream, pool=seg.pool))
        segments.sort(key=lambda s: s.addr)
        return Layout(segments, capacity=self.capacity)

    def largest_free(self) -> int:
        """The largest idle buffer of any allocator, bytes (O(number of allocators))."""
        best = 0
        for allocator in self._allocators.values():
            if allocator.free_keys:
                best = max(best, allocator.free_keys[-1] >> _SHIFT)
        return best

    # --- internals --------------------------------------------------------------------------
    def _device_free(self) -> int:
        if self.capacity is None:
            return 1 << 62
        return max(self.capacity - self.reserved, 0)

    def _allocator(self, stream: int, persistent: bool, small: bool) -> _Allocator:
        key = (stream, persistent, small)
        allocator = self._allocators.get(key)
        if allocator is None:
            allocator = self._allocators[key] = _Allocator(stream, persistent, small)
        return allocator

    def _take(self, allocator: _Allocator, size: int) -> list | None:
        """``MemBufAllocator::Malloc``: best fit, or grow when the allocator has no block yet."""
        if not allocator.segments:
            return self._expand(allocator, size)
        free_keys = allocator.free_keys
        index = bisect_left(free_keys, size << _SHIFT)
        if index == len(free_keys):
            return None
        tie = free_keys.pop(index) & _MASK
        idle_by_turn = self._idle_by_turn
        buf = self._bufs[tie] if idle_by_turn is None else idle_by_turn.pop(tie)
        return self._split(buf, size, free_keys)

    def _split(self, buf: list, size: int, free_keys: list[int]) -> list:
        remaining = buf[_SIZE] - size
        if remaining >= ALIGN:
            addr = buf[_ADDR] + size
            nxt = buf[_NEXT]
            rest = [addr, remaining, False, buf, nxt, buf[_SEG], addr]
            if nxt is not None:
                nxt[_PREV] = rest
            buf[_NEXT] = rest
            buf[_SIZE] = size
            self._bufs[addr] = rest
            self._index(rest, free_keys)
        buf[_USED] = True
        return buf

    def _block_size(self, size: int) -> int:
        """``CalMemBlockAllocSize``: 0 when the device cannot hold ``size``."""
        device_free = self._device_free()
        if device_free < size:
            return 0
        unit = self.increase_size
        block = unit
        if self.grow == "double":
            while block < size:
                block *= 2
        else:
            while block < size:
                block += unit
        return min(block, device_free)

    def _expand(self, allocator: _Allocator, size: int) -> list | None:
        """``MallocExpandBlock``: a new block, then best fit in it."""
        block = self._block_size(size)
        if block < size:
            return None
        seg = self._new_segment(allocator, block)
        buf = self._bufs[seg.addr]
        self._unindex(buf, allocator.free_keys)
        return self._split(buf, size, allocator.free_keys)

    def _new_segment(self, allocator: _Allocator, size: int) -> _Segment:
        addr = self._place(size)
        seg = _Segment(addr, size, allocator.stream, allocator.pool_name, allocator)
        buf = [addr, size, False, None, None, seg, addr]
        seg.head = buf
        self._bufs[addr] = buf
        allocator.segments.append(seg)
        self._index(buf, allocator.free_keys)
        self.reserved += size
        self.segment_allocs += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return seg

    def _place(self, size: int) -> int:
        while self._recorded_addrs:
            addr = self._recorded_addrs.popleft()
            if not self._overlaps(addr, size):
                self._next_addr = max(self._next_addr, _round_up(addr + size, _SEG_ALIGN))
                return addr
        addr = self._next_addr
        self._next_addr = _round_up(addr + size, _SEG_ALIGN)
        return addr

    def _overlaps(self, addr: int, size: int) -> bool:
        end = addr + size
        return any(seg.addr < end and addr < seg.addr + seg.size
                   for allocator in self._allocators.values() for seg in allocator.segments)

    def _release_if_idle(self, seg: _Segment) -> None:
        head = seg.head
        if head is None or head[_USED] or head[_NEXT] is not None:
            return
        self._unindex(head, seg.owner.free_keys)
        del self._bufs[head[_ADDR]]
        seg.owner.segments.remove(seg)
        self.reserved -= seg.size
        self.segment_frees += 1


    def _index(self, buf: list, free_keys: list[int]) -> None:
        """Put an idle ``buf`` in its allocator's best-fit order (its tie key set here)."""
        idle_by_turn = self._idle_by_turn
        if idle_by_turn is not None:
            # a multimap inserts after its equal keys: the newest idle buffer is tried last
            self._turn += 1
            buf[_TIE] = self._turn
            idle_by_turn[self._turn] = buf
        insort(free_keys, (buf[_SIZE] << _SHIFT) | buf[_TIE])

    def _unindex(self, buf: list, free_keys: list[int]) -> None:
        """Take an idle ``buf`` out of the best-fit order (before its size changes)."""
        del free_keys[bisect_left(free_keys, (buf[_SIZE] << _SHIFT) | buf[_TIE])]
        if self._idle_by_turn is not None:
            del self._idle_by_turn[buf[_TIE]]


class MindSporeBestFitPool(MindSporePool):
    """``DynamicMemPoolBestFit``: the CPU pool (and Ascend's with ``older_pool:True``).

    The rules of :class:`MindSporePool` with the ``std::multimap`` tie rule: among free
    buffers of the same size a request takes the one that became idle first. Replayed from a
    recording (``ms-memopt record``, the ``VLOG_v=12906`` pool log) its blocks sit at the
    recorded ``malloc`` bases (``segment_alloc`` events), so addresses compare one to one. On
    CPU the unit stays 1 GiB whatever ``set_memory(increase_size=)`` says.

    Example:
        >>> pool = MindSporeBestFitPool()
        >>> a, b, c, d = (pool.malloc(4096) for _ in range(4))
        >>> pool.free(c); pool.free(a)           # c idle first, then a
        >>> pool.malloc(4096) == c               # the address rule would give a
        True
    """

    name = "mindspore-bestfit"
    default_tie = "idle_order"


def check_options(increase_size: int, grow: str, tie: str) -> str:
    """Raise ``ValueError`` on a bad option of the MindSpore pool models; the tie rule."""
    if increase_size <= 0:
        raise ValueError(f"increase_size must be > 0, got {increase_size}")
    if grow not in ("double", "add"):
        raise ValueError(f"grow must be 'double' or 'add', got {grow!r}")
    if tie not in TIE_RULES:
        raise ValueError(f"tie must be one of {TIE_RULES}, got {tie!r}")
    return tie


def initial_block(capacity: int | None, init_size: int, pregrow: bool) -> int:
    """Bytes of each of the two blocks ``set_memory(init_size=)`` makes (0: none)."""
    if pregrow:
        if capacity is None:    # an InputError (a ValueError): the option combination is the user's
            raise InputError("pregrow=true needs a capacity (give --capacity, or init_size=SIZE instead)",
                             key="--allocator-option")
        init_size = capacity
    return align_size(init_size >> 1) if init_size else 0


def restore_pieces(segment: Segment) -> list[tuple[int, int, bool]]:
    """``(addr, size, live)`` tiling a recorded segment: its blocks by address, the gaps
    between them and idle neighbours merged into one idle piece."""
    pieces: list[tuple[int, int, bool]] = []
    cursor = segment.addr

    def add(addr: int, size: int, live: bool) -> None:
        if pieces and not live and not pieces[-1][2]:
            pieces[-1] = (pieces[-1][0], pieces[-1][1] + size, False)
        else:
            pieces.append((addr, size, live))

    for block in sorted(segment.blocks, key=lambda b: b.addr):
        if block.addr > cursor:
            add(cursor, block.addr - cursor, False)
        add(block.addr, block.size, block.live)
        cursor = block.addr + block.size
    if cursor < segment.end:
        add(cursor, segment.end - cursor, False)
    return pieces


def _round_up(value: int, unit: int) -> int:
    return (value + unit - 1) // unit * unit

"""MindSpore's device pool with virtual memory management (VMM, ``enable_vmm``).

Rules, as read in MindSpore's source (``abstract_dynamic_mem_pool.cc`` ``MemBufAllocator``
with ``enable_eager_free_``; ``ascend_vmm_adapter.cc``; names below are MindSpore's):

* **Virtual range per allocator**: an allocator (per stream, persistent or common) grows by
  reserving a *virtual* range of ``max(request, device memory)`` rounded up to 2 MiB
  (``AllocDeviceMemByEagerFree`` -> ``aclrtReserveMemAddress``); nothing is backed yet. The
  whole range starts as one *eager-free* buffer (virtual, unmapped).
* **Physical chunks on demand**: physical memory is mapped in 2 MiB chunks (``kVmmAlignSize``)
  covering the bytes a request takes (``MmapDeviceMem``: every chunk overlapping
  ``[addr, addr + size)`` not mapped yet). Mapping fails when the device has no free chunk
  left (``capacity``).
* **Buffer states**: used, idle (freed, still mapped) and eager-free (unmapped or being
  unmapped). Idle buffers merge only with idle neighbours, eager-free only with eager-free
  ones (``Free(mem_buf, target_status)``); both are kept sorted by (size, address).
* **Malloc order** (``MemBufAllocator::Malloc``): best fit among idle buffers (split when the
  remainder >= 512 B); else an idle buffer followed by an eager-free one whose sizes add up
  (``SearchAvailableMemBuf``: largest idle first, map the missing part); else best fit among
  eager-free buffers (map, split). With VMM the persistent side never borrows the common one.
* **On failure** (``AllocMemBuf``): ``FreeIdleMemsByEagerFree`` — every idle buffer of every
  allocator becomes eager-free and every 2 MiB chunk lying wholly inside an eager-free buffer
  is unmapped — then retry; then reserve a new virtual range (``MallocExpandBlock``); then a
  common request tries the persistent allocator; then OOM.
* **The slow path** (``slow_path_events``; MindSpore 2.10,
  ``mindspore/ccsrc/runtime/memory/mem_pool/abstract_dynamic_mem_pool.cc``,
  ``AbstractDynamicMemPool::AllocMemBuf``): with VMM the first failure of
  ``allocator->Malloc`` is the slow path at once: ``WaitPipelineHelper``, ``SyncAllStreams``
  (the host waits for every stream), ``FreeIdleMemsByEagerFree``, retry. Each such request
  counts one slow-path event, whether the retry, the new range or the borrow then serves it
  or it fails (the last resort, ``DoSyncAllEvents`` and one more ``Malloc``, is part of the
  same request's slow path and finds nothing new here: frees take effect at once). The sweep
  it runs counts separately (``eager_frees``), so does each periodic ``DefragMemory``.
* **Idle memory goes back by chunk**: virtual ranges are never released (``segment_frees``
  stays 0); what returns to the device is the 2 MiB chunks an eager-free sweep unmaps
  (``FreeDeviceMemByEagerFree``), seen as the drop of ``reserved``.
* **Defragmentation**: ``DefragMemory`` (every ``defrag_memory_step_freq`` steps, 100 by
  default) runs the same eager free: :meth:`defrag` here, also what :meth:`empty_cache` does.
  The replay engine does not call it on step events; the simulator may.

Metrics (how a VMM layout is exported, so that ``allocated + free_total == reserved`` holds
with ``reserved`` = mapped physical bytes):

* :meth:`layout` exports one segment per run of consecutive mapped 2 MiB chunks of a virtual
  range; its blocks are the used buffers and the mapped free bytes between them. So
  ``reserved`` = mapped bytes, holes = mapped-but-unused ranges, and ``measure(layout)``'s
  ``largest_free`` = the largest request servable *without mapping anything*.
* :meth:`largest_free` answers the question a scan asks — the largest request that would
  succeed now: the longest run of contiguous free *virtual* addresses (idle or eager-free),
  capped by the physical memory that could back it (``capacity`` minus the chunks that hold
  live data; chunks shared with a live neighbour are counted as live, so it is a slight
  underestimate). It is what OOM records report as ``largest_free``.

Data structures: as :mod:`ms_memopt.allocators.mindspore` (sorted integer keys
``size << 64 | addr`` for idle and for eager-free buffers, linked buffer lists), plus the
mapped chunk indices (``addr >> 21``) per model as sorted runs (:class:`ChunkSet`), so a
mapping costs the same whatever its size (a 1 PiB request is one run, not 2**29 entries).

Example:
    >>> pool = MindSporeVMMPool(capacity=8 * 2**30)
    >>> a = pool.malloc(3 * 2**20)
    >>> pool.reserved // 2**20      # two 2 MiB chunks mapped
    4
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

from ms_memopt.allocators.base import AllocatorModel, OOMRecord
from ms_memopt.allocators.mindspore import ALIGN, align_size
from ms_memopt.core.layout import Block, Layout, Segment

__all__ = ["MindSporeVMMPool", "CHUNK", "ChunkSet"]

CHUNK = 2 << 20                 # kVmmAlignSize
_CHUNK_SHIFT = 21
_SHIFT = 64
_MASK = (1 << _SHIFT) - 1
_BASE_ADDR = 1 << 40            # virtual addresses start here
_DEFAULT_VIRTUAL = 1 << 40      # reserved virtual range when the capacity is unknown

_ADDR, _SIZE, _STATE, _PREV, _NEXT, _RANGE = range(6)
_USED, _IDLE, _EAGER = 0, 1, 2


class ChunkSet:
    """A set of chunk indices kept as sorted, disjoint, non-touching runs ``[start, end)``.

    Example:
        >>> chunks = ChunkSet()
        >>> chunks.add(0, 4); chunks.add(4, 6); chunks.remove(1, 2)
        >>> len(chunks), list(chunks.runs(0, 10)), 1 in chunks
        (5, [(0, 1), (2, 6)], False)
    """

    __slots__ = ("starts", "ends", "count")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __contains__(self, chunk: int) -> bool:
        i = bisect_right(self.starts, chunk) - 1
        return i >= 0 and chunk < self.ends[i]

    def covered(self, first: int, end: int) -> int:
        """How many of the chunks ``[first, end)`` are in the set."""
        i = bisect_right(self.starts, first) - 1
        if i >= 0 and self.ends[i] >= end:     # the common case: already mapped, one run
            return end - first
        return sum(hi - lo for lo, hi in self.runs(first, end))

    def runs(self, first: int, end: int):
        """The set's runs clipped to ``[first, end)``, in order."""
        starts, ends = self.starts, self.ends
        for k in range(bisect_right(ends, first), len(starts)):
            if starts[k] >= end:
                break
            yield max(starts[k], first), min(ends[k], end)

    def add(self, first: int, end: int) -> None:
        if end <= first:
            return
        starts, ends = self.starts, self.ends
        i = bisect_left(ends, first)        # runs ending at or after ``first`` (touching merges)
        j = bisect_right(starts, end)       # runs starting at or before ``end``
        added = end - first
        if i < j:
            added -= sum(min(ends[k], end) - max(starts[k], first) for k in range(i, j))
            first, end = min(first, starts[i]), max(end, ends[j - 1])
        starts[i:j] = [first]
        ends[i:j] = [end]
        self.count += added

    def remove(self, first: int, end: int) -> None:
        if end <= first:
            return
        starts, ends = self.starts, self.ends
        i = bisect_right(ends, first)       # runs ending after ``first``
        j = bisect_left(starts, end)        # runs starting before ``end``
        if i >= j:
            return
        keep_starts, keep_ends, removed = [], [], 0
        for k in range(i, j):
            lo, hi = starts[k], ends[k]
            removed += min(hi, end) - max(lo, first)
            if lo < first:
                keep_starts.append(lo)
                keep_ends.append(first)
            if hi > end:
                keep_starts.append(end)
                keep_ends.append(hi)
        starts[i:j] = keep_starts
        ends[i:j] = keep_ends
        self.count -= removed


class _Range:
    """One reserved virtual range (a ``MemBlock`` under VMM)."""

    __slots__ = ("addr", "size", "head", "owner")

    def __init__(self, addr: int, size: int, owner: "_Allocator") -> None:
        self.addr = addr
        self.size = size
        self.head: list | None = None
        self.owner = owner


class _Allocator:
    __slots__ = ("stream", "persistent", "ranges", "idle_keys", "eager_keys")

    def __init__(self, stream: int, persistent: bool) -> None:
        self.stream = stream
        self.persistent = persistent
        self.ranges: list[_Range] = []
        self.idle_keys: list[int] = []
        self.eager_keys: list[int] = []

    def keys(self, state: int) -> list[int]:
        return self.idle_keys if state == _IDLE else self.eager_keys


class MindSporeVMMPool(AllocatorModel):
    """MindSpore's VMM pool: virtual range per allocator, 2 MiB chunks mapped on demand.

    Args:
        capacity: physical device memory, bytes (``None``: unbounded).
    """

    name = "mindspore-vmm"
    virtual = True

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity)
        self._allocators: dict[tuple[int, bool], _Allocator] = {}
        self._bufs: dict[int, list] = {}
        self._mapped = ChunkSet()
        self._max_chunks = None if capacity is None else capacity // CHUNK
        self._next_addr = _BASE_ADDR
        self.eager_frees = 0

    # --- requests -----------------------------------------------------------------------
    def malloc(self, size: int, *, stream: int = 0, pool: str | None = None,
               tag: str | None = None) -> int | None:
        size = align_size(size)
        persistent = pool == "persistent"
        allocator = self._allocator(stream, persistent)
        buf = self._take(allocator, size)
        if buf is None:
            self.slow_path_events += 1      # SyncAllStreams + FreeIdleMemsByEagerFree, then retry
            self.defrag()
            buf = self._take(allocator, size)
            if buf is None:
                buf = self._expand(allocator, size)
            if buf is None and not persistent:
                buf = self._take(self._allocator(stream, True), size)
            if buf is None:
                self._record_oom(size, stream, tag)
                return None
        self.allocated += buf[_SIZE]
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return buf[_ADDR]

    def free(self, addr: int) -> None:
        buf = self._bufs.get(addr)
        if buf is None or buf[_STATE] != _USED:
            return
        self.allocated -= buf[_SIZE]
        self._release(buf, _IDLE)

    def defrag(self) -> None:
        """``FreeIdleMemsByEagerFree``: idle buffers become eager-free; wholly free chunks unmap."""
        self.eager_frees += 1
        for allocator in self._allocators.values():
            idle = [self._bufs[key & _MASK] for key in allocator.idle_keys]
            allocator.idle_keys.clear()
            for buf in idle:
                buf[_STATE] = _USED          # so _release sees a used buffer turning eager-free
                self._release(buf, _EAGER)
            for key in allocator.eager_keys:
                self._unmap(key & _MASK, key >> _SHIFT)
        self.reserved = len(self._mapped) * CHUNK

    def empty_cache(self) -> None:
        self.defrag()

    def restore(self, layout: Layout) -> None:
        """Start from ``layout``: each segment becomes a virtual range of the allocator named
        by ``segment.pool``/``segment.stream``, rounded up to 2 MiB, with every chunk holding
        part of the segment mapped; live blocks keep their addresses, the rest is idle (the
        rounding tail eager-free).

        Raises:
            ValueError: a segment that does not start on a 2 MiB boundary.
        """
        for segment in sorted(layout.segments, key=lambda s: s.addr):
            if segment.addr % CHUNK:
                raise ValueError(f"VMM segments start on 2 MiB boundaries; {segment.addr:#x} does not")
            allocator = self._allocator(segment.stream, segment.pool == "persistent")
            size = (segment.size + CHUNK - 1) // CHUNK * CHUNK
            rng = _Range(segment.addr, size, allocator)
            allocator.ranges.append(rng)
            self.segment_allocs += 1
            prev = None
            for addr, nbytes, state in restore_pieces(segment, size):
                buf = [addr, nbytes, state, prev, None, rng]
                if prev is None:
                    rng.head = buf
                else:
                    prev[_NEXT] = buf
                self._bufs[addr] = buf
                prev = buf
            buf = rng.head
            while buf is not None:
                if buf[_STATE] == _USED:
                    self.allocated += buf[_SIZE]
                else:
                    insort(allocator.keys(buf[_STATE]), (buf[_SIZE] << _SHIFT) | buf[_ADDR])
                buf = buf[_NEXT]
            self._mapped.add(segment.addr >> _CHUNK_SHIFT, (segment.end - 1 >> _CHUNK_SHIFT) + 1)
            self._next_addr = max(self._next_addr, segment.addr + size + CHUNK)
        self.reserved = len(self._mapped) * CHUNK
        self._note_usage()

    # --- state ----------------------------------------------------------------------------
    def range_pieces(self) -> list[tuple[int, bool, int, int, list[tuple[int, int, int]]]]:
        """``(stream, persistent, addr, size, [(addr, size, state), ...])`` of every virtual
        range, allocators by ``(stream, persistent)``; states ``_USED``, ``_IDLE``, ``_EAGER``."""
        out = []
        for key in sorted(self._allocators):
            allocator = self._allocators[key]
            for rng in allocator.ranges:
                pieces = []
                buf = rng.head
                while buf is not None:
                    pieces.append((buf[_ADDR], buf[_SIZE], buf[_STATE]))
                    buf = buf[_NEXT]
                out.append((allocator.stream, allocator.persistent, rng.addr, rng.size, pieces))
        return out

    def layout(self) -> Layout:
        """Mapped runs as segments; see the module docstring."""
        return ranges_layout(self.range_pieces(), self._mapped, self.capacity)

    def largest_free(self) -> int:
        """The largest request that would succeed now (see the module docstring), bytes."""
        return ranges_largest_free(self.range_pieces(), self.capacity)

    # --- internals --------------------------------------------------------------------------
    def _record_oom(self, size: int, stream: int, tag: str | None) -> None:
        if self._counted_oom(size, stream, tag):
            return
        m = self.metrics()
        device_free = None if self.capacity is None else max(self.capacity - self.reserved, 0)
        self.ooms.append(OOMRecord(size=size, stream=stream, free_total=m.free_total,
                                   largest_free=self.largest_free(), reserved=m.reserved,
                                   allocated=m.allocated, capacity=self.capacity,
                                   device_free=device_free, tag=tag))

    def _allocator(self, stream: int, persistent: bool) -> _Allocator:
        allocator = self._allocators.get((stream, persistent))
        if allocator is None:
            allocator = self._allocators[(stream, persistent)] = _Allocator(stream, persistent)
        return allocator

    def _take(self, allocator: _Allocator, size: int) -> list | None:
        """``MemBufAllocator::Malloc`` with eager free enabled."""
        if not allocator.ranges:
            return self._expand(allocator, size)
        keys = allocator.idle_keys
        index = bisect_left(keys, size << _SHIFT)
        if index < len(keys):
            buf = self._bufs[keys.pop(index) & _MASK]
            return self._split(buf, size, allocator)
        buf = self._extend_idle(allocator, size)
        if buf is not None:
            return buf
        keys = allocator.eager_keys
        index = bisect_left(keys, size << _SHIFT)
        if index < len(keys):
            buf = self._bufs[keys[index] & _MASK]
            map_size = size if buf[_SIZE] - size >= ALIGN else buf[_SIZE]
            if not self._map(buf[_ADDR], map_size):
                return None
            del keys[index]
            return self._split(buf, size, allocator)
        return None

    def _extend_idle(self, allocator: _Allocator, size: int) -> list | None:
        """``SearchAvailableMemBuf``: an idle buffer grown into the eager-free one after it."""
        bufs = self._bufs
        for key in reversed(allocator.idle_keys):
            buf = bufs[key & _MASK]
            nxt = buf[_NEXT]
            if nxt is None or nxt[_STATE] != _EAGER or buf[_SIZE] + nxt[_SIZE] < size:
                continue
            need = size - buf[_SIZE]
            if not self._map(nxt[_ADDR], need):
                return None
            keys = allocator.idle_keys
            del keys[bisect_left(keys, key)]
            eager = allocator.eager_keys
            del eager[bisect_left(eager, (nxt[_SIZE] << _SHIFT) | nxt[_ADDR])]
            del bufs[nxt[_ADDR]]
            buf[_SIZE] = size
            buf[_STATE] = _USED
            nxt[_ADDR] += need
            nxt[_SIZE] -= need
            if nxt[_SIZE] == 0:
                buf[_NEXT] = nxt[_NEXT]
                if nxt[_NEXT] is not None:
                    nxt[_NEXT][_PREV] = buf
            else:
                bufs[nxt[_ADDR]] = nxt
                insort(eager, (nxt[_SIZE] << _SHIFT) | nxt[_ADDR])
            return buf
        return None

    def _split(self, buf: list, size: int, allocator: _Allocator) -> list:
        remaining = buf[_SIZE] - size
        if remaining >= ALIGN:
            addr = buf[_ADDR] + size
            nxt = buf[_NEXT]
            rest = [addr, remaining, buf[_STATE], buf, nxt, buf[_RANGE]]
            if nxt is not None:
                nxt[_PREV] = rest
            buf[_NEXT] = rest
            buf[_SIZE] = size
            self._bufs[addr] = rest
            insort(allocator.keys(rest[_STATE]), (remaining << _SHIFT) | addr)
        buf[_STATE] = _USED
        return buf

    def _expand(self, allocator: _Allocator, size: int) -> list | None:
        """``MallocExpandBlock``: reserve a new virtual range, map and split its first bytes."""
        if self.capacity is not None and self.capacity - self.reserved < size:
            return None     # CalMemBlockAllocSize: free device memory below the request
        virtual = max(size, self.capacity if self.capacity is not None else _DEFAULT_VIRTUAL)
        virtual = (virtual + CHUNK - 1) // CHUNK * CHUNK
        addr = self._next_addr
        self._next_addr += virtual + CHUNK          # a guard gap: ranges never touch
        rng = _Range(addr, virtual, allocator)
        buf = [addr, virtual, _EAGER, None, None, rng]
        rng.head = buf
        self._bufs[addr] = buf
        allocator.ranges.append(rng)
        self.segment_allocs += 1
        map_size = size if virtual - size >= ALIGN else virtual
        if not self._map(addr, map_size):
            insort(allocator.eager_keys, (virtual << _SHIFT) | addr)
            return None
        return self._split(buf, size, allocator)

    def _map(self, addr: int, size: int) -> bool:
        first = addr >> _CHUNK_SHIFT
        last = (addr + size - 1) >> _CHUNK_SHIFT
        mapped = self._mapped
        new = last + 1 - first - mapped.covered(first, last + 1)
        if not new:
            return True
        if self._max_chunks is not None and len(mapped) + new > self._max_chunks:
            return False
        mapped.add(first, last + 1)
        self.reserved = len(mapped) * CHUNK
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return True

    def _unmap(self, addr: int, size: int) -> None:
        first = (addr + CHUNK - 1) >> _CHUNK_SHIFT
        end = (addr + size) >> _CHUNK_SHIFT
        if end > first:
            self._mapped.remove(first, end)

    def _release(self, buf: list, state: int) -> None:
        """``MemBufAllocator::Free``: merge with neighbours of the same state, then index."""
        keys = buf[_RANGE].owner.keys(state)
        bufs = self._bufs
        buf[_STATE] = state
        prev = buf[_PREV]
        if prev is not None and prev[_STATE] == state:
            del keys[bisect_left(keys, (prev[_SIZE] << _SHIFT) | prev[_ADDR])]
            prev[_SIZE] += buf[_SIZE]
            prev[_NEXT] = buf[_NEXT]
            if buf[_NEXT] is not None:
                buf[_NEXT][_PREV] = prev
            del bufs[buf[_ADDR]]
            buf = prev
        nxt = buf[_NEXT]
        if nxt is not None and nxt[_STATE] == state:
            del keys[bisect_left(keys, (nxt[_SIZE] << _SHIFT) | nxt[_ADDR])]
            buf[_SIZE] += nxt[_SIZE]
            buf[_NEXT] = nxt[_NEXT]
            if nxt[_NEXT] is not None:
                nxt[_NEXT][_PREV] = buf
            del bufs[nxt[_ADDR]]
        insort(keys, (buf[_SIZE] << _SHIFT) | buf[_ADDR])


def _first_piece(pieces: list[tuple[int, int, bool]], addr: int) -> int:
    """Index of the piece containing ``addr`` (pieces tile the range, sorted by address)."""
    lo = bisect_left(pieces, (addr + 1,)) - 1
    return max(lo, 0)


def restore_pieces(segment: Segment, size: int) -> list[tuple[int, int, int]]:
    """``(addr, size, state)`` tiling a recorded segment restored as a virtual range of ``size``
    bytes: live blocks used, the rest idle, the rounding tail eager-free; idle neighbours merged."""
    pieces: list[list] = []
    cursor = segment.addr
    for block in sorted(segment.blocks, key=lambda b: b.addr):
        if block.addr > cursor:
            pieces.append([cursor, block.addr - cursor, _IDLE])
        pieces.append([block.addr, block.size, _USED if block.live else _IDLE])
        cursor = block.end
    if cursor < segment.end:
        pieces.append([cursor, segment.end - cursor, _IDLE])
    if segment.addr + size > segment.end:
        pieces.append([segment.end, segment.addr + size - segment.end, _EAGER])
    merged: list[list] = []
    for piece in pieces:
        if merged and piece[2] != _USED and merged[-1][2] == piece[2]:
            merged[-1][1] += piece[1]
        else:
            merged.append(piece)
    return [(addr, nbytes, state) for addr, nbytes, state in merged]


def ranges_layout(ranges, mapped: ChunkSet, capacity: int | None) -> Layout:
    """:meth:`MindSporeVMMPool.layout` from its :meth:`~MindSporeVMMPool.range_pieces` and its
    mapped chunks."""
    segments = []
    for stream, persistent, rng_addr, rng_size, states in ranges:
        pool = "persistent" if persistent else "common"
        pieces = [(addr, size, state == _USED) for addr, size, state in states]
        first = rng_addr >> _CHUNK_SHIFT
        last = (rng_addr + rng_size) >> _CHUNK_SHIFT
        for start, end in list(mapped.runs(first, last)):
            seg_addr, seg_end = start << _CHUNK_SHIFT, end << _CHUNK_SHIFT
            blocks: list[Block] = []
            index = _first_piece(pieces, seg_addr)
            while index < len(pieces) and pieces[index][0] < seg_end:
                addr, size, live = pieces[index]
                lo, hi = max(addr, seg_addr), min(addr + size, seg_end)
                if blocks and not live and not blocks[-1].live:
                    blocks[-1].size += hi - lo
                else:
                    blocks.append(Block(lo, hi - lo, live))
                index += 1
            segments.append(Segment(seg_addr, seg_end - seg_addr, blocks, stream=stream, pool=pool))
    segments.sort(key=lambda s: s.addr)
    return Layout(segments, capacity=capacity)


def ranges_largest_free(ranges, capacity: int | None) -> int:
    """:meth:`MindSporeVMMPool.largest_free` from its :meth:`~MindSporeVMMPool.range_pieces`."""
    live_chunks = ChunkSet()
    runs: list[int] = []
    for *_, states in ranges:
        run = 0
        for addr, size, state in states:
            if state == _USED:
                runs.append(run)
                run = 0
                live_chunks.add(addr >> _CHUNK_SHIFT, ((addr + size - 1) >> _CHUNK_SHIFT) + 1)
            else:
                run += size
        runs.append(run)
    longest = max(runs, default=0)
    if capacity is None:
        return longest
    return max(0, min(longest, capacity - len(live_chunks) * CHUNK))

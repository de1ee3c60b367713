"""PyTorch's caching allocator with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.

Rules (c10/cuda/CUDACachingAllocator.cpp, ``ExpandableSegment``, ``find_expandable_block``,
``map_block``, ``unmap_block``):

* each (stream, small/large pool) reserves one virtual range of 1 1/8 x device memory and maps
  physical pages on demand: 2 MiB pages for the small pool, 20 MiB for the large pool;
* a request first takes a cached (mapped, free) block by best fit, as without expandable
  segments, except that among fitting blocks one whose end borders unmapped space counts as
  that much bigger, so blocks that cannot grow are preferred;
* nothing cached fits: the lowest unmapped range of the pool (together with the free block just
  before it) that can hold the request gets pages mapped at its start; the new pages merge with
  that free block, so pieces split off earlier re-merge into one hole;
* a block is split whenever the remainder is >= 512 B (both pools);
* ``empty_cache()`` / failing to map: the whole pages inside every free block are unmapped;
  live blocks still pin the pages they touch; a range left with no mapped page is given back
  (``release_blocks``: ``release_expandable_segment`` once a block has no neighbours), so the
  next range is reserved anew.

Replaying a snapshot (its ``segment_map`` / ``segment_unmap`` entries):

* :meth:`note_segment_map`: the recorded address of a mapping; when the request that follows
  needs a new range, the range starts there (the recording's ``cuMemAddressReserve`` chose it),
  shortening an earlier range whose unmapped tail reaches over it (the device's ranges do not
  overlap);
* :meth:`unmap_range`: the recording unmapped ``[addr, addr + size)``: the whole pages of the
  free blocks there are unmapped, so the pool shrinks where the recording's did.

Layout exported for the metrics: each maximal run of *mapped* blocks of a range is one
:class:`~ms_memopt.core.layout.Segment`, so ``reserved`` is the mapped bytes and
``allocated + free_total == reserved``; a free block spans as many pages as it covers (holes
are contiguous in virtual space, unlike the per-segment holes of the ``torch`` model).

When restoring a recorded state (``restore``, :func:`restore_ranges`), the mapped runs of a
recording made with expandable segments (``Layout.expandable``) become expandable ranges again,
their gaps unmapped; other recorded segments become fixed ranges that are fully mapped and never
grow (a real allocator switched to expandable segments keeps its old segments); new memory comes
from the expandable ranges.

Example:
    >>> m = TorchExpandableAllocator(capacity=2**30)
    >>> a = m.malloc(12 * 2**20); b = m.malloc(12 * 2**20)
    >>> b - a, m.reserved // 2**20        # back to back, 2 x 20 MiB pages mapped
    (12582912, 40)
"""
from __future__ import annotations

from bisect import bisect_left, insort

from ms_memopt.allocators.base import AllocatorModel
from typing import Callable

from ms_memopt.allocators.torch import (LARGE_BUFFER, MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, check_divisions, serving_pool,
                                        is_small_segment, merged_blocks, round_size)
from ms_memopt.core.layout import Block, Layout, Segment

__all__ = ["TorchExpandableAllocator", "restore_ranges", "range_size_for", "page_size"]

VIRTUAL_BASE = 1 << 44
UNBOUNDED_RANGE = 1 << 40       # virtual range size when the capacity is unknown
GIB = 1 << 30
_SHIFT = 64
_MASK = (1 << _SHIFT) - 1
_UNMAPPED, _FREE, _LIVE = 0, 1, 2
# positions in a block record
_SIZE, _PREV, _NEXT, _STATE, _POOL, _RANGE = range(6)


def range_size_for(capacity: int | None) -> int:
    """The virtual range a pool reserves: 1 1/8 x the device memory (``ExpandableSegment``:
    ``device_total + device_total / 8``), :data:`UNBOUNDED_RANGE` when unknown (bytes)."""
    return UNBOUNDED_RANGE if capacity is None else capacity + capacity // 8


def page_size(small: bool) -> int:
    """PyTorch's expandable pages: 2 MiB in the small pool, 20 MiB in the large one (bytes)."""
    return SMALL_BUFFER if small else LARGE_BUFFER


def restore_ranges(layout: Layout, page_size: Callable[[bool], int], range_size: int) -> list[tuple]:
    """The virtual ranges a model with expandable segments starts from for ``layout``, as
    ``(base, size, page, stream, small, fixed, pieces)``; ``pieces`` ``[(addr, size, state)]``
    tile the range (state 0 free, 1 live, 2 unmapped), free neighbours merged.

    A layout of mapped runs (``layout.expandable``, a recording with expandable segments): one
    expandable range per stretch of runs of one (stream, pool) whose starts are whole pages
    (``page_size(small)``) apart, from its first run, ``range_size`` long or up to the next
    range; the gaps are unmapped. Otherwise each segment is a fixed, fully mapped range that
    goes back only whole (a process switched to expandable segments keeps its old segments).
    """
    segments = sorted(layout.segments, key=lambda s: s.addr)
    if not layout.expandable:
        return [(seg.addr, seg.size, seg.size, seg.stream, is_small_segment(seg), True,
                 [(addr, size, int(live)) for addr, size, live in merged_blocks(seg)]) for seg in segments]
    stretches: list[tuple[tuple[int, bool], int, list[Segment]]] = []
    for seg in segments:
        small = is_small_segment(seg)
        key, page = (seg.stream, small), page_size(small)
        if stretches and stretches[-1][0] == key and (seg.addr - stretches[-1][2][0].addr) % page == 0:
            stretches[-1][2].append(seg)
        else:
            stretches.append((key, page, [seg]))
    plans = []
    for i, ((stream, small), page, runs) in enumerate(stretches):
        base, end = runs[0].addr, runs[-1].end
        size = max(range_size, end - base)
        size = (size + page - 1) // page * page
        if i + 1 < len(stretches):
            size = max(end - base, min(size, stretches[i + 1][2][0].addr - base))
        pieces, cursor = [], base
        for run in runs:
            if run.addr > cursor:
                pieces.append((cursor, run.addr - cursor, 2))
            pieces += [(addr, psize, int(live)) for addr, psize, live in merged_blocks(run)]
            cursor = run.end
        if base + size > cursor:
            pieces.append((cursor, base + size - cursor, 2))
        plans.append((base, size, page, stream, small, False, pieces))
    return plans


class _Range:
    """One virtual range: ``[base, base + size)`` mapped in pages of ``page`` bytes."""

    __slots__ = ("base", "size", "page", "stream", "small", "fixed")

    def __init__(self, base: int, size: int, page: int, stream: int, small: bool, fixed: bool) -> None:
        self.base, self.size, self.page = base, size, page
        self.stream, self.small, self.fixed = stream, small, fixed


class TorchExpandableAllocator(AllocatorModel):
    """PyTorch's caching allocator with expandable segments; see the module docstring.

    Args:
        capacity: device memory in bytes (``None``: unbounded); bounds the *mapped* bytes.
        roundup_power2_divisions: as for ``torch`` (a power of two), or ``None``.
    """

    name = "torch-expandable"
    virtual = True
    #: bytes added to a request before rounding (as :attr:`TorchCachingAllocator.pad`)
    pad = 0
    serving_pool = serving_pool

    def __init__(self, capacity: int | None = None, roundup_power2_divisions: int | None = None) -> None:
        super().__init__(capacity)
        check_divisions(roundup_power2_divisions)
        self.divisions = roundup_power2_divisions or 0
        self.range_size = range_size_for(capacity)
        self._reset()

    def _reset(self) -> None:
        self.reserved = 0
        self.allocated = 0
        self._blocks: dict[int, list] = {}
        self._free: dict[tuple[int, bool], list[int]] = {}       # sorted size << 64 | addr
        self._unmapped: dict[tuple[int, bool], list[int]] = {}   # sorted addresses
        self._ranges: dict[int, _Range] = {}                     # base -> range
        self._next_base = VIRTUAL_BASE     # new ranges go in the lowest gap from here
        self._map_hints: list[tuple[int, int]] = []   # (addr, stream) of recorded mappings

    def _lists(self, stream: int, small: bool) -> tuple[list[int], list[int]]:
        key = (stream, small)
        free_list = self._free.get(key)
        if free_list is None:
            free_list = self._free[key] = []
            self._unmapped[key] = []
        return free_list, self._unmapped[key]

    # --- requests -----------------------------------------------------------------------
    def malloc(self, size: int, *, stream: int = 0, pool: str | None = None,
               tag: str | None = None) -> int | None:
        rsize = round_size(size + self.pad, self.divisions)
        small = rsize <= SMALL_SIZE
        free_list, unmapped = self._lists(stream, small)
        blocks = self._blocks
        i = bisect_left(free_list, rsize << _SHIFT)
        if i < len(free_list):
            # prefer blocks that cannot grow into unmapped space (their "expandable size")
            while i + 1 < len(free_list) and self._expandable(free_list[i + 1]) < self._expandable(free_list[i]):
                i += 1
            addr = free_list.pop(i) & _MASK
        else:
            addr = self._map_for(rsize, stream, small, free_list, unmapped)
            if addr is None and self._unmap_all():
                addr = self._map_for(rsize, stream, small, free_list, unmapped)
            if addr is None:
                self._map_hints.clear()
                self._record_oom(size, stream, tag)
                return None
            del free_list[bisect_left(free_list, blocks[addr][_SIZE] << _SHIFT | addr)]
        if self._map_hints:     # they announced this request's mappings, no later one's
            self._map_hints.clear()
        addr = self._place(addr, rsize)
        block = blocks[addr]
        block[_STATE] = _LIVE
        remaining = block[_SIZE] - rsize
        if remaining >= MIN_BLOCK:
            rest = addr + rsize
            nxt = block[_NEXT]
            blocks[rest] = [remaining, addr, nxt, _FREE, free_list, block[_RANGE]]
            if nxt is not None:
                blocks[nxt][_PREV] = rest
            block[_NEXT] = rest
            block[_SIZE] = rsize
            self._merge_free(rest)
        self.allocated += block[_SIZE]
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return addr

    def free(self, addr: int) -> None:
        block = self._blocks.get(addr)
        if block is None or block[_STATE] != _LIVE:
            return
        block[_STATE] = _FREE
        self.allocated -= block[_SIZE]
        self._merge_free(addr)

    def _place(self, addr: int, rsize: int) -> int:
        """Where in the free block at ``addr`` (out of its free list) the request goes; the
        block is split there first when it is not its start. PyTorch: its start."""
        return addr

    def _split_front(self, addr: int, offset: int) -> int:
        """Cut the first ``offset`` bytes of the block at ``addr`` (out of its free list) off as
        a free block of their own, in the free list and not merged (the block's neighbour
        before it is not free); the address of the rest."""
        blocks = self._blocks
        block = blocks[addr]
        start = addr + offset
        nxt = block[_NEXT]
        blocks[start] = [block[_SIZE] - offset, addr, nxt, block[_STATE], block[_POOL], block[_RANGE]]
        if nxt is not None:
            blocks[nxt][_PREV] = start
        block[_NEXT] = start
        block[_SIZE] = offset
        insort(block[_POOL], offset << _SHIFT | addr)
        return start

    def block_size(self, addr: int) -> int:
        """The size of the block at ``addr`` in bytes (live, free or unmapped)."""
        return self._blocks[addr][_SIZE]

    def _page_size(self, small: bool) -> int:
        """The range's page: ``ExpandableSegment``'s ``segment_size`` (:func:`page_size`)."""
        return page_size(small)

    def _expandable(self, key: int) -> int:
        block = self._blocks[key & _MASK]
        nxt = block[_NEXT]
        if nxt is not None:
            nblock = self._blocks[nxt]
            if nblock[_STATE] == _UNMAPPED:
                return block[_SIZE] + nblock[_SIZE]
        return block[_SIZE]

    def _merge_free(self, addr: int) -> int:
        """Merge the free block at ``addr`` with free neighbours; put it in its free list."""
        blocks = self._blocks
        block = blocks[addr]
        free_list = block[_POOL]
        prev = block[_PREV]
        if prev is not None and blocks[prev][_STATE] == _FREE:
            pblock = blocks[prev]
            del free_list[bisect_left(free_list, pblock[_SIZE] << _SHIFT | prev)]
            self._absorb_next(prev)
            addr, block = prev, pblock
        nxt = block[_NEXT]
        if nxt is not None and blocks[nxt][_STATE] == _FREE:
            del free_list[bisect_left(free_list, blocks[nxt][_SIZE] << _SHIFT | nxt)]
            self._absorb_next(addr)
        insort(free_list, block[_SIZE] << _SHIFT | addr)
        return addr

    def _absorb_next(self, addr: int) -> None:
        blocks = self._blocks
        block = blocks[addr]
        nxt = block[_NEXT]
        nblock = blocks.pop(nxt)
        block[_SIZE] += nblock[_SIZE]
        after = nblock[_NEXT]
        block[_NEXT] = after
        if after is not None:
            blocks[after][_PREV] = addr

    # --- mapping --------------------------------------------------------------------------
    def _map_for(self, rsize: int, stream: int, small: bool, free_list: list[int],
                 unmapped: list[int]) -> int | None:
        """try_allocate_expandable_block: map pages until a free block holds ``rsize``."""
        blocks = self._blocks
        candidate = self._find_expandable(rsize, stream, small, unmapped)
        while blocks[candidate][_SIZE] < rsize or blocks[candidate][_STATE] != _FREE:
            cblock = blocks[candidate]
            if cblock[_STATE] == _UNMAPPED:
                to_map, want = candidate, rsize
            else:
                to_map, want = cblock[_NEXT], rsize - cblock[_SIZE]
            candidate = self._map(to_map, want)
            if candidate is None:
                return None
        return candidate

    def _find_expandable(self, rsize: int, stream: int, small: bool, unmapped: list[int]) -> int:
        blocks = self._blocks
        for addr in unmapped:
            start = addr
            prev = blocks[addr][_PREV]
            if prev is not None and blocks[prev][_STATE] == _FREE:
                start = prev
            room, cursor = 0, start
            while room < rsize and cursor is not None and blocks[cursor][_STATE] != _LIVE:
                room += blocks[cursor][_SIZE]
                cursor = blocks[cursor][_NEXT]
            if room >= rsize:
                return start
        page = self._page_size(small)
        size = max(self.range_size, rsize)
        size = (size + page - 1) // page * page
        base, size = self._range_place(size, stream)
        rng = _Range(base, size, page, stream, small, fixed=False)
        self._ranges[base] = rng
        free_list, _ = self._lists(stream, small)
        blocks[base] = [size, None, None, _UNMAPPED, free_list, rng]
        insort(unmapped, base)
        return base

    def _range_place(self, size: int, stream: int) -> tuple[int, int]:
        """A new range's base and size: at the recorded mapping that announced it (shortened to
        the next range above), else in the lowest gap from ``_next_base`` (GiB-aligned, a GiB
        apart)."""
        for addr, hint_stream in self._map_hints:
            if hint_stream == stream and self._claim(addr):
                above = [b for b in self._ranges if b > addr]
                return addr, min(size, min(above) - addr) if above else size
        cursor = self._next_base
        for base in sorted(self._ranges):
            end = base + self._ranges[base].size
            if end <= cursor:
                continue
            if base >= cursor + size:
                break
            cursor = (end + GIB - 1) // GIB * GIB + GIB
        return cursor, size

    def _claim(self, addr: int) -> bool:
        """Whether a new range may start at ``addr``: outside every range, or inside the
        unmapped tail of one (which then ends at ``addr``)."""
        below = [b for b in self._ranges if b <= addr]
        if not below:
            return True
        rng = self._ranges[max(below)]
        if addr >= rng.base + rng.size:
            return True
        tail = self._tail(rng)
        block = self._blocks[tail]
        if block[_STATE] != _UNMAPPED or tail >= addr:
            return False
        block[_SIZE] = addr - tail
        rng.size = addr - rng.base
        return True

    def _tail(self, rng: _Range) -> int:
        """The address of a range's last block."""
        addr = rng.base
        while self._blocks[addr][_NEXT] is not None:
            addr = self._blocks[addr][_NEXT]
        return addr

    def _map(self, addr: int, want: int) -> int | None:
        """map_block: map whole pages covering ``want`` bytes at the start of unmapped ``addr``."""
        blocks = self._blocks
        block = blocks[addr]
        rng = block[_RANGE]
        page = rng.page
        size = min(block[_SIZE], (want + page - 1) // page * page)
        if self.capacity is not None and self.reserved + size > self.capacity:
            return None
        stream_key = (rng.stream, rng.small)
        unmapped = self._unmapped[stream_key]
        del unmapped[bisect_left(unmapped, addr)]
        if size < block[_SIZE]:
            rest = addr + size
            nxt = block[_NEXT]
            blocks[rest] = [block[_SIZE] - size, addr, nxt, _UNMAPPED, block[_POOL], rng]
            if nxt is not None:
                blocks[nxt][_PREV] = rest
            block[_NEXT] = rest
            block[_SIZE] = size
            insort(unmapped, rest)
        block[_STATE] = _FREE
        self.reserved += size
        self.segment_allocs += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return self._merge_free(addr)

    def _unmap_all(self) -> bool:
        """release_cached_blocks: unmap the whole pages inside every free block."""
        released = False
        for free_list in list(self._free.values()):
            for key in list(free_list):
                released |= self._unmap(key & _MASK)
        return released

    def _unmap(self, addr: int, lo: int = 0, hi: int = 1 << 64) -> bool:
        """unmap_block: the whole pages of the free block at ``addr`` (within ``[lo, hi)``)."""
        blocks = self._blocks
        block = blocks[addr]
        rng = block[_RANGE]
        size = block[_SIZE]
        if rng.fixed:
            # a recorded (non-expandable) segment goes back only whole, like cudaFree
            if block[_PREV] is None and block[_NEXT] is None:
                free_list = block[_POOL]
                del free_list[bisect_left(free_list, size << _SHIFT | addr)]
                del blocks[addr]
                del self._ranges[rng.base]
                self.reserved -= size
                return True
            return False
        page, base = rng.page, rng.base
        begin = base + (max(addr, lo) - base + page - 1) // page * page
        end = base + (min(addr + size, hi) - base) // page * page
        if begin >= end:
            return False
        free_list = block[_POOL]
        del free_list[bisect_left(free_list, size << _SHIFT | addr)]
        unmapped = self._unmapped[(rng.stream, rng.small)]
        # carve [addr, begin) free | [begin, end) unmapped | [end, addr + size) free
        nxt = block[_NEXT]
        if end < addr + size:
            blocks[end] = [addr + size - end, addr, nxt, _FREE, free_list, rng]
            if nxt is not None:
                blocks[nxt][_PREV] = end
            block[_NEXT] = nxt = end
            insort(free_list, (addr + size - end) << _SHIFT | end)
        if begin > addr:
            blocks[begin] = [end - begin, addr, nxt, _UNMAPPED, free_list, rng]
            if nxt is not None:
                blocks[nxt][_PREV] = begin
            block[_NEXT] = begin
            block[_SIZE] = begin - addr
            insort(free_list, (begin - addr) << _SHIFT | addr)
        else:
            block[_SIZE] = end - begin
            block[_STATE] = _UNMAPPED
        self.reserved -= end - begin
        # merge the unmapped piece with unmapped neighbours
        u = begin
        ublock = blocks[u]
        prev = ublock[_PREV]
        if prev is not None and blocks[prev][_STATE] == _UNMAPPED:
            self._absorb_next(prev)
            u, ublock = prev, blocks[prev]
        else:
            insort(unmapped, u)
        nxt = ublock[_NEXT]
        if nxt is not None and blocks[nxt][_STATE] == _UNMAPPED:
            del unmapped[bisect_left(unmapped, nxt)]
            self._absorb_next(u)
        if ublock[_PREV] is None and ublock[_NEXT] is None:
            # release_expandable_segment: nothing mapped is left, the range goes back
            del unmapped[bisect_left(unmapped, u)]
            del blocks[u]
            del self._ranges[rng.base]
        return True

    def empty_cache(self) -> None:
        self._unmap_all()

    def release_segment(self, addr: int, size: int, stream: int = 0) -> None:
        """A recorded ``segment_free`` means the recording ran ``empty_cache()`` (or released
        cached memory before an OOM retry): unmap the free pages, as that would here."""
        self._unmap_all()

    def note_segment_map(self, addr: int, size: int, stream: int = 0) -> None:
        """A recorded ``segment_map`` at ``addr``: a new range the next request needs starts there."""
        if addr is not None:
            self._map_hints.append((addr, stream))

    def unmap_range(self, addr: int, size: int, stream: int = 0) -> None:
        """A recorded ``segment_unmap`` of ``[addr, addr + size)``: the free pages there go back."""
        end = addr + size
        for free_list in list(self._free.values()):
            for key in list(free_list):
                start = key & _MASK
                if start < end and start + (key >> _SHIFT) > addr and start in self._blocks \
                        and self._blocks[start][_STATE] == _FREE:
                    self._unmap(start, addr, end)

    def restore(self, layout: Layout) -> None:
        """Start from ``layout``: its ranges as :func:`restore_ranges` plans them."""
        self._reset()
        states = (_FREE, _LIVE, _UNMAPPED)
        for base, size, page, stream, small, fixed, pieces in restore_ranges(layout, self._page_size, self.range_size):
            free_list, unmapped = self._lists(stream, small)
            rng = _Range(base, size, page, stream, small, fixed)
            self._ranges[base] = rng
            prev = None
            for addr, psize, state in pieces:
                self._blocks[addr] = [psize, prev, None, states[state], free_list, rng]
                if prev is not None:
                    self._blocks[prev][_NEXT] = addr
                prev = addr
                if state == 2:
                    insort(unmapped, addr)
                    continue
                self.reserved += psize
                if state == 1:
                    self.allocated += psize
                else:
                    insort(free_list, psize << _SHIFT | addr)
            self._next_base = max(self._next_base, base + size)
        self._next_base = (self._next_base + GIB - 1) // GIB * GIB
        self._note_usage()

    # --- state ----------------------------------------------------------------------------
    def layout(self) -> Layout:
        blocks = self._blocks
        segments = []
        for base in sorted(self._ranges):
            rng = self._ranges[base]
            pool = "small" if rng.small else "large"
            run: list[Block] = []
            addr = base
            while addr is not None:
                block = blocks[addr]
                if block[_STATE] == _UNMAPPED:
                    if run:
                        segments.append(Segment(run[0].addr, run[-1].end - run[0].addr, run,
                                                stream=rng.stream, pool=pool))
                        run = []
                else:
                    run.append(Block(addr, block[_SIZE], block[_STATE] == _LIVE))
                addr = block[_NEXT]
            if run:
                segments.append(Segment(run[0].addr, run[-1].end - run[0].addr, run, stream=rng.stream, pool=pool))
        return Layout(segments, capacity=self.capacity)

    def largest_free(self) -> int:
        return max((fl[-1] >> _SHIFT for fl in self._free.values() if fl), default=0)

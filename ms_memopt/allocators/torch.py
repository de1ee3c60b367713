"""PyTorch's CUDA caching allocator (and torch_npu's NPUCachingAllocator, a port of it).

Rules (c10/cuda/CUDACachingAllocator.cpp, default settings; docs/torch.md lists what was
verified against recorded snapshots):

* requests round up to a multiple of 512 B (``roundup_power2_divisions`` instead rounds up to
  the next of ``d`` equal steps between two powers of two);
* rounded requests <= 1 MiB use the *small* pool, larger ones the *large* pool; pools are per
  stream; a request takes the smallest cached block that fits, lowest address on ties;
* no cached block: a new segment of 2 MiB (small), 20 MiB (1 MiB < request < 10 MiB) or the
  request rounded up to 2 MiB;
* a block is split when the remainder is >= 512 B (small pool) or > 1 MiB (large pool, and
  only for requests below ``max_split_size``); freed blocks merge with free neighbours of the
  same segment only;
* ``max_split_size_mb``: requests below it never take a cached block at or above it; larger
  requests take a cached block only if it is < request + 20 MiB;
* when a new segment does not fit in ``capacity``: release cached oversize blocks (with
  ``max_split_size_mb``), retry; release every cached unsplit segment, retry (PyTorch counts
  this one in ``num_alloc_retries``; here ``slow_path_events``); then OOM;
* ``garbage_collection_threshold`` (with a capacity, PyTorch's per-process memory fraction):
  before a new segment is asked for, when reserved memory exceeds ``threshold * capacity``,
  cached unsplit large blocks are released, those idle for at least the average *age* first
  (age: free-block lookups in their pool since the block became free), in (stream, size,
  address) order, repeated until the excess is reclaimed (``garbage_collect_cached_blocks``).

Data structures (chosen for replay speed, docs/torch.md): blocks live in one dict keyed by
address, each a small list ``[size, prev_addr, next_addr, live, free_list]``; every
(stream, pool) has a free list of int keys ``size << 64 | addr`` kept sorted with ``bisect``,
so best fit with lowest-address ties is one ``bisect_left``.

Example:
    >>> m = TorchCachingAllocator()
    >>> a = m.malloc(4000); b = m.malloc(4000)
    >>> b - a, m.reserved                     # 4000 B round to 4096; one 2 MiB small segment
    (4096, 2097152)
    >>> m.free(a); m.malloc(3000) == a        # best fit reuses the freed block
    True
"""
from __future__ import annotations

from bisect import bisect_left, insort

from ms_memopt.allocators.base import AllocatorModel
from ms_memopt.core.errors import InputError
from ms_memopt.core.layout import Block, Layout, Segment

__all__ = ["TorchCachingAllocator", "round_size", "allocation_size", "check_divisions"]

MiB = 1 << 20
MIN_BLOCK = 512                 # kMinBlockSize
SMALL_SIZE = 1 * MiB            # kSmallSize: largest small-pool request
SMALL_BUFFER = 2 * MiB          # kSmallBuffer: small-pool segment
LARGE_BUFFER = 20 * MiB         # kLargeBuffer: segment for 1-10 MiB requests
MIN_LARGE_ALLOC = 10 * MiB      # kMinLargeAlloc
ROUND_LARGE = 2 * MiB           # kRoundLarge
ADDRESS_BASE = 1 << 40          # where the model places segments it picks itself
_SHIFT = 64                     # free-list key: size << 64 | addr (addresses < 2**64)
_MASK = (1 << _SHIFT) - 1

# positions in a block record
_SIZE, _PREV, _NEXT, _LIVE, _POOL = range(5)


def round_size(size: int, divisions: int = 0) -> int:
    """Round a request like ``round_size()``: 512-byte multiples, or power-of-two divisions.

    Example:
        >>> round_size(1), round_size(1000), round_size(5 * MiB + 1)
        (512, 1024, 5243392)
        >>> round_size(5 * MiB + 1, divisions=4)   # steps of 1 MiB between 4 and 8 MiB
        6291456
    """
    if size < MIN_BLOCK:
        return MIN_BLOCK
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return (size + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK


def pool_of_request(size: int, pad: int = 0, divisions: int = 0) -> str:
    """``"small"`` or ``"large"``: the pool PyTorch's (and torch_npu's) allocator serves a request
    of ``size`` bytes from (``get_pool``: its rounded size up to kSmallSize, 1 MiB, is small).

    Example:
        >>> pool_of_request(1 << 20), pool_of_request((1 << 20) + 1)
        ('small', 'large')
    """
    return "small" if round_size(size + pad, divisions) <= SMALL_SIZE else "large"


def serving_pool(model, size: int, stream: int = 0, tag: str | None = None) -> str:
    """:meth:`AllocatorModel.serving_pool` of the PyTorch-family models and their compiled twins."""
    return pool_of_request(size, model.pad, model.divisions)


def check_divisions(divisions: int | None) -> None:
    """Raise :class:`InputError` unless ``divisions`` is ``None`` or a power of two >= 1."""
    d = divisions
    if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1 or d & (d - 1)):
        raise InputError(f"must be a power of two >= 1, got {d!r}", key="roundup_power2_divisions")


def allocation_size(rounded: int) -> int:
    """The segment size the allocator asks the driver for when nothing cached fits.

    Example:
        >>> [allocation_size(s) // MiB for s in (512, 2 * MiB, 12 * MiB + 512)]
        [2, 20, 14]
    """
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return (rounded + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE



def is_small_segment(seg: Segment) -> bool:
    """Whether a recorded segment belongs to the small pool: its ``pool`` when the recording
    says, else a segment of exactly :data:`SMALL_BUFFER` bytes (2 MiB)."""
    return seg.pool == "small" if seg.pool in ("small", "large") else seg.size == SMALL_BUFFER

def merged_blocks(seg: Segment) -> list[tuple[int, int, bool]]:
    """``(addr, size, live)`` of a recorded segment's blocks in order, free neighbours merged
    (one free block when the segment lists none)."""
    out: list[tuple[int, int, bool]] = []
    for b in seg.blocks or [Block(seg.addr, seg.size, False)]:
        if out and not b.live and not out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1] + b.size, False)
        else:
            out.append((b.addr, b.size, b.live))
    return out


class TorchCachingAllocator(AllocatorModel):
    """PyTorch's caching allocator; see the module docstring for the rules.

    Args:
        capacity: device memory in bytes (``None``: unbounded).
        max_split_size_mb: ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N`` (N > 20), or ``None``.
        roundup_power2_divisions: ``roundup_power2_divisions:D`` (a power of two), or ``None``.
        garbage_collection_threshold: ``garbage_collection_threshold:T`` (0 < T < 1), or
            ``None``; acts only with a ``capacity`` (PyTorch: only with a memory fraction set).
    """

    name = "torch"
    #: bytes added to a request before rounding (torch_npu's ``round_size`` pads 32; CUDA none)
    pad = 0
    serving_pool = serving_pool

    def __init__(self, capacity: int | None = None, max_split_size_mb: int | None = None,
                 roundup_power2_divisions: int | None = None,
                 garbage_collection_threshold: float | None = None) -> None:
        super().__init__(capacity)
        gc = garbage_collection_threshold
        if gc is not None and (isinstance(gc, bool) or not isinstance(gc, (int, float)) or not 0.0 < gc < 1.0):
            raise InputError(f"must be a number in (0, 1), got {gc!r}", key="garbage_collection_threshold")
        self.gc_threshold = None if gc is None else float(gc)
        if max_split_size_mb is not None:
            if isinstance(max_split_size_mb, bool) or not isinstance(max_split_size_mb, int) \
                    or max_split_size_mb <= LARGE_BUFFER // MiB:
                raise InputError(f"must be an integer > {LARGE_BUFFER // MiB} (MiB), got {max_split_size_mb!r}",
                                 key="max_split_size_mb")
        check_divisions(roundup_power2_divisions)
        self.max_split_size = None if max_split_size_mb is None else max_split_size_mb * MiB
        self.divisions = roundup_power2_divisions or 0
        self._reset()

    def _reset(self) -> None:
        self.reserved = 0
        self.allocated = 0
        self._blocks: dict[int, list] = {}
        self._pools: dict[tuple[int, bool], list[int]] = {}
        self._segments: dict[int, tuple[int, int, bool]] = {}   # addr -> (size, stream, small)
        self._segment_addrs: list[int] = []                      # sorted
        self._recorded: list[tuple[int, int, int]] = []          # (addr, size, stream) for the next request
        # garbage collection only: free-block lookups per pool, and each free block's count when it became free
        self._lookups: dict[tuple[int, bool], int] = {}
        self._freed_at: dict[int, int] = {}

    # --- requests -----------------------------------------------------------------------
    def malloc(self, size: int, *, stream: int = 0, pool: str | None = None,
               tag: str | None = None) -> int | None:
        padded = size + self.pad
        if self.divisions:
            rsize = round_size(padded, self.divisions)
        elif padded < MIN_BLOCK:
            rsize = MIN_BLOCK
        else:
            rsize = (padded + 511) & ~511
        small = rsize <= SMALL_SIZE
        free_list = self._pools.get((stream, small))
        if free_list is None:
            free_list = self._pools[(stream, small)] = []
        blocks = self._blocks
        addr = None
        if self.gc_threshold is not None:
            self._lookups[(stream, small)] = self._lookups.get((stream, small), 0) + 1
        i = bisect_left(free_list, rsize << _SHIFT)
        if i < len(free_list):
            bsize = free_list[i] >> _SHIFT
            ms = self.max_split_size
            if ms is None or not ((rsize < ms and bsize >= ms) or (rsize >= ms and bsize >= rsize + LARGE_BUFFER)):
                addr = free_list.pop(i) & _MASK
        if addr is None:
            addr = self._grow(rsize, small, stream, free_list)
            if self._recorded:
                self._recorded.clear()
            if addr is None:
                self._record_oom(size, stream, tag)
                return None
        block = blocks[addr]
        remaining = block[_SIZE] - rsize
        if (remaining >= MIN_BLOCK) if small else (
                remaining > SMALL_SIZE and (self.max_split_size is None or rsize < self.max_split_size)):
            rest = addr + rsize
            nxt = block[_NEXT]
            blocks[rest] = [remaining, addr, nxt, False, free_list]
            if nxt is not None:
                blocks[nxt][_PREV] = rest
            block[_NEXT] = rest
            block[_SIZE] = rsize
            insort(free_list, remaining << _SHIFT | rest)
        block[_LIVE] = True
        self.allocated += block[_SIZE]
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return addr

    def free(self, addr: int) -> None:
        blocks = self._blocks
        block = blocks.get(addr)
        if block is None or not block[_LIVE]:
            return
        block[_LIVE] = False
        size = block[_SIZE]
        self.allocated -= size
        free_list = block[_POOL]
        prev = block[_PREV]
        if prev is not None:
            pblock = blocks[prev]
            if not pblock[_LIVE]:
                psize = pblock[_SIZE]
                del free_list[bisect_left(free_list, psize << _SHIFT | prev)]
                size += psize
                nxt = block[_NEXT]
                pblock[_NEXT] = nxt
                if nxt is not None:
                    blocks[nxt][_PREV] = prev
                del blocks[addr]
                addr, block = prev, pblock
        nxt = block[_NEXT]
        if nxt is not None:
            nblock = blocks[nxt]
            if not nblock[_LIVE]:
                nsize = nblock[_SIZE]
                del free_list[bisect_left(free_list, nsize << _SHIFT | nxt)]
                size += nsize
                after = nblock[_NEXT]
                block[_NEXT] = after
                if after is not None:
                    blocks[after][_PREV] = addr
                del blocks[nxt]
        block[_SIZE] = size
        insort(free_list, size << _SHIFT | addr)
        if self.gc_threshold is not None:
            self._freed_at[addr] = self._lookups.get(self._pool_key(free_list), 0)

    # --- segments -------------------------------------------------------------------------
    def _grow(self, rsize: int, small: bool, stream: int, free_list: list[int]) -> int | None:
        """alloc_block with the caching allocator's two retries; the new segment's address."""
        seg_size = self._segment_size(rsize, small)
        if self.gc_threshold is not None and self.capacity is not None:
            self._garbage_collect()
        addr = self._new_segment(seg_size, stream, small, free_list)
        if addr is None and self.max_split_size is not None and self._release_oversize(rsize, free_list):
            addr = self._new_segment(seg_size, stream, small, free_list)
        if addr is None and self._release_cached():
            self.slow_path_events += 1
            addr = self._new_segment(seg_size, stream, small, free_list)
        if addr is not None:
            # the new block is handed out directly, not through the free list
            del free_list[bisect_left(free_list, seg_size << _SHIFT | addr)]
        return addr

    def _segment_size(self, rsize: int, small: bool) -> int:
        """The size of the segment asked for when nothing cached fits (:func:`allocation_size`)."""
        return allocation_size(rsize)

    def _new_segment(self, size: int, stream: int, small: bool, free_list: list[int]) -> int | None:
        if self.capacity is not None and self.reserved + size > self.capacity:
            return None
        addr = None
        for i, (raddr, rsize, rstream) in enumerate(self._recorded):
            if rsize == size and rstream == stream and self._is_unused(raddr, size):
                addr = raddr
                del self._recorded[i]
                break
        if addr is None:
            addr = self._lowest_gap(size)
        self._add_segment(addr, size, stream, small, free_list)
        self.segment_allocs += 1
        return addr

    def _add_segment(self, addr: int, size: int, stream: int, small: bool, free_list: list[int]) -> None:
        self._segments[addr] = (size, stream, small)
        insort(self._segment_addrs, addr)
        self._blocks[addr] = [size, None, None, False, free_list]
        insort(free_list, size << _SHIFT | addr)
        self.reserved += size
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _is_unused(self, addr: int, size: int) -> bool:
        addrs = self._segment_addrs
        i = bisect_left(addrs, addr)
        if i < len(addrs) and addrs[i] < addr + size:
            return False
        if i > 0:
            before = addrs[i - 1]
            if before + self._segments[before][0] > addr:
                return False
        return True

    def _lowest_gap(self, size: int) -> int:
        """The lowest 2 MiB-aligned address from ``ADDRESS_BASE`` where ``size`` bytes are unused."""
        cursor = ADDRESS_BASE
        for start in self._segment_addrs:
            end = start + self._segments[start][0]
            if end <= cursor:
                continue
            if start >= cursor + size:
                break
            cursor = (end + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE
        return cursor

    def _release(self, addr: int) -> None:
        """Give the idle, unsplit segment at ``addr`` back to the device."""
        size, stream, small = self._segments.pop(addr)
        block = self._blocks.pop(addr)
        free_list = block[_POOL]
        del free_list[bisect_left(free_list, size << _SHIFT | addr)]
        del self._segment_addrs[bisect_left(self._segment_addrs, addr)]
        self.reserved -= size

    def _idle(self, addr: int) -> bool:
        block = self._blocks.get(addr)
        return (block is not None and not block[_LIVE] and block[_PREV] is None and block[_NEXT] is None)

    def _release_oversize(self, rsize: int, free_list: list[int]) -> bool:
        """release_available_cached_blocks: free cached blocks >= max_split_size of this pool."""
        ms = self.max_split_size
        target = max(rsize, ms)
        # An oversize block is a whole segment in PyTorch (it is never split), and release_block
        # frees it as one; a state restored from a recording (a profiler capture's tensors placed
        # by guess) can hold an oversize free block inside a split segment: that one stays.
        i = bisect_left(free_list, target << _SHIFT)
        while i < len(free_list) and not self._idle(free_list[i] & _MASK):
            i += 1
        if i < len(free_list):
            self._release(free_list[i] & _MASK)
            return True
        released = 0
        candidates = []
        for key in reversed(free_list):
            if released >= target or (key >> _SHIFT) < ms:
                break
            if not self._idle(key & _MASK):
                continue
            candidates.append(key & _MASK)
            released += key >> _SHIFT
        if released < target:
            return False
        for addr in candidates:
            self._release(addr)
        return True

    def _pool_key(self, free_list: list[int]) -> tuple[int, bool] | None:
        return next((key for key, fl in self._pools.items() if fl is free_list), None)

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks: see the module docstring."""
        threshold = int(self.gc_threshold * self.capacity)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold

        def candidates() -> list[tuple[int, int]]:      # (addr, age) of unsplit cached large blocks
            out = []
            for (stream, small), free_list in sorted(self._pools.items()):
                if small:
                    continue
                lookups = self._lookups.get((stream, small), 0)
                for key in free_list:
                    addr = key & _MASK
                    if self._idle(addr):
                        out.append((addr, lookups - self._freed_at.get(addr, 0)))
            return out

        blocks = candidates()
        if not blocks:
            return
        self.slow_path_events += 1
        reclaimed = 0
        while reclaimed < target and blocks:
            average = sum(age for _, age in blocks) / len(blocks)
            old = [addr for addr, age in blocks if age >= average]
            for addr in old:      # PyTorch does not stop at the target inside one pass
                reclaimed += self._segments[addr][0]
                self._release(addr)
                self._freed_at.pop(addr, None)
            blocks = [(addr, age) for addr, age in blocks if addr in self._segments]

    def _release_cached(self) -> bool:
        """release_cached_blocks: every idle unsplit segment of every pool goes back."""
        idle = [a for a in self._segment_addrs if self._idle(a)]
        for addr in idle:
            self._release(addr)
        return bool(idle)

    def empty_cache(self) -> None:
        self._release_cached()

    def note_segment_alloc(self, addr: int, size: int, stream: int = 0) -> None:
        if addr is not None:
            self._recorded.append((addr, size, stream))

    def release_segment(self, addr: int, size: int, stream: int = 0) -> None:
        """Release the recorded segment if it is idle here; after a divergence, an idle segment
        of the same size and stream stands in for it (the recording released an idle one)."""
        if addr in self._segments and self._idle(addr):
            self._release(addr)
            return
        for start in self._segment_addrs:
            seg_size, seg_stream, _ = self._segments[start]
            if seg_size == size and seg_stream == stream and self._idle(start):
                self._release(start)
                return

    def restore(self, layout: Layout) -> None:
        self._reset()
        for seg in sorted(layout.segments, key=lambda s: s.addr):
            small = is_small_segment(seg)
            free_list = self._pools.setdefault((seg.stream, small), [])
            self._segments[seg.addr] = (seg.size, seg.stream, small)
            insort(self._segment_addrs, seg.addr)
            self.reserved += seg.size
            prev = None
            for addr, size, live in merged_blocks(seg):
                self._blocks[addr] = [size, prev, None, live, free_list]
                if prev is not None:
                    self._blocks[prev][_NEXT] = addr
                prev = addr
                if live:
                    self.allocated += size
            addr = seg.addr
            while addr is not None:
                block = self._blocks[addr]
                if not block[_LIVE]:
                    insort(free_list, block[_SIZE] << _SHIFT | addr)
                addr = block[_NEXT]
        self._note_usage()

    # --- state ----------------------------------------------------------------------------
    def layout(self) -> Layout:
        blocks = self._blocks
        segments = []
        for start in self._segment_addrs:
            size, stream, small = self._segments[start]
            out = []
            addr = start
            while addr is not None:
                block = blocks[addr]
                out.append(Block(addr, block[_SIZE], block[_LIVE]))
                addr = block[_NEXT]
            segments.append(Segment(start, size, out, stream=stream, pool="small" if small else "large"))
        return Layout(segments, capacity=self.capacity)

    def largest_free(self) -> int:
        return max((fl[-1] >> _SHIFT for fl in self._pools.values() if fl), default=0)

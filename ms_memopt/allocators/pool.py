"""Pool mode: device memory planned at start-up in fixed regions by purpose and lifetime.

Each request goes to the region its ``tag`` (or ``pool``) names, never anywhere else, so
long-lived small tensors cannot cut up the space of large short-lived ones:

================  ===================================================  ======================
region            holds (tags)                                         policy inside
================  ===================================================  ======================
``parameters``    BF16 weights                                          best fit (never freed)
``gradients``     FP32 gradient accumulation                            best fit (never freed)
``optimizer``     FP32 master weights, Adam m and v                     best fit (never freed)
``activations``   saved activations, checkpoint inputs, recomputes     ring of chunks, one per
                                                                       micro-batch, each filled
                                                                       from its top down
``communication`` AllReduce / ReduceScatter buckets, P2P buffers,       best fit (the arena)
                  MoE all-to-all buffers
``workspace``     op workspaces, weight gradients, optimizer temps,    best fit
                  evaluation, checkpoint staging, logging
``workspace.cache`` per-shape cached tensors                           FIFO ring; when full the
                                                                       oldest entry is evicted
================  ===================================================  ======================

A cache can always rebuild an entry, so the ``workspace.cache`` region evicts its oldest tensors instead
of failing (the evicted addresses are reported by :meth:`PoolModeAllocator.drain_evicted` so a
driver can forget them). Every other region fails its request when full: a pool-mode OOM
names a region sized too small, not fragmentation elsewhere.

The layout has one segment per region (``segment.pool`` is the region name);
:meth:`PoolModeAllocator.region_metrics` gives the frag ratio inside each region. The
device-wide frag ratio is high by design: free space is split across regions.

Example:
    >>> pool = PoolModeAllocator(capacity=2**20, regions={"activations": 2**19, "workspace": 2**18})
    >>> a = pool.malloc(1000, tag="activation"); b = pool.malloc(1000, tag="activation")
    >>> b - a, pool.malloc(2**19, tag="activation")
    (1024, None)
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict

from ms_memopt.allocators.base import AllocatorModel
from ms_memopt.core.errors import InputError
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.core.metrics import frag_ratio

__all__ = ["REGION_OF_TAG", "PoolModeAllocator"]

_ALIGN = 512
_SHIFT = 64
_MASK = (1 << _SHIFT) - 1
_BASE_ADDR = 1 << 32
_ADDR, _SIZE, _USED, _PREV, _NEXT = range(5)

#: which region serves which request tag (anything else: ``workspace``)
REGION_OF_TAG = {
    "parameter": "parameters", "gradient": "gradients",
    "optimizer": "optimizer",
    "activation": "activations", "checkpoint_input": "activations", "recompute": "activations",
    "allreduce": "communication", "reduce_scatter": "communication", "allgather": "communication",
    "p2p": "communication", "alltoall": "communication",
    "shape_cache": "workspace.cache",
}
_RING = {"activations"}
_EVICTING = {"workspace.cache"}


class _Region:
    """One fixed region: buffers doubly linked by address, free ones in a sorted key list."""

    def __init__(self, name: str, addr: int, size: int, chunked: bool = False) -> None:
        self.name = name
        self.addr = addr
        self.size = size
        # chunked: a ring of chunks, one per micro-batch, each filled from its top down
        self.chunked = chunked
        self.stack_top: int | None = None     # chunked: next allocation ends here
        self.stack_floor = addr               # ... and may not start below the chunk's start
        self.allocated = 0
        head = [addr, size, False, None, None]
        self.bufs: dict[int, list] = {addr: head}
        self.free_keys: list[int] = [(size << _SHIFT) | addr] if size else []
        self.head = addr                      # ring: next allocation (chunked: next chunk) address
        self.order: OrderedDict[int, int] = OrderedDict()   # evicting: live addr -> size, oldest first
        self.evicting = self.ring = False     # set by PoolModeAllocator: evicting cache, ring
        if not size:
            self.bufs = {}

    def largest_free(self) -> int:
        return self.free_keys[-1] >> _SHIFT if self.free_keys else 0

    def size_of(self, addr: int) -> int:
        """Bytes of the buffer at ``addr``."""
        return self.bufs[addr][_SIZE]

    def take(self, size: int, ring: bool, fallback: bool = True) -> int | None:
        """Allocate ``size`` bytes: at the ring head when ``ring``, else (or when the head has
        no room and ``fallback``) best fit; the address, or ``None``."""
        buf = None
        stacked = False
        if ring:
            if self.chunked:
                buf = self._stack_buffer(size)
                stacked = buf is not None
            else:
                buf = self._ring_buffer(size)
            if buf is None and not fallback:
                return None
        if buf is None:
            index = bisect_left(self.free_keys, size << _SHIFT)
            if index == len(self.free_keys):
                return None
            buf = self.bufs[self.free_keys.pop(index) & _MASK]
        else:
            del self.free_keys[bisect_left(self.free_keys, (buf[_SIZE] << _SHIFT) | buf[_ADDR])]
        rest = buf[_SIZE] - size
        if rest >= _ALIGN:
            nxt = buf[_NEXT]
            tail = [buf[_ADDR] + size, rest, False, buf, nxt]
            if nxt is not None:
                nxt[_PREV] = tail
            buf[_NEXT] = tail
            buf[_SIZE] = size
            self.bufs[tail[_ADDR]] = tail
            insort(self.free_keys, (rest << _SHIFT) | tail[_ADDR])
        buf[_USED] = True
        self.allocated += buf[_SIZE]
        if stacked:
            self.stack_top = buf[_ADDR]
        elif ring and not self.chunked:
            self.head = buf[_ADDR] + buf[_SIZE]
            if self.head >= self.addr + self.size:
                self.head = self.addr
        return buf[_ADDR]

    def open_chunk(self, size: int) -> None:
        """A micro-batch's forward starts and will keep ``size`` bytes here: its chunk goes at
        the head, else at the region start (wrap); ``size`` 0 or no room: best fit instead.

        The chunk fills from its top down, so the backward, which frees the last-saved tensor
        first, frees from the chunk's bottom, next to the free space the older micro-batches
        left: with 1F1B's first-in-first-out micro-batches the free space stays in at most two
        pieces (before and after the wrap)."""
        self.stack_top = None
        if size <= 0:
            return
        for start in (self.head, self.addr):
            buf = self._free_buffer_at(start)
            if buf is not None and buf[_ADDR] + buf[_SIZE] - start >= size:
                self.stack_top, self.stack_floor = start + size, start
                self.head = start + size if start + size < self.addr + self.size else self.addr
                return

    def close_chunk(self) -> None:
        """The forward is over: what follows (recompute in the backward) takes best fit."""
        self.stack_top = None

    def _stack_buffer(self, size: int) -> list | None:
        """The free range just below the open chunk's top, carved out; ``None`` when no chunk
        is open or the request does not fit in it."""
        if self.stack_top is None or self.stack_top - size < self.stack_floor:
            return None
        return self._carve(self.stack_top - size, size)

    def _free_buffer_at(self, addr: int) -> list | None:
        """The free buffer that contains ``addr``, or ``None``."""
        buf = self.bufs.get(addr)
        if buf is not None:
            return None if buf[_USED] else buf
        for key in self.free_keys:
            buf = self.bufs[key & _MASK]
            if buf[_ADDR] < addr < buf[_ADDR] + buf[_SIZE]:
                return buf
        return None

    def _ring_buffer(self, size: int) -> list | None:
        """The free buffer starting at the head, else the one at the region start (wrap)."""
        for addr in (self.head, self.addr):
            buf = self.bufs.get(addr)
            if buf is not None and not buf[_USED] and buf[_SIZE] >= size:
                return buf
        return None

    def _carve(self, addr: int, size: int) -> list | None:
        """Split the free buffer that contains ``addr`` there (its low part stays free) when
        ``size`` bytes fit from ``addr`` on; the caller takes the returned high part at once,
        so two free buffers are never left side by side."""
        buf = self._free_buffer_at(addr)
        if buf is None or buf[_ADDR] + buf[_SIZE] - addr < size:
            return None
        if buf[_ADDR] == addr:
            return buf
        start, length = buf[_ADDR], buf[_SIZE]
        del self.free_keys[bisect_left(self.free_keys, (length << _SHIFT) | start)]
        high = [addr, start + length - addr, False, buf, buf[_NEXT]]
        if buf[_NEXT] is not None:
            buf[_NEXT][_PREV] = high
        buf[_NEXT] = high
        buf[_SIZE] = addr - start
        self.bufs[addr] = high
        insort(self.free_keys, (buf[_SIZE] << _SHIFT) | start)
        insort(self.free_keys, (high[_SIZE] << _SHIFT) | addr)
        return high

    def release(self, addr: int) -> int:
        buf = self.bufs.get(addr)
        if buf is None or not buf[_USED]:
            return 0
        freed = buf[_SIZE]
        self.allocated -= freed
        buf[_USED] = False
        keys = self.free_keys
        prev = buf[_PREV]
        if prev is not None and not prev[_USED]:
            del keys[bisect_left(keys, (prev[_SIZE] << _SHIFT) | prev[_ADDR])]
            prev[_SIZE] += buf[_SIZE]
            prev[_NEXT] = buf[_NEXT]
            if buf[_NEXT] is not None:
                buf[_NEXT][_PREV] = prev
            del self.bufs[addr]
            if self.head == addr:
                self.head = prev[_ADDR]
            buf = prev
        nxt = buf[_NEXT]
        if nxt is not None and not nxt[_USED]:
            del keys[bisect_left(keys, (nxt[_SIZE] << _SHIFT) | nxt[_ADDR])]
            buf[_SIZE] += nxt[_SIZE]
            buf[_NEXT] = nxt[_NEXT]
            if nxt[_NEXT] is not None:
                nxt[_NEXT][_PREV] = buf
            del self.bufs[nxt[_ADDR]]
            if self.head == nxt[_ADDR]:
                self.head = buf[_ADDR]
        insort(keys, (buf[_SIZE] << _SHIFT) | buf[_ADDR])
        return freed

    def segment(self) -> Segment:
        blocks = []
        buf = self.bufs.get(self.addr)
        while buf is not None:
            blocks.append(Block(buf[_ADDR], buf[_SIZE], buf[_USED], tag=self.name))
            buf = buf[_NEXT]
        return Segment(self.addr, self.size, blocks, pool=self.name)


class PoolModeAllocator(AllocatorModel):
    """Fixed regions reserved at start-up (see the module docstring).

    Args:
        capacity: device bytes; the regions must fit in it.
        regions: a :class:`ms_memopt.core.poolplan.PoolPlan` (its regions in address order; a
            region with ``ring`` set is a ring), or region name -> bytes.
        route: overrides of :data:`REGION_OF_TAG`.

    Raises:
        InputError: the regions do not fit in ``capacity``.
    """

    name = "pool"
    pools_per_stream = False

    def serving_pool(self, size: int, stream: int = 0, tag: str | None = None) -> str | None:
        """The region a request with ``tag`` goes to (never anywhere else): its route, or the
        workspace (the request's ``pool`` is not known here; :meth:`region_for` has the whole rule)."""
        name = self.route.get(tag or "") or "workspace"
        return name if name in self.regions else ("workspace" if "workspace" in self.regions else None)
    #: the region type (ms_memopt.allocators.fast has a compiled one with the same methods;
    #: its FastPoolModeAllocator repeats :meth:`region_for`, :meth:`malloc` and :meth:`free` in
    #: C, so a change of their rules, or of _Region's, goes to ms_memopt/allocators/fast/pool.c
    #: too: tests/test_fastpool.py fails until it does)
    region_class = _Region

    @staticmethod
    def supports(options: dict) -> bool:
        return True

    def __init__(self, capacity: int | None = None, regions=None, route: dict[str, str] | None = None,
                 chunked: bool = False) -> None:
        super().__init__(capacity)
        sizes = _region_sizes(regions)
        self._rings = {r.name for r in getattr(regions, "regions", ()) if getattr(r, "ring", False)} or set(_RING)
        total = sum(sizes.values())
        if capacity is not None and total > capacity:
            raise InputError(f"pool-mode regions need {total} bytes, more than the capacity {capacity}",
                             key="memopt.pool_mode")
        offsets = {r.name: r.offset for r in getattr(regions, "regions", ()) if hasattr(r, "offset")}
        self.regions: dict[str, _Region] = {}
        addr = _BASE_ADDR
        for name, size in sizes.items():
            if name in offsets:   # the plan's layout (regions start on its alignment)
                addr = _BASE_ADDR + offsets[name]
            size = size // _ALIGN * _ALIGN
            region = self.regions[name] = self.region_class(name, addr, size, chunked and name in self._rings)
            # what malloc asks of a region on every request, decided once
            region.evicting = name in _EVICTING
            region.ring = region.evicting or name in self._rings
            addr += size
        self.route = dict(REGION_OF_TAG, **(route or {}))
        self._owner: dict[int, _Region] = {}
        self._region_cache: dict[tuple, _Region | None] = {}
        self._evicted: list[int] = []
        self.evictions = 0
        self.reserved = sum(r.size for r in self.regions.values())
        self.segment_allocs = len(self.regions)
        self._note_usage()

    # --- requests -----------------------------------------------------------------------
    def region_for(self, tag: str | None, pool: str | None) -> _Region | None:
        """The region serving a request: by ``tag``, else a region named ``pool``, else the
        workspace."""
        key = (tag, pool)
        region = self._region_cache.get(key)
        if region is None:
            name = self.route.get(tag or "", None) or (pool if pool in self.regions else None) or "workspace"
            region = self._region_cache[key] = self.regions.get(name) or self.regions.get("workspace")
        return region

    def malloc(self, size: int, *, stream: int = 0, pool: str | None = None,
               tag: str | None = None) -> int | None:
        size = (size + _ALIGN - 1) // _ALIGN * _ALIGN if size > _ALIGN else _ALIGN
        region = self._region_cache.get((tag, pool)) or self.region_for(tag, pool)
        if region is None:
            self._record_oom(size, stream, tag)
            return None
        # the cache is a strict FIFO ring: new entries at the head, the oldest (just ahead of
        # the head) evicted to make room, so its free space stays in at most two pieces
        evicting, ring = region.evicting, region.ring
        addr = region.take(size, ring, fallback=not evicting)
        if addr is None and evicting:
            while addr is None and region.order:
                old, _ = region.order.popitem(last=False)
                self.allocated -= region.release(old)
                del self._owner[old]
                self._evicted.append(old)
                self.evictions += 1
                addr = region.take(size, ring, fallback=False)
            if addr is None:   # larger than the whole region's free space in ring order
                addr = region.take(size, False)
        if addr is None:
            self._record_oom(size, stream, tag)
            return None
        if evicting:
            region.order[addr] = size
        self._owner[addr] = region
        self.allocated += region.size_of(addr)
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return addr

    def free(self, addr: int) -> None:
        region = self._owner.pop(addr, None)
        if region is None:
            return
        region.order.pop(addr, None)
        self.allocated -= region.release(addr)

    def note_mark(self, tag: str | None, size: int = 0) -> None:
        """A ``mark`` of the stream: ``"forward:M"`` (``size``: the bytes micro-batch M will keep)
        opens M's chunk in each chunked ring; ``"backward:M"`` closes it."""
        if not tag or ":" not in tag:
            return
        phase = tag.partition(":")[0]
        if phase not in ("forward", "backward"):
            return
        for name in self._rings:
            region = self.regions.get(name)
            if region is not None and region.chunked:
                if phase == "forward":
                    region.open_chunk(size)
                else:
                    region.close_chunk()

    def drain_evicted(self) -> list[int]:
        """Addresses the cache region evicted since the last call (their tensors are gone)."""
        out, self._evicted = self._evicted, []
        return out

    # --- state ----------------------------------------------------------------------------
    def layout(self) -> Layout:
        return Layout([r.segment() for r in self.regions.values() if r.size], capacity=self.capacity)

    def largest_free(self) -> int:
        return max((r.largest_free() for r in self.regions.values()), default=0)

    def region_metrics(self) -> dict[str, float | None]:
        """Frag ratio inside each region (``None`` when the region has nothing free)."""
        return {name: frag_ratio(r.size - r.allocated, r.largest_free()) for name, r in self.regions.items()}


def _region_sizes(regions) -> dict[str, int]:
    if regions is None:     # an InputError (a ValueError): whatever chose the pool model gave no sizes
        raise InputError("the pool model needs region sizes from a recipe (memopt.pool); replay and templates "
                         "carry none: choose another allocator", key="--allocator")
    if isinstance(regions, dict):
        return {str(k): int(v) for k, v in regions.items()}
    items = getattr(regions, "regions", regions)
    if isinstance(items, dict):
        return {str(k): int(getattr(v, "size", v)) for k, v in items.items()}
    return {str(r.name): int(r.size) for r in items}

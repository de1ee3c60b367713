"""The address-space layout of a memory pool: segments holding blocks.

A *segment* is one piece of device memory the pool got from the driver (MindSpore calls it a
pool *block*, PyTorch a *segment*). Inside it, *blocks* tile the whole range, each either live
(held by a tensor) or free. Free ranges of different segments never merge: a request can only
be served from a hole inside one segment. Models that map virtual memory (MindSpore VMM,
PyTorch expandable segments) export their whole virtual range as one segment, so their holes
span what physical pages would back.

All addresses and sizes are bytes. Layouts are plain records: allocator models produce them,
:mod:`ms_memopt.core.metrics` measures them, the compaction planner rearranges copies of them.

Example:
    >>> seg = Segment(addr=0, size=1024, blocks=[Block(0, 512, live=True), Block(512, 512, live=False)])
    >>> Layout([seg]).reserved
    1024
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

__all__ = ["Block", "Segment", "Layout", "DEVICE_ADDRESS_LIMIT"]

#: Sizes and addresses of any real device end below this (2**48 bytes, 256 TiB); readers and
#: the replay engine refuse larger values as bad input.
DEVICE_ADDRESS_LIMIT = 1 << 48


@dataclass(slots=True)
class Block:
    """A contiguous range inside a segment: live (held by a tensor) or free.

    ``id`` is the tensor/handle id when known; ``pinned`` marks a live block that must not be
    moved (in use by a pending stream or collective); ``tag`` says what it holds
    (``"activation"``, ``"allreduce"``, ...).
    """

    addr: int
    size: int
    live: bool
    id: int | None = None
    tag: str | None = None
    pinned: bool = False

    @property
    def end(self) -> int:
        return self.addr + self.size


@dataclass(slots=True)
class Segment:
    """One range of device memory held by the pool; its blocks tile ``[addr, addr + size)``.

    ``pool`` names the allocator inside the model (``"common"``, ``"persistent"``, ``"small"``,
    ``"large"``, or a pool-mode region such as ``"parameters"``); ``stream`` the stream it serves.
    """

    addr: int
    size: int
    blocks: list[Block] = field(default_factory=list)
    stream: int = 0
    pool: str = "common"

    @property
    def end(self) -> int:
        return self.addr + self.size

    @property
    def allocated(self) -> int:
        return sum(b.size for b in self.blocks if b.live)

    def holes(self) -> Iterator[Block]:
        """The free blocks, low to high address."""
        return (b for b in self.blocks if not b.live)


@dataclass(slots=True)
class Layout:
    """A whole pool at one moment: its segments, sorted by address, and the device capacity.

    ``capacity`` is the device memory the pool may use in total (``None`` when unbounded);
    ``device_free = capacity - reserved`` is memory not yet taken from the device.
    ``expandable``: the segments are the mapped runs of virtual ranges that grow and shrink by
    pages (PyTorch's and torch_npu's expandable segments, as their snapshots report them), so a
    model with such ranges starts from them as ranges, not as fixed segments.
    """

    segments: list[Segment] = field(default_factory=list)
    capacity: int | None = None
    expandable: bool = False

    @property
    def reserved(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def allocated(self) -> int:
        return sum(s.allocated for s in self.segments)

    @property
    def device_free(self) -> int | None:
        return None if self.capacity is None else max(self.capacity - self.reserved, 0)

    def blocks(self) -> Iterator[Block]:
        for seg in self.segments:
            yield from seg.blocks

    def live_blocks(self) -> Iterator[Block]:
        return (b for b in self.blocks() if b.live)

    def hole_sizes(self) -> list[int]:
        return [b.size for seg in self.segments for b in seg.holes()]

    def check(self) -> None:
        """Raise ``AssertionError`` unless every segment is tiled exactly by its blocks, no two
        free blocks are adjacent inside a segment, and segments do not overlap."""
        last_end = None
        for seg in sorted(self.segments, key=lambda s: s.addr):
            assert last_end is None or seg.addr >= last_end, f"segment {seg.addr:#x} overlaps its neighbour"
            last_end = seg.end
            cursor = seg.addr
            previous_free = False
            for block in seg.blocks:
                assert block.addr == cursor, f"gap or overlap at {cursor:#x} in segment {seg.addr:#x}"
                assert block.size > 0, f"empty block at {block.addr:#x}"
                assert not (previous_free and not block.live), f"adjacent free blocks at {block.addr:#x}"
                previous_free = not block.live
                cursor = block.end
            assert cursor == seg.end, f"blocks of segment {seg.addr:#x} end at {cursor:#x}, not {seg.end:#x}"

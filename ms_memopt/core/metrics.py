"""The fragmentation metrics, as pure functions of a :class:`~ms_memopt.core.layout.Layout`.

Names are the project's vocabulary (docs/metrics.md), used unchanged in logs, JSON and plots:

* ``reserved`` — bytes the pool holds from the device; ``allocated`` — bytes in live tensors.
* ``free_total`` — reserved bytes not held by live tensors (``reserved - allocated``).
* ``device_free`` — device memory not yet reserved (``capacity - reserved``), when known.
* ``largest_free`` — the largest hole inside one segment: the biggest request that fits
  without growing the pool.
* ``frag_ratio = free_total / largest_free - 1`` — 0 when all free memory is one hole,
  ``None`` when nothing is free.
* ``utilization = allocated / reserved`` (``None`` when nothing is reserved).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable

from ms_memopt.core.layout import Layout

__all__ = ["LayoutMetrics", "measure", "frag_ratio", "hole_histogram", "fits", "pool_largest_free"]


@dataclass(frozen=True, slots=True)
class LayoutMetrics:
    """One measurement of a layout; every size in bytes."""

    reserved: int
    allocated: int
    free_total: int
    largest_free: int
    frag_ratio: float | None
    utilization: float | None
    device_free: int | None = None
    holes: int = 0
    hole_histogram: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def frag_ratio(free_total: int, largest_free: int) -> float | None:
    """``free_total / largest_free - 1``; ``None`` when nothing is free.

    Example:
        >>> frag_ratio(14 * 2**30, 3 * 2**30)
        3.666666666666667
        >>> frag_ratio(0, 0) is None
        True
    """
    if free_total <= 0 or largest_free <= 0:
        return None
    return free_total / largest_free - 1.0


def hole_histogram(hole_sizes: Iterable[int]) -> dict[str, int]:
    """Count holes by power-of-two size class, keyed by the class's lower bound in bytes.

    A hole of ``s`` bytes falls in class ``2**floor(log2(s))``; keys are decimal strings so the
    histogram survives a JSON round trip unchanged.

    Example:
        >>> hole_histogram([512, 700, 4096])
        {'512': 2, '4096': 1}
    """
    counts: dict[int, int] = {}
    for size in hole_sizes:
        if size > 0:
            bucket = 1 << (int(size).bit_length() - 1)
            counts[bucket] = counts.get(bucket, 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}


def measure(layout: Layout) -> LayoutMetrics:
    """Measure a layout.

    Example:
        >>> from ms_memopt.core.layout import Block, Segment
        >>> seg = Segment(0, 3072, [Block(0, 1024, False), Block(1024, 1024, True), Block(2048, 1024, False)])
        >>> m = measure(Layout([seg]))
        >>> m.free_total, m.largest_free, m.frag_ratio
        (2048, 1024, 1.0)
    """
    reserved = 0
    allocated = 0
    holes: list[int] = []
    for seg in layout.segments:
        reserved += seg.size
        for block in seg.blocks:
            if block.live:
                allocated += block.size
            else:
                holes.append(block.size)
    free_total = reserved - allocated
    largest_free = max(holes, default=0)
    return LayoutMetrics(
        reserved=reserved,
        allocated=allocated,
        free_total=free_total,
        largest_free=largest_free,
        frag_ratio=frag_ratio(free_total, largest_free),
        utilization=(allocated / reserved) if reserved else None,
        device_free=layout.device_free,
        holes=len(holes),
        hole_histogram=hole_histogram(holes),
    )


def fits(layout: Layout, nbytes: int) -> bool:
    """Whether a request of ``nbytes`` fits in an existing hole (without growing the pool)."""
    return any(size >= nbytes for size in layout.hole_sizes())


def pool_largest_free(layout: Layout, pool: str, stream: int | None = 0) -> int:
    """The largest hole, in bytes, among the segments of one pool on one stream (``None``: any
    stream): the piece a
    request that only this pool serves could get (PyTorch's small pool never serves a large
    request, nor its large pool a small one).

    Example:
        >>> from ms_memopt.core.layout import Block, Segment
        >>> small = Segment(0, 2048, [Block(0, 1536, True), Block(1536, 512, False)], pool="small")
        >>> large = Segment(4096, 8192, [Block(4096, 8192, False)], pool="large")
        >>> pool_largest_free(Layout([small, large]), "small")
        512
    """
    return max((b.size for seg in layout.segments if seg.pool == pool and (stream is None or seg.stream == stream)
                for b in seg.blocks if not b.live), default=0)

"""Greedy placement: take buffers in a fixed order, put each at the lowest offset that fits.

For each buffer, the already placed buffers alive at the same time are found with one numpy
mask over all placed buffers, sorted by offset, and the first address gap of at least
``size`` bytes is taken (first fit) — or the tightest such gap (best fit). Orders tried:
by breadth (buffers alive at the busiest moments first), by size (the classic "greedy by
size"), by lifetime, by area and by start time. On compiler-exported instances (MindSpore
SOMAS) the breadth order often reaches the peak-live lower bound exactly.

Example:
    >>> from ms_memopt.core.placement import Buffer
    >>> bufs = [Buffer("a", 0, 2, 4), Buffer("b", 1, 3, 4), Buffer("c", 2, 4, 4)]
    >>> greedy_place(bufs, order="size")
    {'a': 0, 'b': 4, 'c': 0}
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from ms_memopt.core.placement import Buffer

__all__ = ["ORDERS", "greedy_place", "live_peak_per_buffer", "order_buffers"]

def live_peak_per_buffer(buffers: Sequence[Buffer]) -> np.ndarray:
    """For each buffer, the largest live-bytes total during its lifetime (its "breadth")."""
    times = np.unique(np.fromiter((t for b in buffers for t in (b.lower, b.upper)), dtype=np.int64))
    lowers = np.searchsorted(times, [b.lower for b in buffers])
    uppers = np.searchsorted(times, [b.upper for b in buffers])
    sizes = np.fromiter((b.size for b in buffers), dtype=np.int64, count=len(buffers))
    delta = np.zeros(len(times), dtype=np.int64)
    np.add.at(delta, lowers, sizes)
    np.add.at(delta, uppers, -sizes)
    live = np.cumsum(delta)[:-1]  # live bytes in section k = [times[k], times[k + 1])
    # sparse table: level j holds the max over 2**j consecutive sections
    levels = [live]
    while 2 ** len(levels) <= len(live):
        prev, half = levels[-1], 2 ** (len(levels) - 1)
        levels.append(np.maximum(prev[:-half], prev[half:]))
    spans = uppers - lowers
    level = np.floor(np.log2(spans)).astype(np.int64)
    peak = np.empty(len(buffers), dtype=np.int64)
    for j in np.unique(level):
        rows = np.flatnonzero(level == j)
        table = levels[j]
        peak[rows] = np.maximum(table[lowers[rows]], table[uppers[rows] - 2 ** j])
    return peak


def _keys_breadth(buffers: Sequence[Buffer]) -> list[tuple]:
    peak = live_peak_per_buffer(buffers)
    return [(-int(peak[i]), -b.size, -b.lifetime) for i, b in enumerate(buffers)]


def _keys_breadth_lifetime(buffers: Sequence[Buffer]) -> list[tuple]:
    peak = live_peak_per_buffer(buffers)
    return [(-int(peak[i]), -b.lifetime, -b.size) for i, b in enumerate(buffers)]


# name -> function giving one sort key per buffer (smallest placed first; ties by input position)
ORDERS: dict[str, Callable[[Sequence[Buffer]], list[tuple]]] = {
    # buffers alive at the busiest moment first, so the peak is packed without gaps (TFLite's
    # "greedy by breadth"); then each time's buffers by size
    "breadth": _keys_breadth,
    "breadth-lifetime": _keys_breadth_lifetime,
    "size": lambda bufs: [(-b.size, -b.lifetime, b.lower) for b in bufs],
    "lifetime": lambda bufs: [(-b.lifetime, -b.size, b.lower) for b in bufs],
    "area": lambda bufs: [(-b.area, -b.size, b.lower) for b in bufs],
    "start": lambda bufs: [(b.lower, -b.size, -b.lifetime) for b in bufs],
}


def order_buffers(buffers: Sequence[Buffer], order: str) -> list[int]:
    """Indices of ``buffers`` in the placement order named ``order`` (a key of :data:`ORDERS`)."""
    keys = ORDERS[order](buffers)
    return sorted(range(len(buffers)), key=lambda i: (keys[i], i))


def greedy_place(buffers: Sequence[Buffer], *, order: str = "size", fit: str = "first",
                 deadline: float | None = None) -> dict[str, int]:
    """Offsets for ``buffers`` placed one by one in ``order``; ``fit`` is ``"first"`` or ``"best"``.

    ``first`` takes the lowest gap that is large enough; ``best`` the smallest such gap (ties:
    lowest), falling back to the top of the stack when no gap fits. Returns id -> offset.
    Each placement compares with the buffers placed so far (n**2 / 2 comparisons in all, numpy
    does them): past ``deadline`` (a ``time.perf_counter()`` value) the buffers not yet placed are
    stacked above everything placed, so the result stays a valid placement, found in time.
    """
    n = len(buffers)
    if n == 0:
        return {}
    lowers = np.fromiter((b.lower for b in buffers), dtype=np.int64, count=n)
    uppers = np.fromiter((b.upper for b in buffers), dtype=np.int64, count=n)
    sizes = np.fromiter((b.size for b in buffers), dtype=np.int64, count=n)
    sequence = order_buffers(buffers, order)
    # Placed buffers are kept sorted by offset, so the ones alive at the same time come out of
    # the mask already in address order (no sort per buffer); an insert is one memmove.
    placed = np.empty((4, n), dtype=np.int64)  # rows: start, end, lower, upper
    offsets = np.zeros(n, dtype=np.int64)
    count = 0
    best = fit == "best"
    for done, i in enumerate(sequence):
        if deadline is not None and done % 256 == 0 and time.perf_counter() > deadline:
            top = int(placed[1, :count].max()) if count else 0
            for j in sequence[done:]:       # out of time: the rest on top of one another
                offsets[j] = top
                top += int(sizes[j])
            break
        size = int(sizes[i])
        if size == 0:
            offsets[i] = 0
            continue
        lo, up = lowers[i], uppers[i]
        view = placed[:, :count]
        mask = (view[2] < up) & (view[3] > lo)
        starts = view[0][mask]
        if starts.size == 0:
            offset = 0
        else:
            reach = np.maximum.accumulate(view[1][mask])
            # gap j lies between reach[j-1] (0 for j = 0) and starts[j]
            gap_lo = np.empty_like(starts)
            gap_lo[0] = 0
            gap_lo[1:] = reach[:-1]
            room = starts - gap_lo
            fitting = np.flatnonzero(room >= size)
            if fitting.size == 0:
                offset = int(reach[-1])
            elif best:
                offset = int(gap_lo[fitting[np.argmin(room[fitting])]])
            else:
                offset = int(gap_lo[fitting[0]])
        offsets[i] = offset
        pos = int(np.searchsorted(placed[0, :count], offset, side="right"))
        if pos < count:
            placed[:, pos + 1:count + 1] = placed[:, pos:count].copy()
        placed[:, pos] = (offset, offset + size, lo, up)
        count += 1
    return {b.id: int(offsets[i]) for i, b in enumerate(buffers)}

"""Greedy placement: take buffers in a fixed order, put each at the lowest offset that fits.

For each buffer, the already placed buffers alive at the same time are found with one numpy
mask over all placed buffers, sorted by offset, and the first address gap of at least
``size`` bytes is taken (first fit) — or the tightest such gap (best fit). Orders tried:
by size (the classic "greedy by size" of TFLite and MindSpore SOMAS), by lifetime, by area,
and by start time. On compiler-exported instances (SOMAS) the size order usually reaches
the peak-live lower bound; when it does not, another order often does.

Example:
    >>> from ms_memopt.planner.problem import Buffer
    >>> bufs = [Buffer("a", 0, 2, 4), Buffer("b", 1, 3, 4), Buffer("c", 2, 4, 4)]
    >>> greedy_place(bufs, order="size")
    {'a': 0, 'b': 4, 'c': 0}
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .problem import Buffer

__all__ = ["ORDERS", "greedy_place", "order_buffers"]

# name -> sort key (smallest key placed first); ties end with the input position for determinism
ORDERS: dict[str, Callable[[Buffer], tuple]] = {
    "size": lambda b: (-b.size, -b.lifetime, b.lower),
    "lifetime": lambda b: (-b.lifetime, -b.size, b.lower),
    "area": lambda b: (-b.area, -b.size, b.lower),
    "start": lambda b: (b.lower, -b.size, -b.lifetime),
}


def order_buffers(buffers: Sequence[Buffer], order: str) -> list[int]:
    """Indices of ``buffers`` in the placement order named ``order`` (a key of :data:`ORDERS`)."""
    key = ORDERS[order]
    return sorted(range(len(buffers)), key=lambda i: (key(buffers[i]), i))


def greedy_place(buffers: Sequence[Buffer], *, order: str = "size", fit: str = "first") -> dict[str, int]:
    """Offsets for ``buffers`` placed one by one in ``order``; ``fit`` is ``"first"`` or ``"best"``.

    ``first`` takes the lowest gap that is large enough; ``best`` the smallest such gap (ties:
    lowest), falling back to the top of the stack when no gap fits. Returns id -> offset.
    """
    n = len(buffers)
    lowers = np.fromiter((b.lower for b in buffers), dtype=np.int64, count=n)
    uppers = np.fromiter((b.upper for b in buffers), dtype=np.int64, count=n)
    sizes = np.fromiter((b.size for b in buffers), dtype=np.int64, count=n)
    sequence = order_buffers(buffers, order)
    # Placed buffers are kept in placement order in these arrays so each mask is over k, not n.
    p_lower = np.empty(n, dtype=np.int64)
    p_upper = np.empty(n, dtype=np.int64)
    p_start = np.empty(n, dtype=np.int64)
    p_end = np.empty(n, dtype=np.int64)
    offsets = np.zeros(n, dtype=np.int64)
    count = 0
    best = fit == "best"
    for i in sequence:
        size = int(sizes[i])
        if size == 0:
            offsets[i] = 0
            continue
        lo, up = lowers[i], uppers[i]
        mask = (p_lower[:count] < up) & (p_upper[:count] > lo)
        starts = p_start[:count][mask]
        if starts.size == 0:
            offset = 0
        else:
            ends = p_end[:count][mask]
            rank = np.argsort(starts, kind="stable")
            starts = starts[rank]
            reach = np.maximum.accumulate(ends[rank])
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
        p_lower[count], p_upper[count] = lo, up
        p_start[count], p_end[count] = offset, offset + size
        count += 1
    return {b.id: int(offsets[i]) for i, b in enumerate(buffers)}

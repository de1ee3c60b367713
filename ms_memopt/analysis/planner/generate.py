"""Generated placement instances with a known packing: cut a time x address strip into buffers.

MiniMalloc's challenging set has this structure: a square of ``horizon`` time steps by
``capacity`` bytes, cut into rectangles on a coarse grid (times and sizes multiples of
1 KiB there), each rectangle a buffer whose lifetime is its time extent and whose size is its
address extent. The cutting itself is a placement within the capacity, so the instance is
known to fit; dropping a few pieces leaves holes, so the lower bound can sit below the
capacity. Greedy heuristics need 1.2-1.4x the capacity on such instances.

Example:
    >>> inst = cut_strip(seed=1, pieces=40)
    >>> from ms_memopt.analysis.planner import validate
    >>> validate(inst.buffers, inst.offsets, capacity=inst.capacity)
    []
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from ms_memopt.core.placement import Buffer

__all__ = ["CutInstance", "cut_strip"]


@dataclass
class CutInstance:
    """A generated instance and the packing it was cut from.

    Attributes:
        buffers: the instance.
        offsets: id -> offset of the cut packing (valid, within ``capacity``).
        capacity: bytes of the strip.
    """

    buffers: list[Buffer]
    offsets: dict[str, int]
    capacity: int


def cut_strip(seed: int, pieces: int = 60, *, capacity: int = 1_048_576, horizon: int = 1_048_576,
              grain: int = 1024, drop: float = 0.0) -> CutInstance:
    """Cut a ``horizon`` x ``capacity`` strip into about ``pieces`` buffers (guillotine cuts).

    Each step splits the largest piece across its longer side (time or address, scaled to the
    strip) at a random multiple of ``grain``, so lifetimes and sizes are multiples of ``grain``.
    ``drop`` is the share of pieces removed afterwards (holes; 0 keeps a perfect packing whose
    lower bound equals the capacity).

    Args:
        seed: random seed (the same seed gives the same instance).
        pieces: buffers before dropping (>= 1).
        capacity, horizon: the strip, bytes x time steps.
        grain: the cut grid.
        drop: share of pieces to remove, 0 <= drop < 1.
    """
    rng = random.Random(seed)
    # pieces as (lower, upper, offset, size) on the grid
    parts = [(0, horizon // grain, 0, capacity // grain)]
    while len(parts) < pieces:
        # split the piece with the largest extent (relative to the strip) that can still be cut
        scored = [(max((u - l) / (horizon // grain), s / (capacity // grain)), k)
                  for k, (l, u, o, s) in enumerate(parts) if u - l > 1 or s > 1]
        if not scored:
            break
        _, k = max(scored)
        lower, upper, offset, size = parts.pop(k)
        by_time = (upper - lower) / (horizon // grain) >= size / (capacity // grain)
        if (by_time and upper - lower > 1) or size == 1:
            cut = rng.randint(lower + 1, upper - 1)
            parts += [(lower, cut, offset, size), (cut, upper, offset, size)]
        else:
            cut = rng.randint(1, size - 1)
            parts += [(lower, upper, offset, cut), (lower, upper, offset + cut, size - cut)]
    rng.shuffle(parts)
    keep = len(parts) - int(drop * len(parts))
    buffers, offsets = [], {}
    for index, (lower, upper, offset, size) in enumerate(parts[:keep]):
        name = str(index)
        buffers.append(Buffer(name, lower * grain, upper * grain, size * grain))
        offsets[name] = offset * grain
    return CutInstance(buffers, offsets, capacity)

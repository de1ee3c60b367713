"""Time sections: the elementary intervals between consecutive lifetime endpoints.

The exact search keeps one floor (lowest address still usable) per section. A buffer alive
during ``[lower, upper)`` covers sections ``first .. last - 1``.

Example:
    >>> from ms_memopt.core.placement import Buffer
    >>> sec = Sections.of([Buffer("a", 0, 4, 1), Buffer("b", 2, 6, 1)])
    >>> sec.count, sec.first, sec.last
    (3, [0, 1], [2, 3])
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from ms_memopt.core.placement import Buffer

__all__ = ["Sections"]


@dataclass
class Sections:
    """Section spans of a list of buffers (indices follow the buffer list).

    Attributes:
        times: sorted distinct endpoints; section k is ``[times[k], times[k + 1])``.
        first, last: per buffer, its sections are ``range(first[i], last[i])``.
    """

    times: list[int]
    first: list[int]
    last: list[int]

    @property
    def count(self) -> int:
        """Number of sections."""
        return max(len(self.times) - 1, 0)

    @classmethod
    def of(cls, buffers: Sequence[Buffer]) -> "Sections":
        """Build the sections of ``buffers``."""
        times = sorted({b.lower for b in buffers} | {b.upper for b in buffers})
        first = [bisect.bisect_left(times, b.lower) for b in buffers]
        last = [bisect.bisect_left(times, b.upper) for b in buffers]
        return cls(times, first, last)

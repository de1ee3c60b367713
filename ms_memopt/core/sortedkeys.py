"""A sorted set of keys with insert, remove and neighbour look-ups that stay fast at millions of keys.

A plain sorted Python list (``bisect.insort``) moves half the list on every insert: with a million
live keys that is megabytes per insert and hours in all (the placement validator took that long on a
million buffers alive together). :class:`SortedKeys` keeps the keys in sorted blocks of a few
hundred, so an insert or a removal moves one block and finds it by bisection.

Example:
    >>> keys = SortedKeys()
    >>> for k in (30, 10, 20):
    ...     keys.add(k)
    >>> keys.before(20), keys.at_or_after(21), len(keys)
    (10, 30, 3)
    >>> keys.remove(10); keys.before(20) is None
    True
"""
from __future__ import annotations

import bisect
from typing import Any

__all__ = ["SortedKeys"]


class SortedKeys:
    """Distinct comparable keys in order: :meth:`add`, :meth:`remove`, :meth:`before`, :meth:`at_or_after`."""

    _BLOCK = 512

    def __init__(self) -> None:
        self._blocks: list[list[Any]] = []
        self._maxes: list[Any] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, key: Any) -> None:
        """Insert ``key`` (an equal key already there is kept once)."""
        if not self._blocks:
            self._blocks.append([key])
            self._maxes.append(key)
            self._count = 1
            return
        at = min(bisect.bisect_left(self._maxes, key), len(self._blocks) - 1)
        block = self._blocks[at]
        i = bisect.bisect_left(block, key)
        if i < len(block) and block[i] == key:
            return
        block.insert(i, key)
        self._count += 1
        self._maxes[at] = block[-1]
        if len(block) > 2 * self._BLOCK:
            self._blocks[at:at + 1] = [block[:self._BLOCK], block[self._BLOCK:]]
            self._maxes[at:at + 1] = [block[self._BLOCK - 1], block[-1]]

    def remove(self, key: Any) -> None:
        """Take ``key`` out (nothing when absent)."""
        at = bisect.bisect_left(self._maxes, key)
        if at == len(self._blocks):
            return
        block = self._blocks[at]
        i = bisect.bisect_left(block, key)
        if i < len(block) and block[i] == key:
            del block[i]
            self._count -= 1
            if block:
                self._maxes[at] = block[-1]
            else:
                del self._blocks[at]
                del self._maxes[at]

    def before(self, key: Any) -> Any | None:
        """The largest key below ``key``, or ``None``."""
        at = bisect.bisect_left(self._maxes, key)
        if at < len(self._blocks):
            block = self._blocks[at]
            i = bisect.bisect_left(block, key)
            if i:
                return block[i - 1]
        return self._blocks[at - 1][-1] if at else None

    def at_or_after(self, key: Any) -> Any | None:
        """The smallest key at or above ``key``, or ``None``."""
        at = bisect.bisect_left(self._maxes, key)
        if at == len(self._blocks):
            return None
        block = self._blocks[at]
        return block[bisect.bisect_left(block, key)]

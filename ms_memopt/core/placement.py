"""The static placement problem: buffers with known lifetimes, offsets, checks and bounds.

A :class:`Buffer` lives during the half-open time interval ``[lower, upper)`` and needs
``size`` contiguous bytes. A placement maps every buffer id to a byte offset; it is valid when
no two buffers alive at the same time overlap in ``[offset, offset + size)``. The arena is the
highest end address; no placement can beat the peak of live bytes (:func:`lower_bound`).

Example:
    >>> bufs = [Buffer("a", 0, 2, 4), Buffer("b", 1, 3, 4), Buffer("c", 2, 4, 4)]
    >>> lower_bound(bufs)
    8
    >>> validate(bufs, {"a": 0, "b": 4, "c": 0})
    []
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from ms_memopt.core.errors import InputError
from ms_memopt.core.sortedkeys import SortedKeys

__all__ = ["Buffer", "Solution", "lower_bound", "arena_of", "validate", "check_buffers", "MAX_MAGNITUDE",
           "range_problem",
           "buffers_from_events"]


@dataclass(frozen=True, slots=True)
class Buffer:
    """One buffer: alive during time steps ``[lower, upper)``, ``size`` bytes.

    Example:
        >>> Buffer("x", 0, 3, 1024).lifetime
        3
    """

    id: str
    lower: int
    upper: int
    size: int

    @property
    def lifetime(self) -> int:
        """Number of time steps the buffer is alive (``upper - lower``)."""
        return self.upper - self.lower

    @property
    def area(self) -> int:
        """Bytes times time steps, the buffer's share of the time x address plane."""
        return self.size * (self.upper - self.lower)


@dataclass
class Solution:
    """A verified placement.

    Attributes:
        offsets: buffer id -> byte offset.
        arena: bytes needed, ``max(offset + size)`` (0 when there is no buffer).
        lower_bound: peak live bytes; no placement needs less.
        ratio: ``arena / lower_bound`` (1.0 when both are 0).
        valid: the result of :func:`validate` (always True for what :func:`~ms_memopt.analysis.planner.pack`
            returns unless it says otherwise in ``problems``).
        seconds: wall time spent.
        method: the algorithm that produced the offsets (e.g. ``"greedy:size"``, ``"search"``).
        optimal: True when the arena is proven minimal (it equals the lower bound, or the
            search exhausted every smaller arena).
        capacity: the capacity asked for, if any; ``fits`` says whether ``arena <= capacity``.
        problems: what :func:`validate` found wrong (empty when valid).
        proven_bound: the best lower bound proven: ``lower_bound``, or more when the exact
            search ruled every smaller arena out (0 means "not computed": use ``lower_bound``).
        stopped: why the search stopped ("bound reached", "proven optimal", "gap reached",
            "stalled", "time limit"), empty when no search ran.
        fit_seconds: wall seconds from the call's start until the first verified placement
            within ``capacity`` was found (None without a capacity or when none fit).
    """

    offsets: dict[str, int]
    arena: int
    lower_bound: int
    ratio: float
    valid: bool
    seconds: float
    method: str
    optimal: bool = False
    capacity: int | None = None
    problems: list[str] = field(default_factory=list)
    proven_bound: int = 0
    stopped: str = ""
    fit_seconds: float | None = None

    @property
    def best_bound(self) -> int:
        """The strongest lower bound known: ``max(lower_bound, proven_bound)``."""
        return max(self.lower_bound, self.proven_bound)

    @property
    def gap(self) -> float:
        """How much above the optimum the arena could still be: ``arena / best_bound - 1``
        (0.0 when proven optimal).

        Example:
            >>> round(Solution({}, 1001, 1000, 1.001, True, 0.0, "greedy").gap, 9)
            0.001
        """
        bound = self.best_bound
        return self.arena / bound - 1.0 if bound else 0.0

    @property
    def fits(self) -> bool | None:
        """``arena <= capacity`` when a capacity was given, else None."""
        return None if self.capacity is None else self.arena <= self.capacity


#: The packers work in int64: every time and size lies within +-2**62, so that each lifetime
#: (``upper - lower``) fits, and the sizes together stay at most 2**63 - 1 (any arena fits).
MAX_MAGNITUDE = 2**62
_MAX_TOTAL = 2**63 - 1


def range_problem(buf: "Buffer", total_size: int) -> str | None:
    """Why ``buf`` (after buffers whose sizes sum to ``total_size``) is out of range, or None."""
    for name in ("lower", "upper", "size"):
        value = getattr(buf, name)
        if not -MAX_MAGNITUDE <= value <= MAX_MAGNITUDE:
            return (f"buffer {buf.id!r}: {name} {value} is out of range; expected at most 2**62 "
                    "in magnitude (the packers use 64-bit integers)")
    if total_size + buf.size > _MAX_TOTAL:
        return (f"buffer {buf.id!r}: the sizes so far add up to more than 2**63 - 1 bytes "
                "(the packers use 64-bit integers)")
    return None


def check_buffers(buffers: Iterable[Buffer], *, source: str | None = None) -> list[Buffer]:
    """Return ``buffers`` as a list after checking ids are unique, sizes >= 0, ``lower < upper``,
    and everything within 64-bit range (:func:`range_problem`).

    Integer-like values (numpy integers) are converted to ``int``.

    Raises:
        InputError: the first bad buffer (``line`` is its 1-based position in the list).
    """
    result = list(buffers)
    seen: set[str] = set()
    total = 0
    for position, buf in enumerate(result, start=1):
        values = []
        for name in ("lower", "upper", "size"):
            value = getattr(buf, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise InputError(f"buffer {buf.id!r}: {name} must be an integer, got {value!r}",
                                 source=source, line=position)
            values.append(int(value))
        if any(type(getattr(buf, name)) is not int for name in ("lower", "upper", "size")):
            buf = result[position - 1] = Buffer(buf.id, *values)  # numpy integers -> int
        if buf.size < 0:
            raise InputError(f"buffer {buf.id!r}: size must be >= 0, got {buf.size}",
                             source=source, line=position)
        problem = range_problem(buf, total)
        if problem:
            raise InputError(problem, source=source, line=position)
        total += buf.size
        if buf.lower >= buf.upper:
            raise InputError(f"buffer {buf.id!r}: lower ({buf.lower}) must be < upper ({buf.upper})",
                             source=source, line=position)
        if buf.id in seen:
            raise InputError(f"duplicate buffer id {buf.id!r}", source=source, line=position)
        seen.add(buf.id)
    return result


def lower_bound(buffers: Iterable[Buffer]) -> int:
    """Peak live bytes over time: the exact lower bound on any arena (sweep, O(n log n)).

    Frees at time t happen before allocations at t because lifetimes are half-open.

    Example:
        >>> lower_bound([Buffer("a", 0, 2, 5), Buffer("b", 2, 4, 7)])
        7
    """
    deltas: dict[int, int] = {}
    for buf in buffers:
        deltas[buf.lower] = deltas.get(buf.lower, 0) + buf.size
        deltas[buf.upper] = deltas.get(buf.upper, 0) - buf.size
    live = peak = 0
    for time in sorted(deltas):
        live += deltas[time]
        peak = max(peak, live)
    return peak


def arena_of(buffers: Iterable[Buffer], offsets: Mapping[str, int]) -> int:
    """Bytes spanned by a placement: ``max(offset + size)``, 0 for no buffers."""
    return max((offsets[b.id] + b.size for b in buffers), default=0)


def validate(buffers: Sequence[Buffer], offsets: Mapping[str, int], *,
             capacity: int | None = None, limit: int = 20) -> list[str]:
    """Everything wrong with a placement, as readable sentences (empty list = valid).

    Checks every buffer has an integer offset >= 0, that no two buffers alive at the same time
    overlap in address, and (optionally) that every buffer ends within ``capacity``. The overlap
    check sweeps time keeping the live buffers sorted by offset, so each new buffer is compared
    with its two address neighbours only: O(n log n) comparisons (list inserts are memmoves).
    Zero-size buffers occupy no bytes and never overlap. Stops after ``limit`` problems.

    Example:
        >>> validate([Buffer("a", 0, 2, 4), Buffer("b", 1, 3, 4)], {"a": 0, "b": 2})
        ["buffers 'b' [2, 6) and 'a' [0, 4) overlap in address while both alive at time 1"]
    """
    problems: list[str] = []
    placed: list[Buffer] = []
    for buf in buffers:
        offset = offsets.get(buf.id)
        if offset is None:
            problems.append(f"buffer {buf.id!r} has no offset")
        elif isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            problems.append(f"buffer {buf.id!r} has offset {offset!r}; expected an integer >= 0")
        elif capacity is not None and offset + buf.size > capacity:
            problems.append(f"buffer {buf.id!r} ends at {offset + buf.size} beyond capacity {capacity}")
        elif buf.size > 0:
            placed.append(buf)
        if len(problems) >= limit:
            return problems
    # Events: frees (kind 0) before allocations (kind 1) at the same time: half-open lifetimes.
    events = [(b.upper, 0, i) for i, b in enumerate(placed)] + [(b.lower, 1, i) for i, b in enumerate(placed)]
    events.sort()
    # (offset, index) of the live buffers in order: blocks, not one list (inserting into one list of a
    # million live buffers moved megabytes each time)
    live_keys = SortedKeys()
    ends: dict[int, int] = {}
    for time, kind, index in events:
        buf = placed[index]
        key = (offsets[buf.id], index)
        if kind == 0:
            live_keys.remove(key)
            continue
        start, end = key[0], key[0] + buf.size
        clash = None
        below, above = live_keys.before(key), live_keys.at_or_after(key)
        if below is not None and ends[below[1]] > start:
            clash = below[1]
        elif above is not None and above[0] < end:
            clash = above[1]
        if clash is not None:
            other = placed[clash]
            o_start = offsets[other.id]
            problems.append(f"buffers {buf.id!r} [{start}, {end}) and {other.id!r} "
                            f"[{o_start}, {o_start + other.size}) overlap in address while both "
                            f"alive at time {time}")
            if len(problems) >= limit:
                return problems
            continue  # keep the live set overlap-free so later checks stay meaningful
        live_keys.add(key)
        ends[index] = end
    return problems


def buffers_from_events(events: Sequence[object]) -> list[Buffer]:
    """Buffers from an event trace: the alloc at event index i opens ``[i, ...)``, its free closes it.

    Each event needs ``.action`` (``"alloc"``, ``"free"``; ``"free_completed"`` also closes;
    other actions are ignored but still count as time steps), ``.id`` and ``.size``. A buffer
    never freed lives until ``len(events)``. An id allocated again after its free becomes a
    new buffer named ``"<id>#2"``, ``"<id>#3"``, ...

    Example:
        >>> from types import SimpleNamespace as E
        >>> buffers_from_events([E(action="alloc", id=1, size=8), E(action="free", id=1, size=8)])
        [Buffer(id='1', lower=0, upper=1, size=8)]
    """
    open_at: dict[str, tuple[str, int, int]] = {}
    uses: dict[str, int] = {}
    result: list[Buffer] = []
    for index, event in enumerate(events):
        action = str(getattr(event, "action", ""))
        key = str(getattr(event, "id", ""))
        if action == "alloc":
            if key in open_at:  # allocated twice without a free: close the first one here
                name, start, size = open_at.pop(key)
                result.append(Buffer(name, start, max(index, start + 1), size))
            uses[key] = uses.get(key, 0) + 1
            name = key if uses[key] == 1 else f"{key}#{uses[key]}"
            open_at[key] = (name, index, int(getattr(event, "size", 0) or 0))
        elif action in ("free", "free_completed") and key in open_at:
            name, start, size = open_at.pop(key)
            result.append(Buffer(name, start, max(index, start + 1), size))
    end = len(events)
    for name, start, size in open_at.values():
        result.append(Buffer(name, start, max(end, start + 1), size))
    return result

"""Static memory planner: offsets for buffers with known lifetimes, as compact as possible.

:func:`pack` is what pool mode and the simulator call. It runs the greedy orders of
:mod:`.greedy` first (milliseconds; on MindSpore SOMAS instances the breadth order usually
reaches the lower bound), then, when a capacity is missed or the arena is above the lower
bound, the exact search of :mod:`.search` until the time limit. Every candidate placement is
checked with :func:`~.problem.validate` before it can be returned, so the answer is always the
best *verified* placement found.

Example:
    >>> from ms_memopt.planner import Buffer, pack
    >>> sol = pack([Buffer("a", 0, 2, 4), Buffer("b", 1, 3, 4), Buffer("c", 2, 4, 4)])
    >>> sol.arena, sol.lower_bound, sol.valid, sol.offsets
    (8, 8, True, {'a': 0, 'b': 4, 'c': 0})
"""
from __future__ import annotations

import numbers
import time
import warnings
from typing import Iterable

from ..errors import InputError
from .greedy import greedy_place
from .problem import (Buffer, Solution, arena_of, buffers_from_events, check_buffers, lower_bound,
                      validate)
from .search import PREFERENCES, search_place

__all__ = ["Buffer", "Solution", "pack", "lower_bound", "validate", "buffers_from_events",
           "DEFAULT_TIME_LIMIT", "GREEDY_RUNS"]

DEFAULT_TIME_LIMIT = 10.0  # seconds of search when the caller gives no limit

# (order, fit) pairs tried in this sequence; the first is usually the best on compiler instances
GREEDY_RUNS: tuple[tuple[str, str], ...] = (
    ("breadth", "first"), ("size", "first"), ("breadth", "best"), ("breadth-lifetime", "best"),
    ("size", "best"), ("start", "best"), ("lifetime", "best"), ("area", "first"),
)

_GREEDY_SHARE = 0.2  # greedy runs after the first stop once this share of the time is spent
_FIRST_NODE_LIMIT = 2000  # nodes per search attempt in the first round (at least 4 per buffer);
# it grows 4x per round


class _Best:
    """The best verified placement so far."""

    def __init__(self, buffers: list[Buffer]) -> None:
        self.buffers = buffers
        self.offsets: dict[str, int] | None = None
        self.arena: int | None = None
        self.method = ""

    def offer(self, offsets: dict[str, int] | None, method: str) -> bool:
        """Keep ``offsets`` if valid and smaller than the best so far; True when kept."""
        if offsets is None:
            return False
        arena = arena_of(self.buffers, offsets)
        if self.arena is not None and arena >= self.arena:
            return False
        problems = validate(self.buffers, offsets, limit=1)
        if problems:  # a bug in an algorithm: never return it, but say so
            warnings.warn(f"planner: discarded an invalid placement from {method}: {problems[0]}",
                          RuntimeWarning, stacklevel=3)
            return False
        self.offsets, self.arena, self.method = offsets, arena, method
        return True


def pack(buffers: Iterable[Buffer], capacity: int | None = None, time_limit: float | None = None,
         *, gap: float = 0.0) -> Solution:
    """Place ``buffers`` (bytes, half-open lifetimes) so that no two alive at once overlap.

    Args:
        buffers: the instance; ids must be unique, ``size >= 0``, ``lower < upper``.
        capacity: bytes available; the search works until the placement fits (or time runs out).
        time_limit: seconds for the whole call (default :data:`DEFAULT_TIME_LIMIT`); on
            expiry the best verified placement found so far is returned.
        gap: stop improving once ``arena <= lower_bound * (1 + gap)`` (0: only the bound itself
            or a proof of optimality stops the search early).

    Returns:
        A :class:`Solution`; ``optimal`` is True when the arena is proven minimal.

    Raises:
        InputError: invalid buffers (duplicate id, negative size, ``lower >= upper``).

    Example:
        >>> pack([Buffer("x", 0, 1, 8), Buffer("y", 1, 2, 8)], capacity=8).fits
        True
    """
    started = time.perf_counter()
    items = check_buffers(buffers, source="buffers")
    try:
        limit = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)
    except (TypeError, ValueError):
        raise InputError(f"time limit must be a number of seconds, got {time_limit!r}",
                         source="time_limit") from None
    if not limit >= 0:
        raise InputError(f"time limit must be >= 0 seconds, got {time_limit}", source="time_limit")
    if capacity is not None:
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity < 0:
            raise InputError(f"capacity must be an integer number of bytes >= 0, got {capacity!r}",
                             source="capacity")
        capacity = int(capacity)
    deadline = started + limit
    greedy_until = started + limit * _GREEDY_SHARE
    bound = lower_bound(items)
    goal = max(bound, int(bound * (1.0 + gap)))
    best = _Best(items)
    if not items:
        best.offer({}, "empty")
    for run, (order, fit) in enumerate(GREEDY_RUNS if items else ()):
        best.offer(greedy_place(items, order=order, fit=fit), f"greedy:{order}/{fit}")
        if best.arena is not None and best.arena <= goal:
            break
        if run >= 1 and time.perf_counter() > greedy_until:
            break  # greedy by size has run (never worse than it); leave the rest to the search
    if best.arena is None:  # cannot happen unless every greedy run was wrong; stack them
        best.offer(_stacked(items), "stack")
    proven_low = bound  # no arena below this exists
    if capacity is not None and best.arena > capacity >= bound:
        if _attempt(best, capacity, deadline) == "infeasible":
            proven_low = capacity + 1
    optimal = best.arena <= proven_low
    if not optimal and best.arena > goal and time.perf_counter() < deadline:
        optimal = _improve(best, proven_low, goal, deadline)
    problems = validate(items, best.offsets)
    seconds = time.perf_counter() - started
    ratio = best.arena / bound if bound else 1.0
    return Solution(offsets=best.offsets, arena=best.arena, lower_bound=bound, ratio=ratio,
                    valid=not problems, seconds=seconds, method=best.method, optimal=optimal,
                    capacity=capacity, problems=problems)


def _stacked(items: list[Buffer]) -> dict[str, int]:
    offsets, top = {}, 0
    for buf in items:
        offsets[buf.id] = top
        top += buf.size
    return offsets


def _attempt(best: _Best, target: int, deadline: float) -> str:
    """Search for a placement within ``target`` bytes: "found", "infeasible" or "timeout".

    Restarts with each candidate preference under a node limit that grows 4x per round, so a
    preference that suits the instance is found early and none is stuck forever.
    """
    node_limit = max(_FIRST_NODE_LIMIT, 4 * len(best.buffers))
    while time.perf_counter() < deadline:
        for prefer in PREFERENCES:
            result = search_place(best.buffers, target, deadline=deadline, prefer=prefer,
                                  node_limit=node_limit)
            if result.offsets is not None:
                best.offer(result.offsets, f"search:{prefer}")
                return "found"
            if result.exhausted:
                return "infeasible"
            if time.perf_counter() >= deadline:
                return "timeout"
        node_limit *= 4
    return "timeout"


def _improve(best: _Best, proven_low: int, goal: int, deadline: float) -> bool:
    """Shrink the arena toward ``goal`` by searching at decreasing targets; True if proven optimal.

    ``proven_low`` is the smallest arena not yet ruled out (the lower bound, or more when a
    capacity was proven infeasible). Bisects between the smallest target not yet tried and the
    best arena, each attempt with a third of the remaining time; a timeout moves the next target
    up but proves nothing. Once every smaller target has timed out, the rest of the time goes
    to one attempt just below the best arena.
    """
    low = proven_low
    if goal > proven_low:  # the caller accepts this much: all the time goes to reaching it
        outcome = _attempt(best, goal, deadline)
        if outcome == "infeasible":
            low = proven_low = goal + 1
    while best.arena > max(goal, proven_low):
        now = time.perf_counter()
        if now >= deadline:
            return False
        if low >= best.arena:
            target, until = best.arena - 1, deadline
        else:
            target = max(goal, (low + best.arena - 1) // 2)
            until = deadline if target == best.arena - 1 else now + (deadline - now) / 3
        outcome = _attempt(best, target, until)
        if outcome == "infeasible":
            low = proven_low = target + 1
        elif outcome == "timeout":
            low = target + 1
    return best.arena <= proven_low

"""Static memory planner: offsets for buffers with known lifetimes, as compact as possible.

:func:`pack` is what pool mode and the simulator call. It runs the greedy orders of
:mod:`.greedy` first (milliseconds; on MindSpore SOMAS instances the breadth order usually
reaches the lower bound), then, when a capacity is missed or the arena is above the lower
bound, the exact search of :mod:`.search` (MiniMalloc's method, compiled when a C compiler is
there) until the bound, a proof of optimality, the time limit, or ``stall`` seconds without
progress. ``Solution.gap`` says how far the answer could still be from the optimum (vs the
best proven lower bound). Every candidate placement is
checked with :func:`~.problem.validate` before it can be returned, so the answer is always the
best *verified* placement found.

Example:
    >>> from ms_memopt.analysis.planner import Buffer, pack
    >>> sol = pack([Buffer("a", 0, 2, 4), Buffer("b", 1, 3, 4), Buffer("c", 2, 4, 4)])
    >>> sol.arena, sol.lower_bound, sol.valid, sol.offsets
    (8, 8, True, {'a': 0, 'b': 4, 'c': 0})
"""
from __future__ import annotations

import numbers
import time
import warnings
from typing import Iterable

from tqdm import tqdm

from ms_memopt.analysis.planner.greedy import greedy_place
from ms_memopt.analysis.planner.search import PREORDERS, search_place
from ms_memopt.core.errors import InputError
from ms_memopt.core.placement import (Buffer, Solution, arena_of, buffers_from_events, check_buffers, lower_bound,
                      validate)

__all__ = ["Buffer", "Solution", "pack", "lower_bound", "validate", "buffers_from_events",
           "DEFAULT_TIME_LIMIT", "DEFAULT_STALL", "GREEDY_RUNS"]

DEFAULT_TIME_LIMIT = 10.0  # seconds of search when the caller gives no limit
DEFAULT_STALL = 0.2  # stop improving after this share of the time limit (at least 1 s) without progress
_MIN_STALL = 1.0

# (order, fit) pairs tried in this sequence; the first is usually the best on compiler instances
GREEDY_RUNS: tuple[tuple[str, str], ...] = (
    ("breadth", "first"), ("size", "first"), ("breadth", "best"), ("breadth-lifetime", "best"),
    ("size", "best"), ("start", "best"), ("lifetime", "best"), ("area", "first"),
)

_GREEDY_SHARE = 0.2  # greedy runs after the first stop once this share of the time is spent
# MiniMalloc's round robin: each preorder gets a node limit that starts at the number of
# buffers and doubles per round, so one that suits the instance is found early and none sticks
_NODE_LIMIT_GROWTH = 2


class _Best:
    """The best verified placement so far, the best proven lower bound, and the progress bar."""

    def __init__(self, buffers: list[Buffer], bound: int, capacity: int | None = None) -> None:
        self.buffers = buffers
        self.capacity = capacity
        self.fit_at: float | None = None  # perf_counter() when a placement first fit the capacity
        self.offsets: dict[str, int] | None = None
        self.validated: dict[str, int] | None = None      # the offsets validate() passed
        self.arena: int | None = None
        self.method = ""
        self.lower_bound = bound
        self.proven = bound  # no arena below this exists
        self.last_progress = time.perf_counter()
        self.started = self.last_progress
        self.bar = None

    def prove(self, bound: int) -> int:
        """Record that no arena below ``bound`` exists; returns the proven bound."""
        if bound > self.proven:
            self.proven = bound
            self._progressed()
        return self.proven

    def _progressed(self) -> None:
        self.last_progress = time.perf_counter()
        self.tick()

    def tick(self) -> None:
        """Advance the progress bar to the elapsed time and show arena / proven bound."""
        if self.bar is None or self.bar.disable:
            return
        elapsed = min(time.perf_counter() - self.started, self.bar.total)
        self.bar.update(max(0.0, round(elapsed - self.bar.n, 1)))
        if self.arena is not None and self.proven:
            self.bar.set_postfix_str(f"arena/bound {self.arena / self.proven:.6f}", refresh=False)

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
        self.validated = offsets
        if self.fit_at is None and self.capacity is not None and arena <= self.capacity:
            self.fit_at = time.perf_counter()
        self._progressed()
        return True


#: seconds validate() takes per buffer, about (1M buffers: ~6 s here), kept from the time limit
_VALIDATE_SECONDS_PER_BUFFER = 8e-6

def pack(buffers: Iterable[Buffer], capacity: int | None = None, time_limit: float | None = None,
         *, gap: float = 0.0, stall: float | None = None, progress: bool = False) -> Solution:
    """Place ``buffers`` (bytes, half-open lifetimes) so that no two alive at once overlap.

    Args:
        buffers: the instance; ids must be unique, ``size >= 0``, ``lower < upper``.
        capacity: bytes available; the search works until the placement fits (or time runs out).
        time_limit: seconds for the whole call (default :data:`DEFAULT_TIME_LIMIT`); on
            expiry the best verified placement found so far is returned.
        gap: stop improving once ``arena <= lower_bound * (1 + gap)`` (0: only the bound itself
            or a proof of optimality stops the search early).
        stall: stop improving after this many seconds in which neither the arena nor the proven
            lower bound moved (default: :data:`DEFAULT_STALL` of the time limit, at least 1 s).
            Reaching a given capacity is never cut short by it.
        progress: show a tqdm bar on stderr when the call runs for more than a second.

    Returns:
        A :class:`Solution`; ``optimal`` is True when the arena is proven minimal,
        ``proven_bound`` the best lower bound proven (peak live bytes, or more when the search
        ruled smaller arenas out) and ``gap`` how far the arena could still be above the optimum.

    Raises:
        InputError: invalid buffers (duplicate id, negative size, ``lower >= upper``).

    Example:
        >>> pack([Buffer("x", 0, 1, 8), Buffer("y", 1, 2, 8)], capacity=8).fits
        True
    """
    started = time.perf_counter()
    items = check_buffers(buffers, source="buffers")
    limit = _seconds(time_limit, DEFAULT_TIME_LIMIT, "time_limit")
    stall_seconds = _seconds(stall, max(_MIN_STALL, DEFAULT_STALL * limit), "stall")
    if capacity is not None:
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity < 0:
            raise InputError(f"capacity must be an integer number of bytes >= 0, got {capacity!r}",
                             source="capacity")
        capacity = int(capacity)
    # the placement kept is validated after the search (n log n in Python, ~6 us a buffer here):
    # its time comes out of the limit, so the whole call ends near it with a million buffers too
    reserve = min(0.5 * limit, len(items) * _VALIDATE_SECONDS_PER_BUFFER)
    deadline = started + limit - reserve
    greedy_until = started + (limit - reserve) * _GREEDY_SHARE
    bound = lower_bound(items)
    goal = max(bound, int(bound * (1.0 + gap)))
    best = _Best(items, bound, capacity)
    bar = tqdm(total=round(limit, 1), unit="s", delay=1.0, disable=not progress, leave=False,
               desc="pack", bar_format="{desc}: {n:.1f}/{total:.1f} s |{bar}|{postfix}")
    best.bar = bar
    try:
        if not items:
            best.offer({}, "empty")
        for run, (order, fit) in enumerate(GREEDY_RUNS if items else ()):
            best.offer(greedy_place(items, order=order, fit=fit, deadline=deadline), f"greedy:{order}/{fit}")
            if best.arena is not None and best.arena <= goal:
                break
            if (run >= 1 and time.perf_counter() > greedy_until) or time.perf_counter() > deadline:
                break  # greedy by size has run (never worse than it); leave the rest to the search
        if best.arena is None:  # cannot happen unless every greedy run was wrong; stack them
            best.offer(_stacked(items), "stack")
        if capacity is not None and best.arena > capacity >= bound:
            if _attempt(best, capacity, deadline) == "infeasible":
                best.prove(capacity + 1)
        stop = "bound reached" if best.arena <= best.proven else "gap reached" if best.arena <= goal else ""
        if not stop:
            stop = _improve(best, goal, deadline, stall_seconds)
    finally:
        bar.close()
    # offer() validated every placement it kept: checking the best one again costs a pass of
    # n log n over the buffers (seconds at a million) after the time limit, for nothing
    problems = [] if best.offsets is best.validated else validate(items, best.offsets)
    seconds = time.perf_counter() - started
    ratio = best.arena / bound if bound else 1.0
    return Solution(offsets=best.offsets, arena=best.arena, lower_bound=bound, ratio=ratio,
                    valid=not problems, seconds=seconds, method=best.method,
                    optimal=best.arena <= best.proven, capacity=capacity, problems=problems,
                    proven_bound=best.proven, stopped=stop,
                    fit_seconds=None if best.fit_at is None else best.fit_at - started)


def _seconds(value: float | None, default: float, name: str) -> float:
    try:
        seconds = default if value is None else float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name.replace('_', ' ')} must be a number of seconds, got {value!r}",
                         source=name) from None
    if not seconds >= 0:
        raise InputError(f"{name.replace('_', ' ')} must be >= 0 seconds, got {value}", source=name)
    return seconds


def _stacked(items: list[Buffer]) -> dict[str, int]:
    offsets, top = {}, 0
    for buf in items:
        offsets[buf.id] = top
        top += buf.size
    return offsets


def _attempt(best: "_Best", target: int, deadline: float) -> str:
    """Search for a placement within ``target`` bytes: "found", "infeasible" or "timeout".

    Round robin over the preorders of :data:`~.search.PREORDERS` with a node limit that starts
    at the number of buffers and doubles per round.
    """
    node_limit = max(1, len(best.buffers))
    while time.perf_counter() < deadline:
        node_limit *= _NODE_LIMIT_GROWTH
        for prefer in PREORDERS:
            result = search_place(best.buffers, target, deadline=deadline, prefer=prefer,
                                  node_limit=node_limit)
            best.tick()
            if result.offsets is not None:
                best.offer(result.offsets, f"search:{prefer}")
                return "found"
            if result.exhausted:
                return "infeasible"
            if time.perf_counter() >= deadline:
                return "timeout"
    return "timeout"


def _improve(best: "_Best", goal: int, deadline: float, stall: float) -> str:
    """Shrink the arena toward ``goal``; returns why it stopped.

    Bisects between the smallest arena not yet ruled out and the best arena, each attempt with
    a third of the remaining time; an exhausted search proves its target infeasible (raising
    ``best.proven``), a timeout moves the next target up but proves nothing. Once every smaller
    target has timed out, the time goes to attempts just below the best arena. Stops when the
    arena reaches the goal or the proven bound, at the deadline, or after ``stall`` seconds
    without progress.
    """
    low = best.proven
    if goal > best.proven:  # the caller accepts this much: try that first
        if _attempt(best, goal, min(deadline, time.perf_counter() + stall)) == "infeasible":
            low = best.prove(goal + 1)
    while True:
        if best.arena <= best.proven:
            return "proven optimal" if best.arena > best.lower_bound else "bound reached"
        if best.arena <= goal:
            return "gap reached"
        now = time.perf_counter()
        if now >= deadline:
            return "time limit"
        if now - best.last_progress >= stall:
            return "stalled"
        until = min(deadline, best.last_progress + stall)
        if low >= best.arena:
            target = best.arena - 1
        else:
            target = max(goal, (low + best.arena - 1) // 2)
            if target != best.arena - 1:
                until = min(until, now + (deadline - now) / 3)
        outcome = _attempt(best, target, until)
        if outcome == "infeasible":
            low = best.prove(target + 1)
        elif outcome == "timeout":
            low = max(low, target + 1)

"""Exact search: fill memory bottom-up, branching on which buffer sits at the lowest floor.

The idea follows MiniMalloc (Moffitt, ASPLOS 2023): it is enough to search *canonical*
placements, where every buffer rests at address 0 or directly on a buffer alive at the same
time (any placement can be pushed down into one without growing). Time is cut into sections
(:mod:`.sections`); each has a *floor*, a lower bound on the address of every buffer not yet
placed that is alive there. At each node the search takes the lowest section ``s`` (floor
``f``) and branches:

* *place u*: some buffer sits at ``f`` in ``s``; it must be one whose whole lifetime lies in the
  run of sections at floor ``f`` around ``s`` (a *candidate*); placing it lifts the floors of
  its sections by its size. Candidates tried earlier at this node are then forbidden at ``f``
  (a per-buffer minimum offset), so no placement is reached twice;
* *skip*: nothing sits at ``f`` in ``s``; the lowest buffer there then rests on a buffer not yet
  placed (so at least ``f + smallest size``) or lies above a neighbouring floor; the floor of
  ``s`` is raised to the smallest such bound. When there is no candidate this is the only branch.

Pruning: in every section, floor + bytes of the unplaced buffers alive there must stay within
the capacity. Placing a buffer leaves that slack unchanged, so only raises need the check.
The search is complete: when it ends without a placement, none exists within the capacity.
The implementation (plain lists, an explicit stack, undo records) is this project's own.

Example:
    >>> from ms_memopt.planner.problem import Buffer
    >>> bufs = [Buffer("a", 0, 3, 4), Buffer("b", 3, 9, 4), Buffer("c", 0, 9, 4)]
    >>> result = search_place(bufs, capacity=8)
    >>> result.offsets is not None and result.exhausted is False
    True
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .problem import Buffer
from .sections import Sections

__all__ = ["PREFERENCES", "SearchResult", "search_place", "minimize"]

# name -> key: candidates at a node are tried smallest key first
PREFERENCES: dict[str, Callable[[Buffer], tuple]] = {
    "size": lambda b: (-b.size, -b.lifetime),
    "lifetime": lambda b: (-b.lifetime, -b.size),
    "area": lambda b: (-b.area, -b.size),
}

_CHECK_EVERY = 512  # nodes between clock reads


@dataclass
class SearchResult:
    """What one search at a fixed capacity found.

    Attributes:
        offsets: id -> offset of a placement within the capacity, or None.
        exhausted: True when the search proved that no placement fits (only when offsets is None).
        nodes: search nodes visited.
    """

    offsets: dict[str, int] | None
    exhausted: bool
    nodes: int


def search_place(buffers: Sequence[Buffer], capacity: int, *, deadline: float | None = None,
                 prefer: str = "size", node_limit: int | None = None) -> SearchResult:
    """Find offsets with every buffer ending at or below ``capacity`` bytes, or prove there are none.

    Args:
        buffers: the instance (zero-size buffers get offset 0 and take no part).
        capacity: bytes available.
        deadline: ``time.perf_counter()`` value after which the search gives up (not exhausted).
        prefer: candidate order, a key of :data:`PREFERENCES`.
        node_limit: give up after this many nodes.
    """
    return _Search(buffers, capacity, prefer).run(deadline, node_limit)


def minimize(buffers: Sequence[Buffer], start_arena: int, floor_bound: int, *,
             deadline: float | None = None, prefer: str = "size") -> tuple[dict[str, int] | None, bool]:
    """Shrink the arena below ``start_arena`` (a known feasible arena) down to ``floor_bound``.

    Repeats :func:`search_place` with capacity = best arena found - 1 until the search proves
    nothing smaller exists or the deadline passes. Returns (best offsets found or None, proven
    optimal) where proven optimal means the last returned-or-start arena is minimal.
    """
    best: dict[str, int] | None = None
    arena = start_arena
    while arena > floor_bound:
        result = search_place(buffers, arena - 1, deadline=deadline, prefer=prefer)
        if result.offsets is None:
            return best, result.exhausted
        best = result.offsets
        arena = max((best[b.id] + b.size for b in buffers), default=0)
    return best, True


class _Search:
    def __init__(self, buffers: Sequence[Buffer], capacity: int, prefer: str) -> None:
        self.buffers = buffers
        self.capacity = capacity
        self.index = [i for i, b in enumerate(buffers) if b.size > 0]
        sub = [buffers[i] for i in self.index]
        self.sizes = [b.size for b in sub]
        self.sec = Sections.of(sub)
        key = PREFERENCES[prefer]
        order = sorted(range(len(sub)), key=lambda i: (key(sub[i]), i))
        rank = [0] * len(sub)
        for r, i in enumerate(order):
            rank[i] = r
        self.cover = [sorted(c, key=rank.__getitem__) for c in self.sec.cover]
        self.min_size = min(self.sizes, default=1)

    def run(self, deadline: float | None, node_limit: int | None) -> SearchResult:
        n = len(self.sizes)
        ids = [b.id for b in self.buffers]
        if n == 0:
            return SearchResult({i: 0 for i in ids}, False, 0)
        if max(self.sizes) > self.capacity:
            return SearchResult(None, True, 0)
        sizes, first, last, cover = self.sizes, self.sec.first, self.sec.last, self.cover
        count = self.sec.count
        big = self.capacity + 1  # floor of a section where nothing is left to place
        floor = [0] * count
        remaining = [len(c) for c in cover]
        rem_bytes = [sum(sizes[u] for u in c) for c in cover]
        if any(rem_bytes[k] > self.capacity for k in range(count)):
            return SearchResult(None, True, 0)
        key = [0 if remaining[k] else big for k in range(count)]  # floor, or big when done
        min_off = [0] * n
        offset = [0] * n
        placed = [False] * n
        left = n
        nodes = 0
        capacity = self.capacity
        min_size = self.min_size

        def expand() -> list:
            """The node's frame: [s, f, candidates, raises, next choice, undo record].

            Looks at every section of the lowest run: one with no candidate is raised at once
            (a forced move, ``candidates`` empty); otherwise the section with the fewest
            candidates is branched on (fail first), with one skip raise as its last branch.
            """
            f = min(key)
            s = key.index(f)
            lo = s
            while lo > 0 and key[lo - 1] == f:
                lo -= 1
            hi = s + 1
            while hi < count and key[hi] == f:
                hi += 1
            left_wall = key[lo - 1] if lo > 0 else big
            right_wall = key[hi] if hi < count else big
            forced = []
            best = None
            for t in range(lo, hi):
                if remaining[t] == 0:
                    continue
                candidates = []
                skip_to = big
                for u in cover[t]:
                    if placed[u]:
                        continue
                    crossing = 0
                    if first[u] < lo:
                        crossing = left_wall
                    if last[u] > hi and right_wall > crossing:
                        crossing = right_wall
                    if crossing:  # rests above a neighbouring floor at best
                        bound = crossing if crossing > min_off[u] else min_off[u]
                    elif min_off[u] <= f:
                        candidates.append(u)
                        bound = f + min_size
                    else:
                        bound = min_off[u] if min_off[u] > f + min_size else f + min_size
                    if bound < skip_to:
                        skip_to = bound
                if skip_to + rem_bytes[t] > capacity:
                    skip_to = big  # raising this section cannot fit
                if not candidates:
                    if skip_to >= big:
                        return [t, f, (), (), 0, None]  # dead end
                    forced.append((t, skip_to))
                elif not forced and (best is None or len(candidates) < len(best[2])):
                    best = [t, f, candidates, ((t, skip_to),) if skip_to < big else (), 0, None]
            if forced:
                return [forced[0][0], f, (), forced, 0, None]
            return best

        stack = [expand()]
        while stack:
            frame = stack[-1]
            s, f, candidates, skip_to, choice, undo = frame  # skip_to: the raises of the last branch
            if undo is not None:  # take back the previous branch of this node
                kind, u, old_mins, old_floors = undo
                for v, m in old_mins:
                    min_off[v] = m
                if kind == "place":
                    for k in range(first[u], last[u]):
                        remaining[k] += 1
                        rem_bytes[k] += sizes[u]
                        floor[k] = f
                        key[k] = f
                    placed[u] = False
                    left += 1
                else:
                    for t in old_floors:
                        floor[t] = f
                        key[t] = f
                frame[5] = None
            nodes += 1
            if nodes % _CHECK_EVERY == 0:
                if deadline is not None and time.perf_counter() > deadline:
                    return SearchResult(None, False, nodes)
                if node_limit is not None and nodes > node_limit:
                    return SearchResult(None, False, nodes)
            if choice < len(candidates):
                u = candidates[choice]
                frame[4] = choice + 1
                old_mins = []
                for v in candidates[:choice]:  # tried before at this floor: not here again
                    old_mins.append((v, min_off[v]))
                    min_off[v] = f + 1
                top = f + sizes[u]
                for k in range(first[u], last[u]):
                    remaining[k] -= 1
                    rem_bytes[k] -= sizes[u]
                    floor[k] = top
                    key[k] = top if remaining[k] else big
                placed[u] = True
                offset[u] = f
                left -= 1
                frame[5] = ("place", u, old_mins, None)
                if top > capacity:
                    continue
                if left == 0:
                    offsets = {i: 0 for i in ids}
                    for j, original in enumerate(self.index):
                        offsets[ids[original]] = offset[j]
                    return SearchResult(offsets, False, nodes)
                stack.append(expand())
                continue
            if choice == len(candidates) and skip_to:
                frame[4] = choice + 1
                old_mins = []
                for v in candidates:
                    old_mins.append((v, min_off[v]))
                    min_off[v] = f + 1
                for t, target in skip_to:
                    floor[t] = target
                    key[t] = target
                frame[5] = ("raise", None, old_mins, [t for t, _ in skip_to])
                stack.append(expand())
                continue
            stack.pop()
        return SearchResult(None, True, nodes)

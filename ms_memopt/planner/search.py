"""Exact search: fill memory bottom-up, branching on which buffer sits at the lowest floor.

The idea follows MiniMalloc (Moffitt, ASPLOS 2023): it is enough to search *canonical*
placements, where every buffer rests at address 0 or directly on a buffer alive at the same
time (any placement can be pushed down into one without growing). Time is cut into sections
(:mod:`.sections`); each has a *floor*, a lower bound on the address of every buffer not yet
placed that is alive there. At each node the search looks at the *run* of neighbouring
sections at the lowest floor ``f``. A section of the run where no unplaced buffer can sit at
``f`` is raised at once (a forced move). Otherwise it branches on the section ``s`` of the run
with the fewest candidates (fail first):

* *place u*: some buffer sits at ``f`` in ``s``; it must be one whose whole lifetime lies in the
  run of sections at floor ``f`` around ``s`` (a *candidate*); placing it lifts the floors of
  its sections by its size. Candidates tried earlier at this node are then forbidden at ``f``
  (a per-buffer minimum offset), so no placement is reached twice;
* *skip*: nothing sits at ``f`` in ``s``; the lowest buffer there then rests on a buffer not yet
  placed (so at least ``f + smallest size``) or lies above a neighbouring floor; the floor of
  ``s`` is raised to the smallest such bound.

Pruning: in every section, floor + bytes of the unplaced buffers alive there must stay within
the capacity. Placing a buffer leaves that slack unchanged, so only raises need the check.
The search is complete: when it ends without a placement, none exists within the capacity.
The implementation (numpy arrays over buffers and sections, so a node costs a few vector
operations; an explicit stack with undo records instead of recursion) is this project's own.

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

import numpy as np

from .problem import Buffer
from .sections import Sections

__all__ = ["PREFERENCES", "SearchResult", "search_place"]

# name -> key: candidates at a node are tried smallest key first
PREFERENCES: dict[str, Callable[[Buffer], tuple]] = {
    "size": lambda b: (-b.size, -b.lifetime),
    "lifetime": lambda b: (-b.lifetime, -b.size),
    "area": lambda b: (-b.area, -b.size),
}

_FORCED_PER_NODE = 256  # forced raises applied together in one node (bounds the work per node)


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
        self.rank = rank
        self.min_size = min(self.sizes, default=1)

    def run(self, deadline: float | None, node_limit: int | None) -> SearchResult:
        n = len(self.sizes)
        ids = [b.id for b in self.buffers]
        if n == 0:
            return SearchResult({i: 0 for i in ids}, False, 0)
        capacity = self.capacity
        if max(self.sizes) > capacity:
            return SearchResult(None, True, 0)
        count = self.sec.count
        sizes = np.asarray(self.sizes, dtype=np.int64)
        first = np.asarray(self.sec.first, dtype=np.int64)
        last = np.asarray(self.sec.last, dtype=np.int64)
        delta = np.zeros(count + 1, dtype=np.int64)
        np.add.at(delta, first, 1)
        np.add.at(delta, last, -1)
        remaining = np.cumsum(delta)[:-1]  # unplaced buffers alive in each section
        delta[:] = 0
        np.add.at(delta, first, sizes)
        np.add.at(delta, last, -sizes)
        rem_bytes = np.cumsum(delta)[:-1]  # their bytes
        if int(rem_bytes.max()) > capacity:
            return SearchResult(None, True, 0)
        big = capacity + 1  # the key of a section where nothing is left to place
        key = np.where(remaining > 0, 0, big).astype(np.int64)  # the floor, or big when done
        rank = self.rank
        placed = np.zeros(n, dtype=bool)
        min_off = np.zeros(n, dtype=np.int64)
        offset = [0] * n
        firsts, lasts, size_list = self.sec.first, self.sec.last, self.sizes
        min_size = self.min_size
        left = n
        nodes = 0

        def expand() -> list:
            """The node's frame: [f, candidates, raises, next choice, undo record].

            In the run of sections at the lowest floor ``f``, a section where no unplaced buffer
            can sit at ``f`` is raised at once (a forced move, no candidates); otherwise the
            section with the fewest candidates is branched on (fail first), with raising it
            (the skip branch) as its last branch. ``raises`` is empty for a dead end.
            """
            f = int(key.min())
            s = int(key.argmin())
            off_floor = key != f
            before = np.flatnonzero(off_floor[:s])
            lo = int(before[-1]) + 1 if before.size else 0
            after = np.flatnonzero(off_floor[s:])
            hi = s + int(after[0]) if after.size else count
            left_wall = int(key[lo - 1]) if lo > 0 else big
            right_wall = int(key[hi]) if hi < count else big
            unplaced = ~placed
            inside = (first >= lo) & (last <= hi)
            candidate = unplaced & inside & (min_off <= f)
            # lowest address each unplaced buffer could take if nothing sits at f where it is
            crossing = np.maximum(np.where(first < lo, left_wall, 0), np.where(last > hi, right_wall, 0))
            bound = np.where(inside, np.maximum(min_off, f + min_size), np.maximum(crossing, min_off))
            width = hi - lo
            per_section = np.cumsum(np.bincount(first[candidate] - lo, minlength=width + 1)
                                    - np.bincount(last[candidate] - lo, minlength=width + 1))[:width]
            busy = remaining[lo:hi] > 0
            empty = np.flatnonzero(busy & (per_section == 0))
            if empty.size:
                forced = []
                for t in (lo + empty[:_FORCED_PER_NODE]).tolist():
                    covering = unplaced & (first <= t) & (last > t)
                    target = int(bound[covering].min())
                    if target + int(rem_bytes[t]) > capacity:
                        return [f, (), (), 0, None]  # dead end: the section cannot hold its buffers
                    forced.append((t, target))
                return [f, (), forced, 0, None]
            t = lo + int(np.argmin(np.where(busy, per_section, n + 1)))
            covering = unplaced & (first <= t) & (last > t)
            chosen = np.flatnonzero(candidate & covering)
            candidates = sorted(chosen.tolist(), key=rank.__getitem__)
            target = int(bound[covering].min())
            raises = ((t, target),) if target + int(rem_bytes[t]) <= capacity else ()
            return [f, candidates, raises, 0, None]

        stack = [expand()]
        while stack:
            frame = stack[-1]
            f, candidates, raises, choice, undo = frame
            if undo is not None:  # take back the previous branch of this node
                u, old_mins = undo
                for v, m in old_mins:
                    min_off[v] = m
                if u >= 0:
                    a, b = firsts[u], lasts[u]
                    remaining[a:b] += 1
                    rem_bytes[a:b] += size_list[u]
                    key[a:b] = f
                    placed[u] = False
                    left += 1
                else:
                    for t, _ in raises:
                        key[t] = f
                frame[4] = None
            nodes += 1
            if deadline is not None and time.perf_counter() > deadline:
                return SearchResult(None, False, nodes)
            if node_limit is not None and nodes > node_limit:
                return SearchResult(None, False, nodes)
            if choice < len(candidates):
                u = candidates[choice]
                frame[3] = choice + 1
                old_mins = []
                for v in candidates[:choice]:  # tried before at this floor: not here again
                    old_mins.append((v, int(min_off[v])))
                    min_off[v] = f + 1
                top = f + size_list[u]
                a, b = firsts[u], lasts[u]
                remaining[a:b] -= 1
                rem_bytes[a:b] -= size_list[u]
                key[a:b] = np.where(remaining[a:b] > 0, top, big)
                placed[u] = True
                offset[u] = f
                left -= 1
                frame[4] = (u, old_mins)
                if top > capacity:
                    continue
                if left == 0:
                    offsets = {i: 0 for i in ids}
                    for j, original in enumerate(self.index):
                        offsets[ids[original]] = offset[j]
                    return SearchResult(offsets, False, nodes)
                stack.append(expand())
                continue
            if choice == len(candidates) and raises:
                frame[3] = choice + 1
                old_mins = []
                for v in candidates:
                    old_mins.append((v, int(min_off[v])))
                    min_off[v] = f + 1
                for t, target in raises:
                    key[t] = target
                frame[4] = (-1, old_mins)
                stack.append(expand())
                continue
            stack.pop()
        return SearchResult(None, True, nodes)

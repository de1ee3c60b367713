"""Exact search for a placement within a capacity, after MiniMalloc (Moffitt, ASPLOS 2023).

The method, as the paper describes it; the implementation (numpy state over buffers and time
sections, undo records, Python recursion) is this project's own:

* **Canonical solutions.** It is enough to search placements where every buffer rests at
  address 0 or directly on a buffer alive at the same time, and to place buffers in order of
  non-decreasing offset (ties by a fixed *preorder* rank). So a buffer's only possible offset is
  its *minimum offset*: the highest end among the placed buffers it overlaps in time. A node
  branches on which unplaced buffer comes next; buffers are tried by (minimum offset, rank),
  and only those after the last placed one in that order (no placement is reached twice).
* **Dominance.** Placing a buffer at offset ``x`` is skipped when some unplaced buffer could
  end at or below ``x`` (``min offset + size <= x``): that buffer would be left below a gap it
  could fill, and the branch where it is placed first is at least as good.
* **Inference (section bounds).** Time is cut into sections between consecutive lifetime
  endpoints. Each section keeps a *floor* (no unplaced buffer alive there can go lower: the top
  of the last buffer placed there, the smallest minimum offset of its unplaced buffers, and the
  offset just placed, since offsets never decrease) and the bytes of its unplaced buffers. A
  node is pruned when floor + unplaced bytes exceeds the capacity in any section.
* **Symmetry.** Buffers with the same lifetime and size are interchangeable; they always
  share their minimum offset, and only the first of them (by rank) not yet placed is a
  candidate, so their permutations are not searched. Buffers with the same lifetime stacked
  directly on each other can swap places without changing anything else (a buffer alive with
  them can only rest on the top of such a stack), so a buffer is not placed directly on one
  of the same lifetime and a higher rank.
* **Dynamic decomposition.** When no unplaced buffer crosses a section boundary any more, the
  two sides are independent: each is solved on its own, and if one has no solution the node
  fails at once (no search over combinations of the two sides). Each part gets its own
  preorder, ranked like the whole instance but by the unplaced bytes of its sections *at that
  moment* (MiniMalloc sorts every part it creates afresh): the buffers that now bound a part's
  height come first. Without it, three of MiniMalloc's eleven challenging instances (E, H, I)
  were out of reach in 60 s; with it, one of the preorders packs each in under 20,000 nodes.
  The same-lifetime stacking rule compares ranks only between buffers placed under one ranking.
* **Restarts.** :func:`search_place` runs with one preorder; callers restart with each of
  :data:`PREORDERS` under a node limit that doubles per round (MiniMalloc's round robin).

When the search ends without a placement and without hitting a limit, none exists within the
capacity (``SearchResult.exhausted``): the tests check this against brute force.

Example:
    >>> from ms_memopt.core.placement import Buffer
    >>> bufs = [Buffer("a", 0, 3, 4), Buffer("b", 3, 9, 4), Buffer("c", 0, 9, 4)]
    >>> result = search_place(bufs, capacity=8)
    >>> result.offsets is not None and result.exhausted is False
    True
    >>> search_place(bufs, capacity=7).exhausted
    True
"""
from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ms_memopt.analysis.planner import _native
from ms_memopt.analysis.planner.greedy import live_peak_per_buffer
from ms_memopt.analysis.planner.sections import Sections
from ms_memopt.core.placement import Buffer

__all__ = ["PREORDERS", "SearchResult", "search_place"]

# name -> key per buffer (smallest first): T = the largest unplaced-bytes total of a section in
# its lifetime ("breadth"), A = area, W = width (lifetime); the letters say which key comes first
PREORDERS: dict[str, Callable[[Buffer, int], tuple]] = {
    "TAW": lambda b, total: (-total, -b.area, -b.lifetime),
    "WAT": lambda b, total: (-b.lifetime, -b.area, -total),
    "TWA": lambda b, total: (-total, -b.lifetime, -b.area),
}

# The floor of a section may also be raised to the smallest minimum offset of its unplaced
# buffers; that needs a section -> buffers table, skipped when it would exceed this many entries
_MAX_INCIDENCE = 4_000_000

_FOUND, _NONE, _ABORT = 0, 1, 2


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
                 prefer: str = "TAW", node_limit: int | None = None, engine: str = "auto") -> SearchResult:
    """Find offsets with every buffer ending at or below ``capacity`` bytes, or prove there are none.

    Args:
        buffers: the instance (zero-size buffers get offset 0 and take no part).
        capacity: bytes available.
        deadline: ``time.perf_counter()`` value after which the search gives up (not exhausted).
        prefer: the preorder, a key of :data:`PREORDERS`.
        node_limit: give up after this many nodes.
        engine: ``"python"`` (this module), ``"native"`` (the compiled twin, ``_search.c``; raises
            RuntimeError when it cannot be built) or ``"auto"`` (native when it can be built).
            Both visit the same nodes and return the same offsets.
    """
    if engine not in ("auto", "python", "native"):
        raise ValueError(f"engine must be 'auto', 'python' or 'native', got {engine!r}")
    solver = _Solver(buffers, capacity, prefer)
    lib = None if engine == "python" else _native.library()
    if lib is None and engine == "native":
        raise RuntimeError(f"the compiled search is unavailable: {_native.unavailable_reason()}")
    if lib is not None:
        return solver.run_native(lib, deadline, node_limit)
    return solver.run(deadline, node_limit)


class _Solver:
    """State of one search: numpy arrays over the positive-size buffers and their sections."""

    def __init__(self, buffers: Sequence[Buffer], capacity: int, prefer: str) -> None:
        self.ids = [b.id for b in buffers]
        self.index = [i for i, b in enumerate(buffers) if b.size > 0]
        sub = [buffers[i] for i in self.index]
        self.capacity = capacity
        n = self.n = len(sub)
        if n == 0:
            return
        sec = Sections.of(sub)
        count = self.count = sec.count
        first = self.first = np.asarray(sec.first, dtype=np.int64)
        last = self.last = np.asarray(sec.last, dtype=np.int64)
        size = self.size = np.fromiter((b.size for b in sub), dtype=np.int64, count=n)
        delta = np.zeros(count + 1, dtype=np.int64)
        np.add.at(delta, first, size)
        np.add.at(delta, last, -size)
        self.total = np.cumsum(delta)[:-1]  # unplaced bytes per section
        # cuts[k]: buffers crossing the boundary between sections k and k + 1
        delta[:] = 0
        np.add.at(delta, first, 1)
        np.add.at(delta, last - 1, -1)
        self.cuts = np.cumsum(delta)[:count - 1] if count > 1 else np.zeros(0, dtype=np.int64)
        self.sub, self.prefer = sub, prefer
        peak = live_peak_per_buffer(sub)
        key = PREORDERS[prefer]
        order = sorted(range(n), key=lambda i: (key(sub[i], int(peak[i])), i))
        self.rank = np.empty(n, dtype=np.int64)
        self.rank[order] = np.arange(n)
        # per placed buffer, the part (and so the ranking) it was placed in; see _search_part
        self.epoch = np.zeros(n, dtype=np.int64)
        self.cur_epoch = self.epochs = 0
        self.twin = self._twins(sub)
        self.kin_ptr, self.kin = self._kin(sub)
        self.overlaps = self._overlaps()
        self.incidence = self._incidence()
        self.floor = np.zeros(count, dtype=np.int64)
        self.min_off = np.zeros(n, dtype=np.int64)
        self.placed = np.zeros(n, dtype=bool)
        self.offset = np.zeros(n, dtype=np.int64)
        self.nodes = 0

    def _twins(self, sub: Sequence[Buffer]) -> np.ndarray:
        """Per buffer, the buffer of the same lifetime and size just before it by rank, or -1."""
        twin = np.full(self.n, -1, dtype=np.int64)
        previous: dict[tuple[int, int, int], int] = {}
        for i in np.argsort(self.rank).tolist():
            key = (sub[i].lower, sub[i].upper, sub[i].size)
            twin[i] = previous.get(key, -1)
            previous[key] = i
        return twin

    def _kin(self, sub: Sequence[Buffer]) -> tuple[np.ndarray, np.ndarray]:
        """Per buffer, the other buffers of the same lifetime (CSR: pointers, flat indices)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, b in enumerate(sub):
            groups.setdefault((b.lower, b.upper), []).append(i)
        lists = [[j for j in groups[(b.lower, b.upper)] if j != i] for i, b in enumerate(sub)]
        pointers = np.zeros(self.n + 1, dtype=np.int64)
        pointers[1:] = np.cumsum([len(x) for x in lists])
        flat = np.fromiter((j for x in lists for j in x), dtype=np.int64, count=int(pointers[-1]))
        return pointers, flat

    def _stacked_on_higher_rank(self, u: int, off: int, rank: int) -> bool:
        """Whether u at ``off`` would sit directly on a placed buffer of the same lifetime and a
        higher rank (the two swapped is the same placement, searched in the other order)."""
        kin = self.kin[self.kin_ptr[u]:self.kin_ptr[u + 1]]
        if kin.size == 0:
            return False
        below = kin[self.placed[kin] & (self.epoch[kin] == self.cur_epoch) & (self.offset[kin] + self.size[kin] == off)]
        return bool((self.rank[below] > rank).any())

    def _overlaps(self) -> list[np.ndarray]:
        """Per buffer, the indices of the other buffers alive at some common time."""
        first, last = self.first, self.last
        by_first = np.argsort(first, kind="stable")
        sorted_first = first[by_first]
        result = []
        for i in range(self.n):
            # only buffers starting before i ends can overlap it
            stop = int(np.searchsorted(sorted_first, last[i], side="left"))
            cand = by_first[:stop]
            cand = cand[last[cand] > first[i]]
            result.append(cand[cand != i])
        return result

    def _incidence(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Section -> buffers table (flat buffer indices, section start pointers), or None."""
        spans = self.last - self.first
        entries = int(spans.sum())
        if entries > _MAX_INCIDENCE:
            return None
        owners = np.repeat(np.arange(self.n), spans)
        starts = np.repeat(np.cumsum(spans) - spans, spans)
        sections = self.first[owners] + (np.arange(entries) - starts)
        order = np.argsort(sections, kind="stable")
        pointers = np.searchsorted(sections[order], np.arange(self.count + 1))
        return owners[order], pointers

    # ------------------------------------------------------------------ search

    def run(self, deadline: float | None, node_limit: int | None) -> SearchResult:
        if self.n == 0:
            return SearchResult({i: 0 for i in self.ids}, False, 0)
        if int(self.size.max()) > self.capacity or int(self.total.max()) > self.capacity:
            return SearchResult(None, True, 0)
        self.deadline = deadline
        self.node_limit = node_limit
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 4 * self.n + 1000))  # one frame per placed buffer
        try:
            status = _FOUND
            for lo, hi in self._split(0, self.count):
                members = np.flatnonzero((self.first < hi) & (self.last > lo))
                status = self._search_part(members, lo, hi)
                if status != _FOUND:
                    break
        finally:
            sys.setrecursionlimit(limit)
        if status == _FOUND:
            return self._result()
        return SearchResult(None, status == _NONE, self.nodes)

    def run_native(self, lib, deadline: float | None, node_limit: int | None) -> SearchResult:
        """:meth:`run` in the compiled twin (same nodes, same offsets)."""
        if self.n == 0 or int(self.size.max()) > self.capacity or int(self.total.max()) > self.capacity:
            return self.run(deadline, node_limit)
        ov_ptr = np.zeros(self.n + 1, dtype=np.int64)
        ov_ptr[1:] = np.cumsum([len(o) for o in self.overlaps])
        ov_idx = np.ascontiguousarray(np.concatenate(self.overlaps) if self.n else [], dtype=np.int64)
        if self.incidence is None:
            inc_owner = inc_ptr = None
        else:
            inc_owner, inc_ptr = (np.ascontiguousarray(x, dtype=np.int64) for x in self.incidence)
        total, cuts = self.total.copy(), np.ascontiguousarray(self.cuts.copy())
        offset = np.zeros(self.n, dtype=np.int64)
        nodes = ctypes.c_int64(0)
        seconds = -1.0 if deadline is None else max(0.0, deadline - time.perf_counter())

        def ptr(array):
            return None if array is None else array.ctypes.data_as(ctypes.c_void_p)

        rank = self.rank.copy()  # the compiled search re-ranks parts in place
        area = np.fromiter((b.area for b in self.sub), dtype=np.int64, count=self.n)
        width = np.fromiter((b.lifetime for b in self.sub), dtype=np.int64, count=self.n)
        prefer = ctypes.create_string_buffer(self.prefer.encode("ascii"), 3)
        status = lib.ms_memopt_search(self.n, self.count, self.capacity, ptr(self.first), ptr(self.last),
                                      ptr(self.size), ptr(rank), ptr(area), ptr(width),
                                      ctypes.cast(prefer, ctypes.c_void_p), ptr(self.twin), ptr(self.kin_ptr),
                                      ptr(self.kin), ptr(ov_ptr), ptr(ov_idx),
                                      ptr(inc_ptr), ptr(inc_owner), ptr(total), ptr(cuts), ptr(offset),
                                      -1 if node_limit is None else int(node_limit), seconds,
                                      ctypes.byref(nodes))
        self.nodes = int(nodes.value)
        if status == _FOUND:
            self.offset = offset
            return self._result()
        return SearchResult(None, status == _NONE, self.nodes)

    def _result(self) -> SearchResult:
        offsets = {i: 0 for i in self.ids}
        for j, original in enumerate(self.index):
            offsets[self.ids[original]] = int(self.offset[j])
        return SearchResult(offsets, False, self.nodes)

    def _split(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Section ranges of [lo, hi) between boundaries that no unplaced buffer crosses."""
        zero = lo + 1 + np.flatnonzero(self.cuts[lo:hi - 1] == 0)
        points = [lo, *zero.tolist(), hi]
        return [(a, b) for a, b in zip(points[:-1], points[1:])]

    def _search(self, members: np.ndarray, lo: int, hi: int, last_off: int, last_rank: int) -> int:
        """Place the unplaced ``members`` (all alive only within sections [lo, hi))."""
        self.nodes += 1
        if self.node_limit is not None and self.nodes > self.node_limit:
            return _ABORT
        if self.deadline is not None and (self.nodes & 63) == 0 and time.perf_counter() > self.deadline:
            return _ABORT
        unplaced = members[~self.placed[members]]
        if unplaced.size == 0:
            return _FOUND
        min_off, size, rank = self.min_off[unplaced], self.size[unplaced], self.rank[unplaced]
        order = np.lexsort((rank, min_off))
        min_height = int((min_off + size).min())
        offs, ranks = min_off[order], rank[order]
        # canonical: strictly after the last placement in (offset, rank) order; dominance:
        # below the lowest possible top of any unplaced buffer
        # inference: an offset above cap - (unplaced bytes) of some section empties nothing there
        highest = self.capacity - int(self.total[lo:hi].max())
        start = int(np.searchsorted(offs, last_off, side="left"))
        stop = int(np.searchsorted(offs, min(min_height, highest + 1), side="left"))
        for k in range(start, stop):
            off = int(offs[k])
            if off == last_off and int(ranks[k]) < last_rank:
                continue
            u = int(unplaced[order[k]])
            twin = int(self.twin[u])
            if twin >= 0 and not self.placed[twin]:
                continue  # its identical predecessor goes first
            if self._stacked_on_higher_rank(u, off, int(ranks[k])):
                continue
            status = self._place_and_recurse(u, off, int(ranks[k]), members, lo, hi)
            if status != _NONE:
                return status
        return _NONE

    def _place_and_recurse(self, u: int, off: int, rank: int, members: np.ndarray, lo: int, hi: int) -> int:
        size = int(self.size[u])
        top = off + size
        a, b = int(self.first[u]), int(self.last[u])
        floor, total, min_off, placed = self.floor, self.total, self.min_off, self.placed
        # place u; raise the minimum offset of the unplaced buffers it overlaps
        placed[u] = True
        self.offset[u] = off
        self.epoch[u] = self.cur_epoch
        neighbours = self.overlaps[u]
        neighbours = neighbours[~placed[neighbours]]
        raised = neighbours[min_off[neighbours] < top]
        old_min = min_off[raised]
        min_off[raised] = top
        # floors: u's sections now start at its top; sections of raised buffers at their
        # lowest unplaced minimum offset
        span_lo, span_hi = a, b
        if raised.size and self.incidence is not None:
            span_lo = min(a, int(self.first[raised].min()))
            span_hi = max(b, int(self.last[raised].max()))
        old_floor = floor[span_lo:span_hi].copy()
        floor[a:b] = top
        total[a:b] -= size
        if raised.size and self.incidence is not None:
            self._raise_to_unplaced_min(span_lo, span_hi)
        if b - a > 1:
            self.cuts[a:b - 1] -= 1
        status = _NONE
        view = slice(lo, hi)
        if not (np.maximum(floor[view], off) + total[view] > self.capacity).any():
            if b - a > 1 and (self.cuts[a:b - 1] == 0).any():
                status = self._decompose(members, lo, hi, off, rank)
            else:
                status = self._search(members, lo, hi, off, rank)
        # undo
        if b - a > 1:
            self.cuts[a:b - 1] += 1
        total[a:b] += size
        floor[span_lo:span_hi] = old_floor
        min_off[raised] = old_min
        placed[u] = False
        return status

    def _raise_to_unplaced_min(self, lo: int, hi: int) -> None:
        """floor[s] = max(floor[s], smallest minimum offset of an unplaced buffer alive in s)."""
        owners, pointers = self.incidence
        begin, end = int(pointers[lo]), int(pointers[hi])
        if begin == end:
            return
        segment = owners[begin:end]
        # placed buffers count as the capacity: a section with none unplaced is not raised past it
        values = np.where(self.placed[segment], self.capacity, self.min_off[segment])
        # a range of sections spanned by buffers holds a buffer in each section: no empty segment
        mins = np.minimum.reduceat(values, pointers[lo:hi] - begin)
        np.maximum(self.floor[lo:hi], np.minimum(mins, self.capacity), out=self.floor[lo:hi])

    def _decompose(self, members: np.ndarray, lo: int, hi: int, off: int, rank: int) -> int:
        """Solve each independent part of [lo, hi) on its own; all must succeed."""
        unplaced = members[~self.placed[members]]
        first, last = self.first[unplaced], self.last[unplaced]
        for part_lo, part_hi in self._split(lo, hi):
            inside = unplaced[(first < part_hi) & (last > part_lo)]
            if inside.size == 0:
                continue
            status = self._search_part(inside, part_lo, part_hi)
            if status != _FOUND:
                return status
        return _FOUND

    def _search_part(self, inside: np.ndarray, lo: int, hi: int) -> int:
        """Search an independent part with its own preorder, ranked by the unplaced bytes of
        the sections as they are now (MiniMalloc re-sorts each part it decomposes into).

        Placements made here get a fresh epoch: the same-lifetime stacking rule compares ranks
        only between buffers placed under the same ranking.
        """
        saved = self.rank[inside].copy()
        key = PREORDERS[self.prefer]
        totals = [int(self.total[self.first[i]:self.last[i]].max()) for i in inside.tolist()]
        order = sorted(range(len(inside)), key=lambda j: (key(self.sub[int(inside[j])], totals[j]),
                                                          int(inside[j])))
        self.rank[inside[order]] = np.arange(len(inside))
        outer = self.cur_epoch
        self.epochs += 1
        self.cur_epoch = self.epochs
        try:
            return self._search(inside, lo, hi, -1, -1)
        finally:
            self.cur_epoch = outer
            self.rank[inside] = saved

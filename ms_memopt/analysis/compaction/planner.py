"""Compaction planner: which live blocks move where so that holes merge.

The planner is framework-free and works on a :class:`~ms_memopt.core.layout.Layout`; the simulator's
``compact`` policy and the :class:`~ms_memopt.analysis.arena.Arena` executor share it.

Three phases, as in the field report's operator:

1. **mark** — the live blocks of each segment, in address order; pinned blocks (in use by a
   pending stream or collective) never move and cut their segment into independent *windows*;
2. **scan** — low to high address, each movable block's target is the end of the blocks below
   it in its window (a *slide down*); optionally a whole segment whose blocks fit into holes of
   other segments (same pool and stream) is *evacuated* so the pool can release it;
3. **emit** — an ordered move list that is safe to execute one move after the other with
   memmove semantics (a move may overlap its own source; it never overwrites the source of a
   later move or the destination of an earlier one).

Why ascending order is safe: in a window every target satisfies ``dst <= src``; a block's
destination ``[dst, dst + size)`` ends at or below the next block's source, so moving blocks in
ascending order never overwrites bytes still to be read. Evacuation moves come after every
slide: their destinations are holes the slides opened, in other segments than their sources.

Bounds keep the work cheap: ``max_bytes`` stops before the first move that would exceed it
(later blocks stay where they are, which is always a valid layout); ``target_largest_free``
(say the next AllReduce bucket) moves only the cheapest range of blocks whose sliding merges
enough holes into one of that size (:func:`cheapest_window`), instead of compacting everything.

Example:
    >>> from ms_memopt.core.layout import Block, Layout, Segment
    >>> seg = Segment(0, 400, [Block(0, 100, False), Block(100, 100, True, id=1),
    ...                        Block(200, 100, False), Block(300, 100, True, id=2)])
    >>> plan = plan_compaction(Layout([seg]))
    >>> [(m.block_id, m.src, m.dst) for m in plan.moves]
    [(1, 100, 0), (2, 300, 100)]
    >>> plan.after.largest_free, plan.after.frag_ratio, plan.bytes_moved
    (200, 0.0, 200)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.core.metrics import LayoutMetrics, measure

__all__ = ["Move", "Run", "CompactionPlan", "plan_compaction", "plan_opening", "apply_plan", "slide_targets",
           "cheapest_window", "cheapest_opening", "coalesce_runs", "run_bounds"]


@dataclass(frozen=True, slots=True)
class Move:
    """Move the live block ``block_id`` from ``src`` to ``dst`` (``size`` bytes)."""

    block_id: int | None
    src: int
    dst: int
    size: int

    def to_dict(self) -> dict:
        return {"block_id": self.block_id, "src": self.src, "dst": self.dst, "size": self.size}


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive moves whose sources are adjacent and that shift by the same delta: one
    memmove of ``size`` bytes from ``src`` to ``dst``; ``moves`` indexes the plan's move list
    (``range(first, first + count)``)."""

    src: int
    dst: int
    size: int
    first: int
    count: int


@dataclass(slots=True)
class CompactionPlan:
    """An ordered move list and its predicted effect.

    ``layout`` is the predicted layout after the moves (see :func:`apply_plan` for its
    contract); ``before``/``after`` its metrics; ``released`` the segments emptied by
    evacuation (dropped from ``layout``: the pool can give them back to the device);
    ``stopped_by`` is ``None`` for a full plan, else ``"max_bytes"`` or
    ``"target_largest_free"``.
    """

    moves: list[Move]
    layout: Layout
    before: LayoutMetrics
    after: LayoutMetrics
    bytes_moved: int
    released: list[tuple[int, int]] = field(default_factory=list)
    stopped_by: str | None = None

    def runs(self) -> list[Run]:
        """The moves merged into memmove runs (see :func:`coalesce_runs`)."""
        if not self.moves:
            return []
        src = np.fromiter((m.src for m in self.moves), dtype=np.int64, count=len(self.moves))
        dst = np.fromiter((m.dst for m in self.moves), dtype=np.int64, count=len(self.moves))
        size = np.fromiter((m.size for m in self.moves), dtype=np.int64, count=len(self.moves))
        return coalesce_runs(src, dst, size)

    def summary(self) -> dict:
        """Predicted figures, JSON-ready (sizes in bytes)."""
        return {
            "moves": len(self.moves),
            "bytes_moved": self.bytes_moved,
            "released_segments": len(self.released),
            "released_bytes": sum(size for _, size in self.released),
            "stopped_by": self.stopped_by,
            "free_total_before": self.before.free_total,
            "largest_free_before": self.before.largest_free,
            "frag_ratio_before": self.before.frag_ratio,
            "free_total_after": self.after.free_total,
            "largest_free_after": self.after.largest_free,
            "frag_ratio_after": self.after.frag_ratio,
        }


# --- the array core (shared with the Arena executor) ----------------------------------------

def slide_targets(addrs: np.ndarray, sizes: np.ndarray, pinned: np.ndarray, start: int, end: int,
                  *, max_bytes: int | None = None) -> tuple[np.ndarray, str | None]:
    """Slide-down targets for the live blocks of one segment ``[start, end)``.

    ``addrs``, ``sizes``, ``pinned`` describe the live blocks sorted by address (bytes). Returns
    ``(targets, stopped_by)``: ``targets[i] <= addrs[i]``, equal for pinned blocks and for blocks
    past the ``max_bytes`` bound (``stopped_by == "max_bytes"``). Executing
    ``addrs[i] -> targets[i]`` in index order is memmove-safe.

    Example:
        >>> t, _ = slide_targets(np.array([10, 50, 70]), np.array([10, 10, 10]),
        ...                      np.array([False, True, False]), 0, 100)
        >>> t.tolist()
        [0, 50, 60]
    """
    addrs = np.asarray(addrs, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    pinned = np.asarray(pinned, dtype=bool)
    n = len(addrs)
    if n == 0:
        return addrs.copy(), None
    ends = addrs + sizes
    # A window starts at the end of the last pinned block at or below each block.
    window_start = np.maximum.accumulate(np.where(pinned, ends, start))
    movable_sizes = np.where(pinned, 0, sizes)
    below = np.cumsum(movable_sizes) - movable_sizes          # movable bytes below, whole segment
    below_at_window = np.maximum.accumulate(np.where(pinned, below, 0))
    targets = np.where(pinned, addrs, window_start + below - below_at_window)
    stopped_by = None
    if max_bytes is not None:
        spent = np.cumsum(np.where(targets != addrs, sizes, 0))
        over = np.flatnonzero(spent > max_bytes)
        if len(over):
            cut = int(over[0])
            targets[cut:] = addrs[cut:]
            stopped_by = "max_bytes"
    return targets, stopped_by


def cheapest_opening(layout: Layout, target: int, *, respect_pinned: bool = True
                     ) -> tuple[int, list[Block], Segment] | None:
    """The cheapest set of live blocks whose sliding opens a hole of ``target`` bytes in one segment
    of ``layout``: ``(bytes moved, the blocks that move, their segment)`` over every segment
    (:func:`cheapest_window` in each), or ``None`` when no segment's holes add up to ``target``.
    ``respect_pinned=False`` treats every block as movable (a model's layout, which pins nothing)."""
    best = None
    for seg in layout.segments:
        live = [b for b in seg.blocks if b.live]
        addrs = np.array([b.addr for b in live], dtype=np.int64)
        sizes = np.array([b.size for b in live], dtype=np.int64)
        pinned = np.array([bool(b.pinned) and respect_pinned for b in live], dtype=bool)
        found = cheapest_window(addrs, sizes, pinned, seg.addr, seg.end, target)
        if found is None:
            continue
        targets, cost = found
        if best is None or cost < best[0]:
            best = (cost, [b for b, t in zip(live, targets.tolist()) if t != b.addr], seg)
    return best


def cheapest_window(addrs: np.ndarray, sizes: np.ndarray, pinned: np.ndarray, start: int, end: int,
                    target: int) -> tuple[np.ndarray, int] | None:
    """The cheapest slide that opens a hole of ``target`` bytes in one segment ``[start, end)``.

    Sliding the movable blocks between hole ``i`` and hole ``j`` of a window down to the start
    of hole ``i`` merges holes ``i..j`` into one; it costs the bytes of those blocks. Among all
    such ranges whose holes add up to ``target`` the cheapest is found with two pointers
    (costs are positive, so for each ``j`` the best ``i`` is the largest that still reaches the
    target, and it never moves left). Returns ``(targets, cost)`` (``targets`` as in
    :func:`slide_targets`, moving only that range) or ``None`` when no window holds
    ``target`` free bytes in total.

    Example:
        >>> t, cost = cheapest_window(np.array([0, 20, 100, 110]), np.array([10, 70, 10, 10]),
        ...                           np.zeros(4, dtype=bool), 0, 130, 20)
        >>> t.tolist(), cost   # moving the two small blocks is cheaper than the 70-byte one
        ([0, 20, 90, 100], 20)
    """
    addrs = np.asarray(addrs, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    n = len(addrs)
    gap_start = np.concatenate(([start], addrs + sizes)).tolist()   # hole k lies before block k
    gaps = (np.append(addrs, end) - np.asarray(gap_start, dtype=np.int64)).tolist()
    size_list = sizes.tolist()
    pinned_list = np.asarray(pinned, dtype=bool).tolist()
    best: tuple[int, int, int] | None = None        # (cost, i, j)
    i, hole, cost = 0, 0, 0
    for j in range(n + 1):
        if j > 0:
            if pinned_list[j - 1]:                   # a pinned block closes the window
                i, hole, cost = j, 0, 0
            else:
                cost += size_list[j - 1]
        hole += gaps[j]
        while i < j and hole - gaps[i] >= target:
            hole -= gaps[i]
            cost -= size_list[i]
            i += 1
        if hole >= target and (best is None or cost < best[0]):
            best = (cost, i, j)
    if best is None:
        return None
    cost, i, j = best
    targets = addrs.copy()
    block_sizes = sizes[i:j]
    targets[i:j] = gap_start[i] + np.cumsum(block_sizes) - block_sizes
    return targets, cost


def run_bounds(src: np.ndarray, dst: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index bounds ``(starts, stops)`` of the runs in a move list (see :func:`coalesce_runs`);
    arrays, for executors that loop over thousands of runs."""
    n = len(src)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    joins = (src[1:] == src[:-1] + size[:-1]) & ((src[1:] - dst[1:]) == (src[:-1] - dst[:-1]))
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return starts, np.append(starts[1:], n)


def coalesce_runs(src: np.ndarray, dst: np.ndarray, size: np.ndarray) -> list[Run]:
    """Merge consecutive moves into runs: move ``i+1`` joins move ``i``'s run when its source
    starts where ``i``'s ends and both shift by the same delta (one memmove moves both).

    Example:
        >>> [(r.src, r.dst, r.size, r.count) for r in coalesce_runs(
        ...     np.array([10, 20, 40]), np.array([0, 10, 20]), np.array([10, 10, 5]))]
        [(10, 0, 20, 2), (40, 20, 5, 1)]
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    size = np.asarray(size, dtype=np.int64)
    starts, stops = run_bounds(src, dst, size)
    ends = src + size
    return [Run(int(src[a]), int(dst[a]), int(ends[b - 1] - src[a]), int(a), int(b - a))
            for a, b in zip(starts.tolist(), stops.tolist())]


# --- the Layout planner ---------------------------------------------------------------------

def plan_compaction(layout: Layout, *, max_bytes: int | None = None,
                    target_largest_free: int | None = None, evacuate: bool = False,
                    release_empty: bool = True) -> CompactionPlan:
    """Plan a compaction of ``layout``.

    Args:
        layout: segments with live blocks (``pinned`` blocks stay put). Not modified.
        max_bytes: bound on the bytes moved (``None``: no bound).
        target_largest_free: only open one hole of this many bytes, as cheaply as possible
            (``None``: compact fully). When no window can hold it, compact fully.
        evacuate: after sliding, move every block of a whole segment (no pinned block) into holes
            of other segments of the same pool and stream when they fit, smallest segments first,
            so the segment becomes empty.
        release_empty: drop segments emptied by evacuation from the predicted layout (they are
            listed in ``plan.released``); keep them as one hole otherwise.

    Returns:
        A :class:`CompactionPlan`; ``plan.layout`` is ``apply_plan(layout, plan)``.

    Example:
        >>> from ms_memopt.core.layout import Block, Layout, Segment
        >>> a = Segment(0, 100, [Block(0, 40, True, id=1), Block(40, 60, False)])
        >>> b = Segment(1000, 100, [Block(1000, 50, False), Block(1050, 30, True, id=2),
        ...                         Block(1080, 20, False)])
        >>> plan = plan_compaction(Layout([a, b]), evacuate=True)
        >>> [(m.block_id, m.src, m.dst) for m in plan.moves], plan.released
        ([(2, 1050, 40)], [(1000, 100)])
    """
    before = measure(layout)
    segments = sorted(layout.segments, key=lambda s: s.addr)
    live_of = [[b for b in seg.blocks if b.live] for seg in segments]
    arrays = [(np.fromiter((b.addr for b in live), dtype=np.int64, count=len(live)),
               np.fromiter((b.size for b in live), dtype=np.int64, count=len(live)),
               np.fromiter((b.pinned for b in live), dtype=bool, count=len(live))) for live in live_of]
    new_addrs = [a.copy() for a, _, _ in arrays]
    budget = max_bytes
    stopped_by = None
    target_reached = target_largest_free is not None and before.largest_free >= target_largest_free
    if target_largest_free is not None and not target_reached:
        # the cheapest range of blocks, over all segments, whose sliding opens the target hole
        best = None
        for k, (seg, (addrs, sizes, pinned)) in enumerate(zip(segments, arrays)):
            found = cheapest_window(addrs, sizes, pinned, seg.addr, seg.end, target_largest_free)
            if found is not None and (best is None or found[1] < best[2]):
                best = (k, found[0], found[1])
        if best is not None and (budget is None or best[2] <= budget):
            k, targets, cost = best
            new_addrs[k] = targets
            budget = None if budget is None else budget - cost
            stopped_by = "target_largest_free"
            target_reached = True
    if not target_reached:
        for k, (seg, (addrs, sizes, pinned)) in enumerate(zip(segments, arrays)):
            if stopped_by == "max_bytes" or not len(addrs):
                continue
            targets, why = slide_targets(addrs, sizes, pinned, seg.addr, seg.end, max_bytes=budget)
            new_addrs[k] = targets
            if budget is not None:
                budget -= int(sizes[targets != addrs].sum())
            stopped_by = why or stopped_by
    slides = [[Move(b.id, b.addr, int(t), b.size) for b, t in zip(live, targets.tolist()) if t != b.addr]
              for live, targets in zip(live_of, new_addrs)]
    post_slide = [list(zip(targets.tolist(), live)) for live, targets in zip(live_of, new_addrs)]

    evacuations: list[Move] = []
    released: list[tuple[int, int]] = []
    if evacuate and not target_reached and stopped_by != "max_bytes":
        budget = _evacuate(segments, slides, post_slide, evacuations, released, budget)
        if budget is not None and budget < 0:  # pragma: no cover - _evacuate never overspends
            raise AssertionError("evacuation overspent its budget")

    moves = [m for seg_moves in slides for m in seg_moves] + evacuations
    plan = CompactionPlan(moves=moves, layout=layout, before=before, after=before,
                          bytes_moved=sum(m.size for m in moves), released=released,
                          stopped_by=stopped_by)
    plan.layout = apply_plan(layout, plan, release_empty=release_empty)
    plan.after = measure(plan.layout)
    return plan


def plan_opening(layout: Layout, need: int) -> CompactionPlan | None:
    """Open one hole of ``need`` bytes in a compacted layout (every segment's live blocks at its
    low end, as :func:`plan_compaction` leaves them) by moving some blocks of one segment into the
    top holes of others of the same pool and stream, then sliding the rest of it down: what the
    slides and whole-segment evacuations cannot do when every segment is nearly full but the
    request fits in none. The segment chosen is the one that moves the fewest bytes; its largest
    blocks that fit a hole elsewhere go first (best fit), the highest of a size first. ``None`` when no segment can be opened
    so, or a hole of ``need`` is there already.

    Example: two 100 B segments each with 60 B live; 70 B asked: 30 B move out of the second.
        >>> from ms_memopt.core.layout import Block, Layout, Segment
        >>> a = Segment(0, 100, [Block(0, 60, True, id=1), Block(60, 40, False)])
        >>> b = Segment(200, 100, [Block(200, 30, True, id=2), Block(230, 30, True, id=3), Block(260, 40, False)])
        >>> plan = plan_opening(Layout([a, b]), 70)
        >>> [(m.block_id, m.src, m.dst) for m in plan.moves], plan.after.largest_free
        ([(3, 230, 60)], 70)
    """
    before = measure(layout)
    if before.largest_free >= need:
        return None
    segments = sorted(layout.segments, key=lambda s: s.addr)
    best = None
    for k, seg in enumerate(segments):
        if seg.size < need:
            continue
        live = [b for b in seg.blocks if b.live]
        deficit = need - (seg.size - sum(b.size for b in live))
        if deficit <= 0 or any(b.pinned for b in live):
            continue
        holes = {j: [list(h) for h in ((b.addr, b.size) for b in other.blocks if not b.live)]
                 for j, other in enumerate(segments)
                 if j != k and other.pool == seg.pool and other.stream == seg.stream}
        moved: list[Move] = []
        out = 0
        for block in sorted(live, key=lambda b: (-b.size, -b.addr)):    # the highest of a size: no slide over it
            if out >= deficit:
                break
            spot = min(((j, h) for j, hs in holes.items() for h in hs if h[1] >= block.size),
                       key=lambda jh: jh[1][1], default=None)
            if spot is None:
                continue
            _, hole = spot
            moved.append(Move(block.id, block.addr, hole[0], block.size))
            hole[0] += block.size
            hole[1] -= block.size
            out += block.size
        if out < deficit:
            continue
        cost = sum(m.size for m in moved)
        if best is None or cost < best[0]:
            best = (cost, k, moved)
    if best is None:
        return None
    _, k, moved = best
    seg = segments[k]
    gone = {m.src for m in moved}
    stay = [b for b in seg.blocks if b.live and b.addr not in gone]
    cursor, slides = seg.addr, []
    for block in sorted(stay, key=lambda b: b.addr):
        if block.addr != cursor:
            slides.append(Move(block.id, block.addr, cursor, block.size))
        cursor += block.size
    moves = moved + slides
    plan = CompactionPlan(moves=moves, layout=layout, before=before, after=before,
                          bytes_moved=sum(m.size for m in moves), stopped_by="target_largest_free")
    plan.layout = apply_plan(layout, plan)
    plan.after = measure(plan.layout)
    return plan


def _evacuate(segments: list[Segment], slides: list[list[Move]],
              post_slide: list[list[tuple[int, Block]]], evacuations: list[Move],
              released: list[tuple[int, int]], budget: int | None) -> int | None:
    """Empty whole segments into other segments' holes; edits ``slides`` (an evacuated segment
    does not slide) and appends to ``evacuations`` and ``released``. Returns the budget left."""
    holes: dict[int, list[list[int]]] = {}   # segment index -> [[addr, size], ...] after slides
    for i, seg in enumerate(segments):
        holes[i] = _holes_between(seg, sorted((addr, b.size) for addr, b in post_slide[i]))
    receivers: set[int] = set()
    evacuated: set[int] = set()
    candidates = [i for i, seg in enumerate(segments)
                  if post_slide[i] and not any(b.pinned for _, b in post_slide[i])]
    candidates.sort(key=lambda i: (segments[i].allocated, segments[i].addr))
    for i in candidates:
        if i in receivers:
            continue
        seg = segments[i]
        cost = seg.allocated
        refund = sum(m.size for m in slides[i])   # an evacuated segment does not slide
        if budget is not None and cost > budget + refund:
            continue
        targets = [j for j, other in enumerate(segments)
                   if j != i and j not in evacuated and other.pool == seg.pool
                   and other.stream == seg.stream]
        trial = {j: [h[:] for h in holes[j]] for j in targets}
        placed: list[tuple[Block, int, int]] = []   # block, dst segment, dst addr
        for _, block in sorted(post_slide[i], key=lambda ab: -ab[1].size):
            best = None
            for j in targets:
                for hole in trial[j]:
                    if hole[1] >= block.size and (best is None or hole[1] < best[1][1]):
                        best = (j, hole)
            if best is None:
                break
            j, hole = best
            placed.append((block, j, hole[0]))
            hole[0] += block.size
            hole[1] -= block.size
        if len(placed) < len(post_slide[i]):
            continue
        slides[i] = []
        evacuated.add(i)
        for j in targets:
            holes[j] = [h for h in trial[j] if h[1] > 0]
        for block, j, dst in sorted(placed, key=lambda p: p[0].addr):
            evacuations.append(Move(block.id, block.addr, dst, block.size))
            receivers.add(j)
        released.append((seg.addr, seg.size))
        if budget is not None:
            budget += refund - cost
    return budget


def _holes_between(seg: Segment, spans: Sequence[tuple[int, int]]) -> list[list[int]]:
    holes = []
    cursor = seg.addr
    for addr, size in spans:
        if addr > cursor:
            holes.append([cursor, addr - cursor])
        cursor = addr + size
    if seg.end > cursor:
        holes.append([cursor, seg.end - cursor])
    return holes


def apply_plan(layout: Layout, plan: CompactionPlan, *, release_empty: bool = True) -> Layout:
    """The layout after executing ``plan`` on ``layout``; ``layout`` is not modified.

    Contract (what an allocator model's ``restore(layout)`` can rely on):

    * segments keep their address, size, pool and stream, sorted by address; segments listed
      in ``plan.released`` are dropped when ``release_empty`` (else kept as one hole);
    * every live block keeps its ``size``, ``id``, ``tag`` and ``pinned``; its address is the
      move's ``dst`` when it moved (a move is matched by its source address), else unchanged;
      a block moved by evacuation belongs to the segment that contains its destination;
    * blocks tile each segment exactly and no two holes are adjacent (``Layout.check()``).

    Example:
        >>> from ms_memopt.core.layout import Block, Layout, Segment
        >>> seg = Segment(0, 30, [Block(0, 10, False), Block(10, 10, True, id=7), Block(20, 10, False)])
        >>> after = apply_plan(Layout([seg]), CompactionPlan([Move(7, 10, 0, 10)], None, None, None, 10))
        >>> [(b.addr, b.size, b.live) for b in after.segments[0].blocks]
        [(0, 10, True), (10, 20, False)]
    """
    dst_of = {m.src: m.dst for m in plan.moves}
    released = set(plan.released)
    segments = sorted(layout.segments, key=lambda s: s.addr)
    seg_starts = [s.addr for s in segments]
    placed: list[list[Block]] = [[] for _ in segments]
    for i, seg in enumerate(segments):
        for b in seg.blocks:
            if not b.live:
                continue
            addr = dst_of.get(b.addr, b.addr)
            j = i
            if not (seg.addr <= addr and addr + b.size <= seg.end):
                j = int(np.searchsorted(seg_starts, addr, side="right")) - 1
                if j < 0 or addr + b.size > segments[j].end:
                    raise ValueError(f"move of block {b.id} to {addr:#x} leaves every segment")
            placed[j].append(Block(addr, b.size, True, id=b.id, tag=b.tag, pinned=b.pinned))
    out = []
    for seg, live in zip(segments, placed):
        if release_empty and (seg.addr, seg.size) in released and not live:
            continue
        live.sort(key=lambda b: b.addr)
        blocks: list[Block] = []
        cursor = seg.addr
        for b in live:
            if b.addr < cursor:
                raise ValueError(f"blocks overlap at {b.addr:#x} after the plan")
            if b.addr > cursor:
                blocks.append(Block(cursor, b.addr - cursor, False))
            blocks.append(b)
            cursor = b.end
        if cursor < seg.end:
            blocks.append(Block(cursor, seg.end - cursor, False))
        out.append(Segment(seg.addr, seg.size, blocks, stream=seg.stream, pool=seg.pool))
    return Layout(out, capacity=layout.capacity)

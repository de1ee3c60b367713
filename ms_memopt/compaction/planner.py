"""Compaction planner: which live blocks move where so that holes merge.

The planner is framework-free and works on a :class:`~ms_memopt.layout.Layout`; the simulator's
``compact`` policy and the :class:`~ms_memopt.arena.Arena` executor share it.

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
stops as soon as the hole opened above the last moved block reaches the target (say the next
AllReduce bucket).

Example:
    >>> from ms_memopt.layout import Block, Layout, Segment
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

from ..layout import Block, Layout, Segment
from ..metrics import LayoutMetrics, measure

__all__ = ["Move", "Run", "CompactionPlan", "plan_compaction", "apply_plan", "slide_targets",
           "coalesce_runs"]


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
                  *, max_bytes: int | None = None,
                  target_largest_free: int | None = None) -> tuple[np.ndarray, str | None]:
    """Slide-down targets for the live blocks of one segment ``[start, end)``.

    ``addrs``, ``sizes``, ``pinned`` describe the live blocks sorted by address (bytes). Returns
    ``(targets, stopped_by)``: ``targets[i] <= addrs[i]``, equal for pinned blocks and for blocks
    past a bound. Executing ``addrs[i] -> targets[i]`` in index order is memmove-safe.

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
    cut = n
    if max_bytes is not None or target_largest_free is not None:
        moved = targets != addrs
        if max_bytes is not None:
            spent = np.cumsum(np.where(moved, sizes, 0))
            over = np.flatnonzero(spent > max_bytes)
            if len(over):
                cut, stopped_by = int(over[0]), "max_bytes"
        if target_largest_free is not None:
            next_addr = np.append(addrs[1:], end)
            hole_above = next_addr - (targets + sizes)
            reached = np.flatnonzero(moved & (hole_above >= target_largest_free))
            if len(reached) and int(reached[0]) + 1 <= cut:
                cut, stopped_by = int(reached[0]) + 1, "target_largest_free"
        if cut < n:
            targets[cut:] = addrs[cut:]
    return targets, stopped_by


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
    n = len(src)
    if n == 0:
        return []
    joins = (src[1:] == src[:-1] + size[:-1]) & ((src[1:] - dst[1:]) == (src[:-1] - dst[:-1]))
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    stops = np.append(starts[1:], n)
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
        target_largest_free: stop once a hole of this many bytes exists (``None``: compact fully).
        evacuate: after sliding, move every block of a whole segment (no pinned block) into holes
            of other segments of the same pool and stream when they fit, smallest segments first,
            so the segment becomes empty.
        release_empty: drop segments emptied by evacuation from the predicted layout (they are
            listed in ``plan.released``); keep them as one hole otherwise.

    Returns:
        A :class:`CompactionPlan`; ``plan.layout`` is ``apply_plan(layout, plan)``.

    Example:
        >>> from ms_memopt.layout import Block, Layout, Segment
        >>> a = Segment(0, 100, [Block(0, 40, True, id=1), Block(40, 60, False)])
        >>> b = Segment(1000, 100, [Block(1000, 50, False), Block(1050, 30, True, id=2),
        ...                         Block(1080, 20, False)])
        >>> plan = plan_compaction(Layout([a, b]), evacuate=True)
        >>> [(m.block_id, m.src, m.dst) for m in plan.moves], plan.released
        ([(2, 1050, 40)], [(1000, 100)])
    """
    before = measure(layout)
    segments = sorted(layout.segments, key=lambda s: s.addr)
    slides: list[list[Move]] = []
    post_slide: list[list[tuple[int, Block]]] = []   # (new addr, block) per segment
    budget = max_bytes
    stopped_by = None
    target_reached = target_largest_free is not None and before.largest_free >= target_largest_free
    for seg in segments:
        live = [b for b in seg.blocks if b.live]
        if target_reached or stopped_by == "max_bytes" or not live:
            slides.append([])
            post_slide.append([(b.addr, b) for b in live])
            continue
        addrs = np.fromiter((b.addr for b in live), dtype=np.int64, count=len(live))
        sizes = np.fromiter((b.size for b in live), dtype=np.int64, count=len(live))
        pinned = np.fromiter((b.pinned for b in live), dtype=bool, count=len(live))
        targets, why = slide_targets(addrs, sizes, pinned, seg.addr, seg.end, max_bytes=budget,
                                     target_largest_free=target_largest_free)
        moves = [Move(b.id, b.addr, int(t), b.size) for b, t in zip(live, targets.tolist())
                 if t != b.addr]
        slides.append(moves)
        post_slide.append(list(zip(targets.tolist(), live)))
        if budget is not None:
            budget -= sum(m.size for m in moves)
        if why is not None:
            stopped_by = why
        if why == "target_largest_free":
            target_reached = True

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
        >>> from ms_memopt.layout import Block, Layout, Segment
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

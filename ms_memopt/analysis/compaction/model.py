"""Compaction applied to an allocator model: plan on its layout, restart a model from the result.

Shared by the simulator's ``compact`` policy and ``ms-memopt replay --policy compact``.

A compaction slides every live block to the low end of its segment and then *evacuates* the
least-used segments into holes of others of the same pool and stream
(:func:`~ms_memopt.analysis.compaction.planner.plan_compaction` with ``evacuate``), so the
segments it empties go back to the device and the memory they held can be asked for again in
one piece. That is what the real pools do with an idle block: MindSpore's pool frees it
(``MemBufAllocator::ReleaseFreeBlocks``, which ``empty_cache()`` runs; the non-VMM models count
each in ``segment_frees``), under VMM its pages are unmapped (``AscendVmmAdapter::EagerFreeDeviceMem``)
and mapped again on demand, PyTorch's caching allocator ``cudaFree``\\ s it (``release_block``).
Holes spread over many small blocks cannot be joined by sliding alone; only releasing the emptied
blocks makes their memory one piece again. At a failed request (``need``), when every block is
nearly full and none holds the request, some blocks of one segment move into the holes of others
until it does (:func:`~ms_memopt.analysis.compaction.planner.plan_opening`).

:func:`try_compaction` runs a compaction only when its plan raises the largest piece a request
could get (:func:`largest_piece`: the largest hole, or the device memory not reserved, when the
card has it), or, given ``need``, only when afterwards a request of that size fits; otherwise it
leaves the model as it is and says why.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ms_memopt.allocators.base import AllocatorModel
from ms_memopt.analysis.compaction.planner import Move, plan_compaction, plan_opening
from ms_memopt.core.layout import Layout
from ms_memopt.core.metrics import measure
from ms_memopt.core.units import format_size

__all__ = ["ModelCompaction", "compact_model", "largest_piece", "try_compaction"]


@dataclass
class ModelCompaction:
    """One compaction of a model (sizes in bytes).

    ``model`` is the model to go on with: a new one restarted from ``after``, or the old one
    when ``skipped`` says why the compaction was not run. ``largest_before``/``largest_after``
    are :func:`largest_piece` of the layouts; ``released`` the segments emptied and given back."""

    model: AllocatorModel
    before: Layout
    after: Layout
    moves: list[Move] = field(default_factory=list)
    released: list[tuple[int, int]] = field(default_factory=list)
    largest_before: int = 0
    largest_after: int = 0
    skipped: str | None = None

    @property
    def bytes_moved(self) -> int:
        return sum(m.size for m in self.moves)


def largest_piece(layout: Layout, capacity: int | None) -> int:
    """The largest request that could be served from ``layout`` without failing, bytes: its
    largest hole, or the device memory not yet reserved (a new segment of that size), whichever
    is larger; unbounded (``capacity`` ``None``) counts the hole only.

    Example:
        >>> from ms_memopt.core.layout import Block, Segment
        >>> seg = Segment(0, 100, [Block(0, 60, True), Block(60, 40, False)])
        >>> largest_piece(Layout([seg]), capacity=200), largest_piece(Layout([seg]), capacity=None)
        (100, 40)
    """
    hole = measure(layout).largest_free
    if capacity is None:
        return hole
    return max(hole, capacity - layout.reserved)


def try_compaction(model: AllocatorModel, addr_of: dict[int, int], fresh: Callable[[], AllocatorModel], *,
                   need: int | None = None, force: bool = False) -> ModelCompaction:
    """Plan a compaction of ``model``'s layout (slides and evacuation) and run it when it helps:
    its plan raises :func:`largest_piece` (with ``need``: a request of ``need`` bytes fits
    afterwards, as at a failed request), or always with ``force``. Run, ``fresh()`` is restarted
    from the compacted layout and ``addr_of`` (tensor id -> address) is updated in place; peaks,
    OOMs and counters carry over, and the released segments count as segment frees.

    Example:
        >>> from ms_memopt.allocators import create
        >>> m = create("mindspore"); a = m.malloc(4096); b = m.malloc(4096); m.free(a)
        >>> done = try_compaction(m, {2: b}, lambda: create("mindspore"))
        >>> done.skipped, done.largest_after - done.largest_before      # the hole below joins the rest
        (None, 4096)
        >>> try_compaction(done.model, {2: a}, lambda: create("mindspore")).skipped
        'the plan would not raise the largest piece (1024.00 MiB -> 1024.00 MiB)'
    """
    before = model.layout()
    id_at = {addr: tid for tid, addr in addr_of.items()}
    for block in before.live_blocks():
        block.id = id_at.get(block.addr, block.id)
    plan = plan_compaction(before, evacuate=True)
    after, moves = plan.layout, list(plan.moves)
    if need is not None and largest_piece(after, model.capacity) < need:
        # every segment nearly full and none holding the request: open one across segments
        opening = plan_opening(after, need)
        if opening is not None:
            after, moves = opening.layout, moves + opening.moves
    outcome = ModelCompaction(model, before, after, moves, plan.released,
                              largest_piece(before, model.capacity), largest_piece(after, model.capacity))
    if not force:
        if need is not None and outcome.largest_after < need:
            outcome.skipped = (f"even compacted, no piece holds the request ({format_size(need)} asked, "
                               f"{format_size(outcome.largest_after)} at most)")
        elif need is None and outcome.largest_after <= outcome.largest_before:
            outcome.skipped = (f"the plan would not raise the largest piece ({format_size(outcome.largest_before)} "
                               f"-> {format_size(outcome.largest_after)})")
        if outcome.skipped is not None:
            return outcome
    new = fresh()
    new.restore(after)
    new.peak_allocated = max(new.peak_allocated, model.peak_allocated)
    new.peak_reserved = max(new.peak_reserved, model.peak_reserved)
    new.segment_allocs = max(new.segment_allocs, model.segment_allocs)
    new.segment_frees = model.segment_frees + len(plan.released)
    new.slow_path_events = model.slow_path_events
    new.ooms = model.ooms
    for move in moves:                  # in order: a block moved twice ends at its last destination
        if move.block_id is not None and move.block_id in addr_of:
            addr_of[move.block_id] = move.dst
    outcome.model = new
    return outcome


def compact_model(model: AllocatorModel, addr_of: dict[int, int],
                  fresh: Callable[[], AllocatorModel]) -> tuple[AllocatorModel, Layout, Layout, list[Move]]:
    """Compact ``model`` whatever it gains (:func:`try_compaction` with ``force``): every live
    block slid to the lowest addresses of its segment, then the least-used segments emptied into
    the holes of others and given back. Returns the new model, the layouts before and after, and
    the moves; ``addr_of`` (tensor id -> address) is updated in place.

    Example:
        >>> from ms_memopt.allocators import create
        >>> m = create("mindspore"); a = m.malloc(4096); b = m.malloc(4096); m.free(a)
        >>> new, before, after, moves = compact_model(m, {2: b}, lambda: create("mindspore"))
        >>> [(mv.src - b, mv.dst - a) for mv in moves]
        [(0, 0)]
    """
    done = try_compaction(model, addr_of, fresh, force=True)
    return done.model, done.before, done.after, done.moves

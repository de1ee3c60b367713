"""Compaction applied to an allocator model: plan on its layout, restart a model from the result.

Shared by the simulator's ``compact`` policy and ``ms-memopt replay --policy compact``.
"""
from __future__ import annotations

from typing import Callable

from ms_memopt.allocators.base import AllocatorModel
from ms_memopt.analysis.compaction.planner import Move, plan_compaction
from ms_memopt.core.layout import Layout

__all__ = ["compact_model"]


def compact_model(model: AllocatorModel, addr_of: dict[int, int],
                  fresh: Callable[[], AllocatorModel]) -> tuple[AllocatorModel, Layout, Layout, list[Move]]:
    """Compact ``model``'s layout with :func:`~ms_memopt.analysis.compaction.plan_compaction` (every
    live block slid to the lowest addresses of its segment; segments stay, so in a pool grown
    in blocks no hole can outgrow its block) and restart ``fresh()`` from the result.

    Returns the new model, the layouts before and after, and the moves; ``addr_of``
    (tensor id -> address) is updated in place. Peaks and OOMs carry over.

    Example:
        >>> from ms_memopt.allocators import create
        >>> m = create("mindspore"); a = m.malloc(4096); b = m.malloc(4096); m.free(a)
        >>> new, before, after, moves = compact_model(m, {2: b}, lambda: create("mindspore"))
        >>> [(mv.src - b, mv.dst - a) for mv in moves]
        [(0, 0)]
    """
    before = model.layout()
    id_at = {addr: tid for tid, addr in addr_of.items()}
    for block in before.live_blocks():
        block.id = id_at.get(block.addr, block.id)
    plan = plan_compaction(before)
    after = plan.layout
    new = fresh()
    new.restore(after)
    new.peak_allocated = max(new.peak_allocated, model.peak_allocated)
    new.peak_reserved = max(new.peak_reserved, model.peak_reserved)
    new.segment_allocs = max(new.segment_allocs, model.segment_allocs)
    new.ooms = model.ooms
    for move in plan.moves:
        if move.block_id is not None and move.block_id in addr_of:
            addr_of[move.block_id] = move.dst
    return new, before, after, plan.moves

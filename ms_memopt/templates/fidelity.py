"""How close simulated events are to a recording, allocation by allocation (:func:`fidelity`).
See :mod:`ms_memopt.templates.template`.
"""
from __future__ import annotations

from typing import Iterable

from ms_memopt.core.events import Event

__all__ = ["fidelity"]


# --- fidelity -----------------------------------------------------------------------------
def _block_offsets(events: Iterable[Event]) -> list[tuple]:
    """Per allocation in order: ``(size, block number, offset in block, step)`` (blocks
    numbered by creation, from the ``segment_alloc`` events; ``step`` counts the ``step``
    events before it); ``None`` block and offset when not inside a block."""
    blocks: list[tuple[int, int]] = []
    out = []
    step = 0
    for event in events:
        if event.action == "step":
            step += 1
        elif event.action == "segment_alloc":
            blocks.append((event.addr, event.size))
        elif event.action == "alloc":
            where = None
            if event.addr is not None:
                for number, (base, size) in enumerate(blocks):
                    if base <= event.addr < base + size:
                        where = (number, event.addr - base)
                        break
            out.append((event.size,) + (where or (None, None)) + (step,))
    return out


def fidelity(recorded: Iterable[Event], simulated: Iterable[Event], *, until_last_step: bool = True) -> dict:
    """Compare a recording with simulated events, allocation by allocation in order:
    ``size_match`` (same size at the same position) and ``offset_match`` (same block number
    and offset inside it), as fractions of the recording's allocations.

    ``layout_match``: step by step, the fraction of allocations whose place (block, offset,
    aligned size) the other side also fills in that step, as multisets: two equal buffers that
    swapped places (frees in another order) still match, a different layout does not.

    ``until_last_step``: only the recording's allocations before its last ``step`` event (the
    process's exit is not a step).
    """
    recorded = list(recorded)
    if until_last_step:
        last = max((i for i, e in enumerate(recorded) if e.action == "step"), default=len(recorded) - 1)
        recorded = recorded[:last + 1]
    rec = _block_offsets(recorded)
    sim = _block_offsets(simulated)
    n = len(rec)
    same_size = sum(1 for a, b in zip(rec, sim) if a[0] == b[0])
    same_place = sum(1 for a, b in zip(rec, sim) if a[1] is not None and a[1:3] == b[1:3])
    # the same places as sets, step by step: which of two equal buffers sits where aside
    from collections import Counter

    def per_step(rows: list[tuple]) -> dict[int, Counter]:
        out: dict[int, Counter] = {}
        for size, block, offset, step in rows:
            if block is not None:
                out.setdefault(step, Counter())[(block, offset, max(512, (size + 511) // 512 * 512))] += 1
        return out
    rec_steps, sim_steps = per_step(rec), per_step(sim)
    # the recording's prologue is ended by a setup mark the simulation does not write
    shift = 1 if recorded and any(e.action == "step" and e.tag is None for e in recorded) else 0
    # (the prologue and the first step are one "step" of the simulation: compared together)
    merged: dict[int, Counter] = {}
    for step, counter in rec_steps.items():
        merged.setdefault(max(0, step - shift), Counter()).update(counter)
    same_layout = sum(sum((counter & sim_steps.get(step, Counter())).values()) for step, counter in merged.items())
    return {"allocs_recorded": n, "allocs_simulated": len(sim),
            "size_match": same_size / n if n else None, "offset_match": same_place / n if n else None,
            "layout_match": same_layout / n if n else None}

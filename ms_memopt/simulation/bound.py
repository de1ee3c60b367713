"""An honest bound: what the best placement of a run's own steps would need.

Every policy places the same requests; none can hold them in less than the best *static*
placement of their lifetimes, which the planner (:func:`~ms_memopt.analysis.planner.pack`)
finds when it knows every lifetime in advance. So for a card, either no policy can save the run
(the card is below that need: more memory, a smaller step or recompute is the only way) or the
policy whose death comes last, or none, is how close a dynamic allocator got.

The planner runs on the window of the run where the most bytes are alive: the step with the
highest live peak and the one before it, with every tensor alive when the window opens held
from its start (a step's placement depends on what the previous step left). Sizes are rounded
up to the 512 B every modelled allocator hands out. A bound over a window is a lower bound on
the run's need; the planner's arena for it is a placement that exists (verified), within
``gap`` of the window's optimum.

Example:
    >>> from ms_memopt.workload.step import WorkloadSpec
    >>> b = placement_need(WorkloadSpec(enabled=False), steps=2, time_limit=2)   # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ms_memopt.analysis.planner import pack
from ms_memopt.core.placement import Buffer
from ms_memopt.core.events import ROW_INDEX
from ms_memopt.core.units import aligned

__all__ = ["PlacementNeed", "placement_need", "window_buffers", "bound_sentence"]

_ACTION, _ID, _SIZE = (ROW_INDEX[k] for k in ("action", "id", "size"))
#: seconds the planner may take (the greedy orders alone take milliseconds)
TIME_LIMIT = 2.0


@dataclass
class PlacementNeed:
    """The best static placement of a run's busiest window (bytes): ``need`` a verified
    placement's arena, ``live_peak`` the most bytes alive at once there (no placement needs less),
    ``optimal`` whether ``need`` is proven minimal, ``steps`` the window's steps (1-based)."""

    need: int
    live_peak: int
    optimal: bool
    steps: tuple[int, int]
    buffers: int

    def to_dict(self) -> dict:
        return asdict(self)


def window_buffers(prologue: list[tuple], steps: list[list[tuple]], first: int, last: int) -> list[Buffer]:
    """The buffers of steps ``first..last`` (1-based, rows as the workload yields them), with
    every tensor alive when step ``first`` starts held from the window's start."""
    alive: dict[int, int] = {}
    for rows in [prologue] + steps[:first - 1]:
        for row in rows:
            if row[_ACTION] == "alloc":
                alive[row[_ID]] = aligned(row[_SIZE])
            elif row[_ACTION] == "free":
                alive.pop(row[_ID], None)
    opened = {tid: (0, size) for tid, size in alive.items()}
    buffers: list[Buffer] = []
    index = 1
    for rows in steps[first - 1:last]:
        for row in rows:
            if row[_ACTION] == "alloc":
                opened[row[_ID]] = (index, aligned(row[_SIZE]))
            elif row[_ACTION] == "free" and row[_ID] in opened:
                start, size = opened.pop(row[_ID])
                buffers.append(Buffer(str(row[_ID]), start, index + 1, size))
            index += 1
    buffers += [Buffer(str(tid), start, index + 1, size) for tid, (start, size) in opened.items()]
    return buffers


def _live_peak_step(prologue: list[tuple], steps: list[list[tuple]]) -> int:
    """The step (1-based) where the most bytes are alive at once."""
    held = 0
    size_of: dict[int, int] = {}
    for row in prologue:
        if row[_ACTION] == "alloc":
            size_of[row[_ID]] = row[_SIZE]
            held += row[_SIZE]
    best, best_step = -1, 1
    for number, rows in enumerate(steps, 1):
        for row in rows:
            if row[_ACTION] == "alloc":
                size_of[row[_ID]] = row[_SIZE]
                held += row[_SIZE]
                if held > best:
                    best, best_step = held, number
            elif row[_ACTION] == "free":
                held -= size_of.pop(row[_ID], 0)
    return best_step


def placement_need(spec, steps: int, *, seed: int = 0, time_limit: float = TIME_LIMIT) -> PlacementNeed:
    """The best static placement of the busiest two steps of ``spec``'s run (its first ``steps``
    steps at ``seed``, as every policy runs them): see the module docstring."""
    from ms_memopt.templates.workload import make_workload

    work = make_workload(spec, seed)
    prologue = work.prologue_rows()
    rows = [work.step_rows(step) for step in range(1, steps + 1)]
    peak_step = _live_peak_step(prologue, rows)
    first = max(1, peak_step - 1)
    buffers = window_buffers(prologue, rows, first, peak_step)
    solution = pack(buffers, time_limit=time_limit, gap=0.01)
    return PlacementNeed(need=solution.arena, live_peak=solution.lower_bound, optimal=solution.optimal,
                         steps=(first, peak_step), buffers=len(buffers))


def bound_sentence(need: PlacementNeed, capacity: int | None, deaths: dict[str, int | None]) -> str:
    """What the bound says about a card of ``capacity`` bytes, given each policy's death step
    (``None``: it survived): "no policy can save this below X", or which policy comes closest.

    Example:
        >>> n = PlacementNeed(need=3 << 20, live_peak=3 << 20, optimal=True, steps=(4, 5), buffers=900)
        >>> bound_sentence(n, 2 << 20, {"baseline": 3, "compact": 3}).split("; ")[-1]
        'the card has 2.00 MiB: no policy can save this below 3.00 MiB'
        >>> bound_sentence(n, 4 << 20, {"baseline": 3, "compact": None}).split(": ")[-1]
        'compact comes closest (it survives)'
    """
    from ms_memopt.core.units import format_size

    head = (f"the best placement of these steps (the planner on the lifetimes of steps {need.steps[0]}-{need.steps[1]}, "
            f"the busiest) needs {format_size(need.need)}"
            + ("" if need.need == need.live_peak else f", the live bytes alone {format_size(need.live_peak)}"))
    if capacity is None:
        return head
    if capacity < need.live_peak or (need.optimal and capacity < need.need):
        return f"{head}; the card has {format_size(capacity)}: no policy can save this below {format_size(need.need)}"
    if capacity < need.need:
        return (f"{head}; the card has {format_size(capacity)}: no policy is known to save this below "
                f"{format_size(need.need)} (the planner did not prove it minimal)")
    order = sorted(deaths, key=lambda p: (deaths[p] is None, deaths[p] or 0), reverse=True)
    best = order[0] if order else None
    if best is None:
        return head
    how = "it survives" if deaths[best] is None else f"it dies at step {deaths[best]}"
    return f"{head}, within the card's {format_size(capacity)}: {best} comes closest ({how})"

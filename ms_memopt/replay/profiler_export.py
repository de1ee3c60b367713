"""A replay written as the Ascend profiler's output of one rank (``ms-memopt replay TRACE --export-profiler DIR``).

The model places each allocation; what the profiler would have recorded of that run is written
in torch_npu's format (:mod:`~ms_memopt.io.traces.ascend_profiler.writer`): a row per tensor with
its block's bytes (the model's: what its allocated total grew by) and the model's allocated and
reserved totals after the allocation and after the release, the totals over time, a
``ProfilerStep#N`` marker per step of the recording (a profiler capture's own markers; one over the
whole run when it has none) and
a ``cpu_op`` span around each run of allocations of one name, as text
(``operator_memory.csv``, ``memory_record.csv``, ``trace_view.json``) and as the db
(``ascend_pytorch_profiler_N.db``). msprof-analyze's ``compare`` reads the folder (it takes the
db when there is one) and charges each tensor to its operator; MindStudio Insight's memory view
shows the totals and the rows (docs/traces.md, docs/verified.md).

Events without a time are placed 1 us after the one before (the profiler's unit); a recording
that starts from a recorded state has its live blocks as tensors allocated before the capture,
whose releases show in the totals.

Example:
    >>> import tempfile
    >>> from ms_memopt.allocators import create
    >>> from ms_memopt.core.events import Event, Trace
    >>> trace = Trace([Event("alloc", id=1, size=1000), Event("free", id=1)])
    >>> result, folder = export_profiler(trace, create("torch-npu"), tempfile.mkdtemp())
    >>> row = (folder / "ASCEND_PROFILER_OUTPUT" / "operator_memory.csv").read_text().splitlines()[1]
    >>> folder.name, row.split(",")[:2]          # 1000 B asked: torch_npu's block of 1.5 KiB
    ('rank0_ascend_pt', ['aten::empty', '1.5'])
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ms_memopt.core.events import Event, Trace
from ms_memopt.io.traces.ascend_profiler import FORMAT, read_step_marks
from ms_memopt.io.traces.ascend_profiler.writer import write_profiler_output

__all__ = ["TICK_NS", "event_times", "export_profiler", "step_marks"]

#: the time given to an event that has none, after the one before (ns): the profiler's unit, 1 us
TICK_NS = 1000


def event_times(events: list[Event], start: int = 0) -> list[int]:
    """Each event's time in ns: its own, else :data:`TICK_NS` after the one before (``start`` first).

    Example:
        >>> event_times([Event("alloc", id=1, size=8), Event("free", id=1, time=5000), Event("step")])
        [0, 5000, 6000]
    """
    out, now = [], start - TICK_NS
    for event in events:
        now = event.time if event.time is not None else now + TICK_NS
        out.append(now)
    return out


def step_marks(events: list[Event], times: list[int]) -> list[tuple[int, int, int]]:
    """``(number, start ns, end ns)`` of each step: from a ``step`` event to the next (the last to
    the last event); none: one step, number 0, over the whole run.

    Example:
        >>> events = [Event("step", step=3), Event("alloc", id=1, size=8), Event("step", step=4), Event("free", id=1)]
        >>> step_marks(events, [0, 1000, 2000, 3000])
        [(3, 0, 2000), (4, 2000, 3000)]
    """
    starts = [(event.step if event.step is not None else n, time)
              for n, (event, time) in enumerate(zip(events, times)) if event.action == "step"]
    end = max(times, default=0)
    if not starts:
        return [(0, min(times, default=0), end)]
    return [(number, start, starts[k + 1][1] if k + 1 < len(starts) else end)
            for k, (number, start) in enumerate(starts)]


def export_profiler(trace: Trace, model, directory: str | Path, *, rank: int = 0, alloc_conf: str = ""):
    """Replay ``trace`` (its events a list) through ``model`` and write the run as the rank folder
    ``directory/rank{rank}_ascend_pt``. Returns the :class:`~ms_memopt.replay.replay.ReplayResult`
    and the folder. ``alloc_conf``: ``PYTORCH_NPU_ALLOC_CONF`` as the folder's metadata records it.
    """
    from ms_memopt.replay.replay import replay

    events = list(trace.events)
    times = event_times(events)
    initial = ({b.id: b.size for b in trace.initial.live_blocks() if b.id is not None}
               if trace.initial is not None else {})
    placed: list[Event] = []
    totals: list[tuple[int, int]] = []
    block: dict[int, int] = {}
    last = [sum(initial.values())]

    def on_alloc(index: int, event: Event, addr: int | None) -> None:
        if addr is None:          # out of memory: the profiler records no tensor
            return
        block[event.id] = model.allocated - last[0]
        last[0] = model.allocated
        placed.append(Event("alloc", id=event.id, size=block[event.id], time=times[index], tag=event.tag))
        totals.append((model.allocated, model.reserved))

    def on_free(index: int, event: Event, addr: int) -> None:
        last[0] = model.allocated
        placed.append(Event("free", id=event.id, time=times[index]))
        totals.append((model.allocated, model.reserved))

    result = replay(replace(trace, events=events), model, on_alloc=on_alloc, on_free=on_free)
    steps = step_marks(events, times)
    if trace.format == FORMAT and trace.source:     # a capture's markers are beside its memory files
        steps = [(m.number, m.start, m.end) for m in read_step_marks(trace.source).steps] or steps
    folder = write_profiler_output(directory, placed, rank=rank, initial=initial, totals=totals,
                                   steps=steps, alloc_conf=alloc_conf, operators=True, db=True)
    return result, folder

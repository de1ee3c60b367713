"""An Ascend profiler capture as a recording a step template is learned from.

A capture (``torch_npu.profiler`` or MindSpore's ``Profiler(profile_memory=True)``: a rank's
folder, ``ASCEND_PROFILER_OUTPUT/`` or the ``.db``; docs/traces.md) holds no ``mark_step``
marks; :func:`capture_recording` makes them from what the profiler wrote:

* **the prologue** is the tensors held before the capture (the profiler's initial state:
  ``read_ascend_profiler(..., initial_as_events=True)``) and the events before the first step
  starts; a setup mark ends it, so a template's persistent state (parameters, optimizer states:
  :func:`ms_memopt.analysis.purposes.learn_purposes`) is what the run held before the capture;
  those held all through it are tagged :data:`PERSISTENT_TAG`;
* **the steps** are the profiler's own markers (``ProfilerStep#N``: the db's ``STEP_TIME``, else
  ``trace_view.json``; :func:`ms_memopt.io.traces.ascend_profiler.read_step_marks`): an event
  belongs to the step whose start is the last at or before its time; events after the last
  step's end are the process's, not a step's. A capture without markers is one step;
* **the dims** of each step: none (every step the same shape) or one row per step from a CSV
  (``learn --dims-csv FILE``, read as a schedule: a header of dim names);
* a capture of **one step** gives the template its ``repeat`` steps too: step 1 again, where
  the step's first free of a tensor held before the capture frees instead every tensor the
  step before kept past its end (in a steady run what a step keeps is what the next one frees:
  the captured step freed the pre-capture ones). Two such steps follow it; a note says so.

Sizes are the events' (torch_npu's block less its 32 B pad: docs/traces.md); the template's
allocator is the capture's recorded one (``meta["allocator_candidates"]``).

Example:
    >>> import tempfile
    >>> from ms_memopt.core.events import Event
    >>> from ms_memopt.io.traces.ascend_profiler.writer import write_profiler_output
    >>> ev = [Event("alloc", id=1, size=4096, time=10_000), Event("free", id=1, time=20_000)]
    >>> folder = write_profiler_output(tempfile.mkdtemp(), ev, steps=[(1, 5_000, 30_000)])
    >>> rec = capture_recording(folder)
    >>> rec.marks, rec.steps, [e.action for e in rec.events][:4]
    ('trace_view.json', 1, ['step', 'alloc', 'free', 'step'])
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event

__all__ = ["CaptureRecording", "capture_recording", "is_capture"]

#: the request tag of a tensor held all through the capture (pool mode's ``parameters`` region):
#: the profiler records what was held before the capture as one total, weights and optimizer
#: states together, so :func:`~ms_memopt.analysis.purposes.learn_purposes` cannot always split it
PERSISTENT_TAG = "parameter"
#: repeat steps made after a capture of one step
SYNTHETIC_REPEATS = 2


@dataclass
class CaptureRecording:
    """A capture as a recording (``events``: prologue, setup mark, steps each ended by a
    ``dims:`` mark). ``steps``: the captured steps; ``marks``: where they were read
    (``"STEP_TIME"``, ``"trace_view.json"``, ``None``: none, one step); ``allocator``: the
    recorded allocator's model; ``held_before``: bytes and count of the tensors held before
    the capture; ``recorded``: the capture's own figures (``peak_allocated``... in bytes)."""

    name: str
    events: list[Event]
    steps: int
    marks: str | None
    allocator: str
    held_before: dict
    recorded: dict
    notes: list[str] = field(default_factory=list)


def is_capture(path: str | Path) -> bool:
    """True when ``path`` is read as the Ascend profiler's memory output (a folder or the ``.db``)."""
    from ms_memopt.io.traces import detect_format

    try:
        return detect_format(path) == "ascend-profiler"
    except InputError:
        return False


def capture_recording(path: str | Path, dims: Sequence[dict[str, int]] | None = None, *,
                      dims_source: str = "--dims-csv") -> CaptureRecording:
    """The capture at ``path`` as a recording (see the module docstring).

    Args:
        path: a rank's folder, ``ASCEND_PROFILER_OUTPUT/`` or the ``.db``.
        dims: one dims dict per captured step, in order (``None``: no dims, every step alike).
        dims_source: where ``dims`` came from, for messages.

    Raises:
        InputError: an unreadable capture (the reader names file and line), or ``dims`` with
            another number of rows than the capture has steps.
    """
    from ms_memopt.io.traces.ascend_profiler import read_ascend_profiler, read_step_marks
    from ms_memopt.templates.format import dims_tag

    name = str(path)
    trace = read_ascend_profiler(path, initial_as_events=True)
    recorded = trace.meta.get("recorded", {})
    held = recorded.get("initial_tensors", 0)
    initial, events = list(trace.events[:held]), list(trace.events[held:])
    marks = read_step_marks(path)
    notes = list(marks.notes)
    bounds = [(m.start, m.end) for m in marks.steps]
    if not bounds:
        notes.append("no step marker (ProfilerStep#N: the run called no prof.step()): the capture is one step")
        times = [e.time for e in events if e.time is not None]
        bounds = [(min(times, default=0), max(times, default=0))]
    if dims is not None and len(dims) != len(bounds):
        numbers = ", ".join(f"#{m.number}" for m in marks.steps[:6]) or "one, unmarked"
        raise InputError(f"{len(dims)} row(s) of dims; the capture {name} has {len(bounds)} step(s) "
                         f"({numbers}{' ...' if len(marks.steps) > 6 else ''}): give one row per step",
                         source=dims_source)
    released = {e.id for e in events if e.action == "free"}
    # held all through: the persistent state (the profiler sees one lump of the weights and states)
    initial = [replace(e, tag=PERSISTENT_TAG) if e.id not in released else e for e in initial]
    before, *steps, after = _cut(events, bounds, name, notes)
    rows = list(dims) if dims is not None else [{} for _ in bounds]
    if len(steps) == 1:
        steps = _with_repeats(steps[0], {e.id for e in initial}, max((e.id for e in trace.events
                                                                       if e.id is not None), default=0) + 1)
        rows = rows * len(steps)
        notes.append(f"one step captured: {SYNTHETIC_REPEATS} repeat steps made of it, each freeing what the step "
                     "before kept past its end where the captured step freed its first tensor held before the capture")
    out = initial + before + [Event("step")]
    for number, (chunk, row) in enumerate(zip(steps, rows), 1):
        out += chunk + [Event("step", step=number, tag=dims_tag(row))]
    out += after
    candidates = trace.meta.get("allocator_candidates") or ["torch-npu"]
    sizes = {e.id: e.size for e in initial}
    freed = {e.id for e in events if e.action == "free" and e.id in sizes}
    held_before = {"tensors": len(initial), "bytes": sum(sizes.values()),
                   "held_through": sum(s for i, s in sizes.items() if i not in freed)}
    return CaptureRecording(name, out, len(bounds), marks.source, candidates[0], held_before,
                            {k: recorded.get(k) for k in ("peak_allocated", "peak_reserved", "allocated_first",
                                                          "allocated_max_diff")}, notes)


def _cut(events: list[Event], bounds: list[tuple[int, int]], name: str, notes: list[str]) -> list[list[Event]]:
    """``[before the first step, step 1, ..., step n, after the last]``: an event belongs to the
    step whose start is the last at or before its time."""
    starts = [start for start, _ in bounds]
    parts: list[list[Event]] = [[] for _ in range(len(bounds) + 2)]
    last_end = bounds[-1][1]
    for event in events:
        if event.time is None:
            raise InputError(f"a {event.action} event without a time; a capture's events are timed", source=name)
        at = len(bounds) + 1 if event.time > last_end else bisect_right(starts, event.time)
        parts[at].append(event)
    if parts[0]:
        notes.append(f"{len(parts[0])} event(s) before the first step: part of the prologue")
    if parts[-1]:
        notes.append(f"{len(parts[-1])} event(s) after the last step: not part of a step")
    return parts


def _with_repeats(step: list[Event], initial: set[int], next_id: int) -> list[list[Event]]:
    """One captured step -> the step and :data:`SYNTHETIC_REPEATS` repeats of it (module docstring).

    Example:
        >>> s = [Event("alloc", id=1, size=8, time=1), Event("free", id=9, time=2), Event("alloc", id=2, size=4, time=3)]
        >>> [[(e.action, e.id) for e in chunk] for chunk in _with_repeats(s, {9}, 10)][1]
        [('alloc', 10), ('free', 1), ('free', 2), ('alloc', 11)]
    """
    out = [step]
    span = (step[-1].time - step[0].time + 1) if step else 1
    for k in range(1, SYNTHETIC_REPEATS + 1):
        previous = out[-1]
        made = [e.id for e in previous if e.action == "alloc"]
        freed = {e.id for e in previous if e.action == "free"}
        kept = [i for i in made if i not in freed]
        ids: dict[int, int] = {}
        chunk: list[Event] = []
        replaced = False
        for event in step:
            time = event.time + k * span
            if event.action == "alloc":
                ids[event.id] = next_id
                chunk.append(Event("alloc", id=next_id, size=event.size, time=time, stream=event.stream,
                                   pool=event.pool, tag=event.tag))
                next_id += 1
            elif event.action == "free" and event.id in initial:
                if not replaced:
                    chunk += [Event("free", id=i, time=time) for i in kept]
                    replaced = True
            elif event.action == "free" and event.id in ids:
                chunk.append(Event("free", id=ids[event.id], time=time))
            elif event.action != "free":
                chunk.append(event)
        out.append(chunk)
    return out

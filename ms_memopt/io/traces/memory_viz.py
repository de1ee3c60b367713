"""Export events and a layout in PyTorch's memory snapshot format, for pytorch.org/memory_viz.

The file is what ``torch.cuda.memory._dump_snapshot()`` writes: a pickle (protocol 4) of
``{"segments": [...], "device_traces": [[...]], "allocator_settings": {...}}`` holding only
builtin types, so :func:`~ms_memopt.io.traces.torch_snapshot.read_torch_snapshot` (and PyTorch's
viewer) can load it. ``segments`` is the layout (live blocks ``active_allocated``, free ones
``inactive``); ``device_traces[0]`` the events: each ``alloc``, each free as
``free_requested`` + ``free_completed``, ``segment_alloc`` / ``segment_free``.

We have no stack traces, so each block's one frame names what it is: its tag (``parameter``,
``activation``, ``allreduce``, ``shape_cache``, ...) as the frame's function in file
``ms-memopt``, which the viewer shows where it would show the allocating stack (an untagged
block says ``untagged``, never "allocated before _record_history was enabled"). A compaction's
moves are the block's free at its old address and alloc at the new one, both named
``<tag> (moved by compaction)``. When the events hold no segment events (a simulation or a
model replay), each segment of the final layout gets a ``segment_alloc`` just before the first
alloc inside it, so a pool grown in blocks is shown growing.

Each ``alloc`` also carries a ``category``, the block's purpose (its tag; ``untagged`` without
one), the key PyTorch's viewer colours by and names in its legend (``torch.cuda._memory_viz``
writes it for profiler categories). ``blockers``: ids of allocations to show in a category of
their own, ``blocker: <tag>`` (``ms-memopt doctor`` marks the blocks in the way).

Which allocator made the recording: ``allocator_settings`` (PyTorch's dict of its allocator's
configuration, which neither its viewer ``MemoryViz.js`` nor ``torch.cuda._memory_viz`` reads)
holds ``written_by: ms-memopt`` and, under the key ``ms_memopt`` (:data:`RECORDED_BY`), the
allocator model that placed the blocks (``mindspore``, ``torch``, ...), its options, and what made the
events (``ms-memopt simulate``: the recipe, policy, rank, stage, seed and capacity). The reader
(:func:`~ms_memopt.io.traces.torch_snapshot.read_torch_snapshot`) puts it in ``Trace.meta``,
and ``replay`` and ``doctor`` replay through that model by default. So that model replays the
events as they were made, each ``alloc`` and free entry also carries what PyTorch's format has no
field for and its tools ignore: ``ms_memopt_pool`` (MindSpore's ``persistent`` pool, where
parameters and optimizer states go) and ``ms_memopt_step`` (the training step; the reader puts a
``step`` event at each step's end, where compaction and ``empty_cache`` act).

To view a model's placements rather than the recorded ones, give it the events of
:func:`ms_memopt.replay.replay.placed_events` (a trace replayed through a model, with the model's
addresses).

Example:
    >>> from ms_memopt.core.events import Event
    >>> from ms_memopt.core.layout import Block, Layout, Segment
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "viz.pickle")
    >>> seg = Segment(0x200000, 2 << 20, [Block(0x200000, 512, True), Block(0x200200, (2 << 20) - 512, False)])
    >>> write_memory_viz(path, [Event("alloc", id=1, size=500, addr=0x200000)], Layout([seg]))
    >>> from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot
    >>> [e.action for e in read_torch_snapshot(path).events]   # the segment's mapping is in the trace too
    ['segment_alloc', 'alloc']
"""
from __future__ import annotations

import bisect
import pickle
from pathlib import Path
from typing import Iterable

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import SEGMENT_ACTIONS, Event, Trace
from ms_memopt.core.layout import Layout, Segment

__all__ = ["write_memory_viz", "snapshot_dict", "RECORDED_BY", "POOL_KEY", "STEP_KEY", "check_export_path"]

#: the key of ``allocator_settings`` that says which allocator model made the events (a dict)
RECORDED_BY = "ms_memopt"
#: keys of an alloc or free entry: the event's pool (``persistent``) and training step
POOL_KEY, STEP_KEY = "ms_memopt_pool", "ms_memopt_step"

_SMALL_SEGMENT = 2 << 20


def _segment_type(pool: str, size: int) -> str:
    if pool in ("small", "large"):
        return pool
    return "small" if size <= _SMALL_SEGMENT else "large"


_FILE = "ms-memopt"
_UNTAGGED = "untagged"
_MOVED = "compaction"   # the tag the simulator gives a compaction's free + alloc of one block


def _frames(name: str) -> list[dict]:
    """One frame naming the block, where the viewer shows the allocating stack."""
    return [{"filename": _FILE, "line": 0, "name": name}]


def _name(event: Event, tag_of: dict[int, str]) -> str:
    if event.tag == _MOVED:
        return f"{tag_of.get(event.id, _UNTAGGED)} (moved by compaction)"
    return event.tag or tag_of.get(event.id, _UNTAGGED)


def _segment_starts(events: list[Event], layout: Layout, initial: Layout | None) -> dict:
    """Address of the first alloc inside each segment of ``layout`` that ``initial`` does not
    hold already -> that segment, when the events record no segment events of their own (else
    an empty dict: the recorded ones win)."""
    if any(e.action in SEGMENT_ACTIONS for e in events):
        return {}
    existing = {seg.addr for seg in initial.segments} if initial is not None else set()
    segments = sorted((seg for seg in layout.segments if seg.addr not in existing), key=lambda s: s.addr)
    bases = [seg.addr for seg in segments]
    starts: dict[int, Segment] = {}
    seen: set[int] = set()
    for event in events:
        if event.action != "alloc" or event.addr is None:
            continue
        at = bisect.bisect_right(bases, event.addr) - 1
        if at < 0 or at in seen or event.addr >= segments[at].addr + segments[at].size:
            continue
        seen.add(at)
        starts[event.addr] = segments[at]
    return starts


def snapshot_dict(events: Iterable[Event], layout: Layout, *, device: int = 0,
                  initial: Layout | None = None, blockers: Iterable[int] = (),
                  recorded_by: dict | None = None) -> dict:
    """The snapshot as a dict of builtin types (what :func:`write_memory_viz` pickles).

    ``initial`` is the layout before the first event (a snapshot taken mid-run): its segments
    existed already and get no inferred ``segment_alloc``. ``recorded_by``: which allocator made
    the events (``{"allocator": "mindspore", "allocator_options": {...}, ...}``, builtin types),
    stored as ``allocator_settings[RECORDED_BY]``.

    Frees without ``addr`` get the address of their ``alloc`` (by ``id``); an ``alloc``
    without an address cannot be drawn and raises :class:`InputError`.
    """
    events = list(events)
    blockers = set(blockers)
    trace: list[dict] = []
    addr_of: dict[int, int] = {}
    tag_of: dict[int, str] = {}
    live_name: dict[int, str] = {}   # addr -> name of the block the events left live there
    grow = _segment_starts(events, layout, initial)
    for index, event in enumerate(events):
        action = event.action
        base = {"addr": event.addr, "size": int(event.size), "stream": int(event.stream)}
        if event.time is not None:
            base["time_us"] = int(round(event.time * 1e6))
        if action in ("alloc", "free"):
            if event.pool is not None:
                base[POOL_KEY] = str(event.pool)
            if event.step is not None:
                base[STEP_KEY] = int(event.step)
        if action == "alloc":
            if event.addr is None:
                raise InputError(f"event {index}: alloc of id {event.id} has no address; "
                                 "use ms_memopt.replay.replay.placed_events() to take a model's placements", key="--export-memory-viz")
            if grow and event.addr in grow:
                seg = grow.pop(event.addr)
                trace.append({"action": "segment_alloc", "addr": seg.addr, "size": seg.size,
                              "stream": int(seg.stream), "frames": _frames(seg.pool + " pool segment")})
            name = _name(event, tag_of)
            if event.id is not None:
                addr_of[event.id] = event.addr
                if event.tag != _MOVED:
                    tag_of[event.id] = name
            live_name[event.addr] = name
            category = f"blocker: {name}" if event.id in blockers else name
            trace.append({"action": "alloc", **base, "frames": _frames(name), "category": category})
        elif action == "free":
            addr = event.addr if event.addr is not None else addr_of.get(event.id)
            if addr is None:
                continue  # freed before the trace began and never placed: nothing to draw
            base["addr"] = addr
            live_name.pop(addr, None)
            frames = _frames(_name(event, tag_of))
            trace.append({"action": "free_requested", **base, "frames": frames})
            trace.append({"action": "free_completed", **base, "frames": frames})
        elif action in SEGMENT_ACTIONS and event.addr is not None:   # expandable segments' maps too
            trace.append({"action": action, **base, "frames": _frames((event.pool or "device") + " pool segment")})

    segments = []
    for seg in sorted(layout.segments, key=lambda s: s.addr):
        blocks = [{"address": b.addr, "size": b.size, "requested_size": b.size if b.live else 0,
                   "state": "active_allocated" if b.live else "inactive",
                   "frames": _frames(b.tag or live_name.get(b.addr, _UNTAGGED)) if b.live else []}
                  for b in seg.blocks]
        allocated = sum(b.size for b in seg.blocks if b.live)
        segments.append({
            "device": device, "address": seg.addr, "total_size": seg.size,
            "allocated_size": allocated, "active_size": allocated, "requested_size": allocated,
            "stream": seg.stream, "segment_type": _segment_type(seg.pool, seg.size),
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks,
        })
    settings: dict = {"PYTORCH_CUDA_ALLOC_CONF": "", "written_by": "ms-memopt"}
    if recorded_by:
        settings[RECORDED_BY] = dict(recorded_by)
    return {"segments": segments, "device_traces": [trace] if device == 0 else [[]] * device + [trace],
            "allocator_settings": settings}


def write_memory_viz(path: str | Path, trace_or_events: Trace | Iterable[Event], layout: Layout | None = None,
                     *, device: int = 0, blockers: Iterable[int] = (), recorded_by: dict | None = None) -> None:
    """Write ``trace_or_events`` and ``layout`` as a PyTorch memory snapshot pickle.

    Args:
        path: the ``.pickle`` file to write (parent directories are created).
        trace_or_events: a :class:`Trace` (its events; ``final`` when ``layout`` is ``None``)
            or a list of events with addresses.
        layout: the segments and blocks at the end of the events.
        device: the device index the snapshot describes.
        blockers: allocation ids shown in a category of their own (``blocker: <tag>``).
        recorded_by: the allocator model that placed the events and its options
            (``{"allocator": "mindspore", "allocator_options": {"increase_size": 1073741824}}``),
            plus what made them; read back as ``Trace.meta["allocator"]`` (module doc).
    """
    initial = None
    if isinstance(trace_or_events, Trace):
        events = trace_or_events.events
        initial = trace_or_events.initial
        if layout is None:
            layout = trace_or_events.final
    else:
        events = trace_or_events
    data = snapshot_dict(events, layout or Layout(), device=device, initial=initial, blockers=blockers,
                         recorded_by=recorded_by)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        pickle.dump(data, handle, protocol=4)


def check_export_path(path: str | Path) -> None:
    """A recording path that does not exist, where ``simulate --export-memory-viz FILE.pickle``
    with several policies wrote one file per policy (``FILE.<policy>.pickle``) instead: an
    :class:`InputError` naming those files, so the next command can be given one of them.

    Raises:
        InputError: ``path`` is missing and per-policy files of it exist.
    """
    path = Path(path)
    if path.exists() or not path.suffix:
        return
    written = sorted(path.parent.glob(f"{path.stem}.*{path.suffix}"))
    if written:
        raise InputError("no such file; simulate --export-memory-viz wrote one file per policy: "
                         + ", ".join(str(p) for p in written) + " (give one of them)", source=str(path))

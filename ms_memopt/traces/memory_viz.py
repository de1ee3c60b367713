"""Export events and a layout in PyTorch's memory snapshot format, for pytorch.org/memory_viz.

The file is what ``torch.cuda.memory._dump_snapshot()`` writes: a pickle (protocol 4) of
``{"segments": [...], "device_traces": [[...]], "allocator_settings": {...}}`` holding only
builtin types, so :func:`~ms_memopt.traces.torch_snapshot.read_torch_snapshot` (and PyTorch's
viewer) can load it. ``segments`` is the layout (live blocks ``active_allocated``, free ones
``inactive``); ``device_traces[0]`` the events: each ``alloc``, each free as
``free_requested`` + ``free_completed``, ``segment_alloc`` / ``segment_free``. Frames
(stack traces) are empty lists: the viewer shows such blocks without a stack.

To view a model's placements rather than the recorded ones, :func:`placed_events` replays a
trace through a model and returns the events with the model's addresses.

Example:
    >>> from ms_memopt.events import Event
    >>> from ms_memopt.layout import Block, Layout, Segment
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "viz.pickle")
    >>> seg = Segment(0x200000, 2 << 20, [Block(0x200000, 512, True), Block(0x200200, (2 << 20) - 512, False)])
    >>> write_memory_viz(path, [Event("alloc", id=1, size=500, addr=0x200000)], Layout([seg]))
    >>> from ms_memopt.traces.torch_snapshot import read_torch_snapshot
    >>> [e.action for e in read_torch_snapshot(path).events]
    ['alloc']
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Iterable

from ..allocators.base import AllocatorModel
from ..errors import InputError
from ..events import Event, Trace
from ..layout import Layout
from ..replay import ReplayResult, replay

__all__ = ["write_memory_viz", "snapshot_dict", "placed_events"]

_SMALL_SEGMENT = 2 << 20


def _segment_type(pool: str, size: int) -> str:
    if pool in ("small", "large"):
        return pool
    return "small" if size <= _SMALL_SEGMENT else "large"


def snapshot_dict(events: Iterable[Event], layout: Layout, *, device: int = 0) -> dict:
    """The snapshot as a dict of builtin types (what :func:`write_memory_viz` pickles).

    Frees without ``addr`` get the address of their ``alloc`` (by ``id``); an ``alloc``
    without an address cannot be drawn and raises :class:`InputError`.
    """
    trace: list[dict] = []
    addr_of: dict[int, int] = {}
    for index, event in enumerate(events):
        action = event.action
        base = {"addr": event.addr, "size": int(event.size), "stream": int(event.stream), "frames": []}
        if event.time is not None:
            base["time_us"] = int(round(event.time * 1e6))
        if action == "alloc":
            if event.addr is None:
                raise InputError(f"event {index}: alloc of id {event.id} has no address; "
                                 "use placed_events() to take a model's placements", key="--export-memory-viz")
            if event.id is not None:
                addr_of[event.id] = event.addr
            trace.append({"action": "alloc", **base})
        elif action == "free":
            addr = event.addr if event.addr is not None else addr_of.get(event.id)
            if addr is None:
                continue  # freed before the trace began and never placed: nothing to draw
            base["addr"] = addr
            trace.append({"action": "free_requested", **base})
            trace.append({"action": "free_completed", **base})
        elif action in ("segment_alloc", "segment_free") and event.addr is not None:
            trace.append({"action": action, **base})

    segments = []
    for seg in sorted(layout.segments, key=lambda s: s.addr):
        blocks = [{"address": b.addr, "size": b.size, "requested_size": b.size if b.live else 0,
                   "state": "active_allocated" if b.live else "inactive", "frames": []}
                  for b in seg.blocks]
        allocated = sum(b.size for b in seg.blocks if b.live)
        segments.append({
            "device": device, "address": seg.addr, "total_size": seg.size,
            "allocated_size": allocated, "active_size": allocated, "requested_size": allocated,
            "stream": seg.stream, "segment_type": _segment_type(seg.pool, seg.size),
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks,
        })
    return {"segments": segments, "device_traces": [trace] if device == 0 else [[]] * device + [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "written_by": "ms-memopt"}}


def write_memory_viz(path: str | Path, trace_or_events: Trace | Iterable[Event], layout: Layout | None = None,
                     *, device: int = 0) -> None:
    """Write ``trace_or_events`` and ``layout`` as a PyTorch memory snapshot pickle.

    Args:
        path: the ``.pickle`` file to write (parent directories are created).
        trace_or_events: a :class:`Trace` (its events; ``final`` when ``layout`` is ``None``)
            or a list of events with addresses.
        layout: the segments and blocks at the end of the events.
        device: the device index the snapshot describes.
    """
    if isinstance(trace_or_events, Trace):
        events = trace_or_events.events
        if layout is None:
            layout = trace_or_events.final
    else:
        events = trace_or_events
    data = snapshot_dict(events, layout or Layout(), device=device)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        pickle.dump(data, handle, protocol=4)


def placed_events(trace: Trace, model: AllocatorModel) -> tuple[list[Event], ReplayResult]:
    """Replay ``trace`` through ``model`` and return its events with the model's addresses.

    Allocations the model could not serve (OOM) and their frees are left out. The result's
    ``final_layout`` is the layout to export with them.

    Example:
        >>> from ms_memopt.allocators import create
        >>> events, result = placed_events(Trace([Event("alloc", id=1, size=4096)]), create("torch"))
        >>> events[0].addr == result.final_layout.segments[0].addr
        True
    """
    placed: list[int | None] = []
    malloc = model.malloc

    def recording_malloc(size, **kwargs):
        addr = malloc(size, **kwargs)
        placed.append(addr)
        return addr

    model.malloc = recording_malloc  # replay looks the method up on the instance
    try:
        result = replay(trace, model, sample_every=0)
    finally:
        del model.malloc
    out: list[Event] = []
    addr_of: dict[int, int] = {}
    if trace.initial is not None:
        addr_of.update({b.id: b.addr for b in trace.initial.live_blocks() if b.id is not None})
    allocs = iter(placed)
    for event in trace.events:
        if event.action == "alloc":
            addr = next(allocs)
            if addr is None:
                continue
            addr_of[event.id] = addr
            out.append(Event("alloc", id=event.id, size=event.size, addr=addr, stream=event.stream,
                             time=event.time, tag=event.tag))
        elif event.action == "free":
            addr = addr_of.pop(event.id, None)
            if addr is not None:
                out.append(Event("free", id=event.id, size=event.size, addr=addr, stream=event.stream,
                                 time=event.time, tag=event.tag))
    return out, result

"""Offline placement instances (``id,lower,upper,size``) as an event stream.

An instance lists buffers with known lifetimes ``[lower, upper)`` (MiniMalloc's format; also
MindSpore SOMAS tensor exports). As a trace, each buffer is an ``alloc`` at ``lower`` and a
``free`` at ``upper``. Lifetimes are half-open, so at equal times every free comes before every
alloc (a buffer ending at t and one starting at t may share memory); allocs at the same time keep
the file's order. Event ids are the buffers' positions (1-based); ``meta["buffer_ids"]`` maps
them back to the file's ids. The file is read and validated by
:func:`ms_memopt.io.traces.instances.read_instance`.

Example:
    >>> from types import SimpleNamespace as B
    >>> t = instances_to_trace([B(id="a", lower=0, upper=2, size=8), B(id="b", lower=2, upper=3, size=4)])
    >>> [(e.action, e.id, e.time) for e in t.events]
    [('alloc', 1, 0), ('free', 1, 2), ('alloc', 2, 2), ('free', 2, 3)]
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from ms_memopt.core.events import Event, Trace
from ms_memopt.core.placement import Buffer
from ms_memopt.io.traces.instances import is_instance_header as looks_like_instances
from ms_memopt.io.traces.instances import read_instance

__all__ = ["FORMAT", "looks_like_instances", "instances_to_trace", "trace_to_instances", "read_instances_trace"]

FORMAT = "instances"


def instances_to_trace(buffers: Iterable, *, source: str = "") -> Trace:
    """Turn buffers (objects with ``id``, ``lower``, ``upper``, ``size``) into a trace."""
    keyed: list[tuple[int, int, int, Event]] = []
    ids: list[str] = []
    for number, buf in enumerate(buffers, start=1):
        ids.append(str(buf.id))
        keyed.append((buf.lower, 1, number, Event("alloc", id=number, size=buf.size, time=buf.lower)))
        keyed.append((buf.upper, 0, number, Event("free", id=number, time=buf.upper)))
    keyed.sort(key=lambda item: (item[0], item[1], item[2]))
    return Trace([item[3] for item in keyed], source=source, format=FORMAT,
                 meta={"buffers": len(ids), "buffer_ids": ids, "time_unit": "logical"})


def read_instances_trace(path: str | Path) -> Trace:
    """Read an instance CSV (validated by the instances reader) as a trace.

    Raises:
        InputError: whatever the instances reader rejects (it names file and line).
    """
    return instances_to_trace(read_instance(path), source=str(path))


def trace_to_instances(trace: Trace) -> list[Buffer]:
    """The buffers of a trace as a placement instance: the inverse of :func:`instances_to_trace`.

    Time is the position among the trace's ``alloc`` and ``free`` events, so a buffer freed
    just before another is allocated may share its memory. A buffer never freed lives to the
    end (``upper`` = one past the last event). Ids are the trace's event ids. Packing the result
    (``ms-memopt pack``) shows how little memory the same requests need when every lifetime is
    known ahead, against what the dynamic allocator reserved.

    Example:
        >>> t = Trace([Event("alloc", id=1, size=8), Event("alloc", id=2, size=4), Event("free", id=1)])
        >>> trace_to_instances(t)
        [Buffer(id='1', lower=0, upper=2, size=8), Buffer(id='2', lower=1, upper=3, size=4)]
    """
    open_buffers: dict[int, tuple[int, int]] = {}
    buffers: list[tuple[int, Buffer]] = []
    time = 0
    for event in trace.events:
        if event.action == "alloc":
            open_buffers[event.id] = (time, event.size)
        elif event.action == "free" and event.id in open_buffers:
            lower, size = open_buffers.pop(event.id)
            buffers.append((lower, Buffer(str(event.id), lower, time, size)))
        else:
            continue
        time += 1
    buffers.extend((lower, Buffer(str(key), lower, time, size)) for key, (lower, size) in open_buffers.items())
    buffers.sort(key=lambda item: item[0])
    return [buf for _, buf in buffers if buf.size > 0]

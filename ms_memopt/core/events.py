"""The one event model every trace reader produces and every allocator model consumes.

An :class:`Event` is one thing that happened to device memory, in order:

=================  ==========================================================================
``alloc``          a tensor of ``size`` bytes was allocated; ``id`` pairs it with its free;
                   ``addr`` is the recorded address when the source knows it
``free``           the tensor ``id`` was freed (and its memory may be reused from now on)
``segment_alloc``  the recording pool took a new segment ``[addr, addr + size)`` from the device
``segment_free``   the recording pool gave the segment at ``addr`` back to the device
``segment_map``    the recording pool mapped device pages at ``[addr, addr + size)`` of a
                   virtual range it reserved (PyTorch's and torch_npu's expandable segments):
                   its memory grew there
``segment_unmap``  the recording pool unmapped the pages ``[addr, addr + size)``: it shrank
``empty_cache``    the framework released every idle segment
``step``           a training step boundary (``step`` holds the new step number)
``mark``           a named moment inside a step (``tag``), e.g. ``"optimizer_end"``
=================  ==========================================================================

``pool`` is ``"persistent"`` for requests MindSpore serves from its persistent pool
(weights, optimizer states); ``None`` lets the model decide. ``stream`` is the stream the
request belongs to. Sizes are bytes as requested (before the model's rounding).

The JSONL form (docs/events.md) is one JSON object per line; the first line is a header
``{"format": "ms-memopt-events", "version": 1, ...}``; keys that are ``None`` are omitted.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Iterable, Iterator

from ms_memopt.core.consistency import TraceChecker
from ms_memopt.core.errors import InputError
from ms_memopt.core.lines import open_input
from ms_memopt.core.jsontext import parse_json
from ms_memopt.core.layout import Layout
from ms_memopt.core.units import short_repr

__all__ = ["Event", "Trace", "ACTIONS", "SEGMENT_ACTIONS", "FIELDS", "ROW_INDEX", "JSONL_FORMAT", "EventWriter", "write_jsonl", "read_jsonl", "iter_jsonl", "stream_jsonl", "MAX_EVENTS_IN_MEMORY", "too_many_events"]

#: events a reader holds in a list (about 160 bytes each: ~640 MB); past it, a command that reads a
#: trace whole refuses it and says that ``replay`` reads it as a stream (memory bounded by the state)
MAX_EVENTS_IN_MEMORY = 4_000_000

ACTIONS = ("alloc", "free", "segment_alloc", "segment_free", "segment_map", "segment_unmap", "empty_cache", "step",
           "mark")
#: the actions that say where the pool's memory grew or shrank (an ``addr`` is required)
SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")
JSONL_FORMAT = "ms-memopt-events"
JSONL_VERSION = 1


@dataclass(slots=True)
class Event:
    """One memory event; see the module docstring for the actions.

    Example:
        >>> Event("alloc", id=7, size=4096, tag="activation")
        Event(action='alloc', id=7, size=4096, addr=None, stream=0, pool=None, time=None, tag='activation', step=None)
    """

    action: str
    id: int | None = None
    size: int = 0
    addr: int | None = None
    stream: int = 0
    pool: str | None = None
    time: float | None = None
    tag: str | None = None
    step: int | None = None

    def to_dict(self) -> dict:
        """The JSONL object: ``None`` fields, stream 0 and size 0 (but an allocation's) are left out."""
        out = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if value is None or (value == 0 and (name == "stream" or (name == "size" and self.action not in
                                                                      ("alloc", "segment_alloc", "segment_map")))):
                continue    # an alloc keeps size 0: MindSpore's pool is asked for 0 bytes (and gives 512)
            out[name] = value
        return out


#: Event's fields in their order: the one definition of a *row*, the plain tuple the simulator
#: generates for speed (``Event(*row)`` is the event). The compiled loop takes its indices from
#: here at import (``allocators/fast.py``), the simulator reads rows through :data:`ROW_INDEX`.
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Event))
_FIELDS = FIELDS
#: field name -> its position in a row
ROW_INDEX: dict[str, int] = {name: i for i, name in enumerate(FIELDS)}


class EventWriter:
    """Append events to a JSONL file, one flushed line each, so a crash loses at most a line.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "events.jsonl")
        >>> with EventWriter(path, meta={"source": "doc"}) as w:
        ...     w.write(Event("alloc", id=1, size=512))
        >>> [e.action for e in read_jsonl(path).events]
        ['alloc']
    """

    def __init__(self, path: str | Path, *, meta: dict | None = None, flush_every: int = 1) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(self.path, "w", encoding="utf-8")
        self._flush_every = max(1, flush_every)
        self._pending = 0
        header = {"format": JSONL_FORMAT, "version": JSONL_VERSION}
        if meta:
            header["meta"] = meta
        self._file.write(json.dumps(header) + "\n")
        self._file.flush()

    def write(self, event: Event) -> None:
        self._file.write(json.dumps(event.to_dict(), separators=(",", ":")) + "\n")
        self._pending += 1
        if self._pending >= self._flush_every:
            self._file.flush()
            self._pending = 0

    def write_all(self, events: Iterable[Event]) -> None:
        for event in events:
            self.write(event)

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()

    def __enter__(self) -> "EventWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_jsonl(path: str | Path, events: Iterable[Event], *, meta: dict | None = None) -> None:
    """Write a whole event list as JSONL (buffered; use :class:`EventWriter` for live logs)."""
    with EventWriter(path, meta=meta, flush_every=65536) as writer:
        writer.write_all(events)


@dataclass
class Trace:
    """A recorded (or generated) event stream with what is known around it.

    ``initial`` is the allocator state when recording began (segments and live blocks whose
    ``id`` the events' frees refer to), ``final`` the state the source recorded at the end
    (to check a replay block by block); both ``None`` when the source does not say.
    ``format`` names the reader (``"torch-snapshot"``, ``"mindspore-memory-block"``, ...).
    """

    events: list[Event]
    source: str = ""
    format: str = ""
    initial: Layout | None = None
    final: Layout | None = None
    meta: dict = field(default_factory=dict)
    #: what the trace says that cannot have happened, ``{kind: {"count", "first_line"}}``
    #: (:mod:`ms_memopt.core.consistency`); empty when nothing was found or nothing checked
    inconsistencies: dict = field(default_factory=dict)


def _int_field(obj: dict, name: str, source: str, line: int, *, required: bool = False) -> int | None:
    value = obj.get(name)
    if value is None:
        if required:
            raise InputError(f"missing {name!r}", source=source, line=line)
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name!r} must be an integer, got {value!r}", source=source, line=line)
    if name in ("size", "addr") and value < 0:
        raise InputError(f"{name!r} must be >= 0, got {value}", source=source, line=line)
    return value


def _finite_number(value: object) -> bool:
    """An int or float within float range (an int like 10**400 is not: times become floats)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


_FIELD_SET = frozenset(FIELDS)
_SIZE_REQUIRED = frozenset({"alloc", "segment_alloc", "segment_map", "segment_unmap"})
_ID_REQUIRED = frozenset({"alloc", "free"})


def iter_jsonl(lines: Iterable[str], source: str, checker: TraceChecker | None = None) -> Iterator[Event]:
    """Parse JSONL event lines (the header already consumed); errors name ``source`` and line.
    ``checker`` sees every event with its line (what cannot have happened: :mod:`ms_memopt.core.consistency`).

    A line whose fields are plainly right (integers where integers go, strings or nothing for
    ``pool`` and ``tag``, a float or int time) is built at once; any doubt goes through the checks
    that name the field (the same messages), so the common line costs a JSON decode and little more.
    """
    segment_actions = frozenset(SEGMENT_ACTIONS)
    actions = frozenset(ACTIONS)
    for number, text in enumerate(lines, start=2):
        if not text or text.isspace():
            continue
        obj = parse_json(text, source=source, line=number)
        if type(obj) is not dict:
            raise InputError(f"expected a JSON object, got {type(obj).__name__}", source=source, line=number)
        get = obj.get
        action = get("action")
        if type(action) is not str or action not in actions:
            raise InputError(f"unknown action {short_repr(action)}; expected one of {', '.join(ACTIONS)}",
                             source=source, line=number)
        if not _FIELD_SET.issuperset(obj):
            unknown = set(obj) - _FIELD_SET
            raise InputError(f"unknown keys {sorted(map(str, unknown))}; expected some of {', '.join(_FIELDS)}",
                             source=source, line=number)
        ident, size, addr, stream, step = get("id"), get("size"), get("addr"), get("stream"), get("step")
        time, pool, tag = get("time"), get("pool"), get("tag")
        plain = ((type(ident) is int or (ident is None and action not in _ID_REQUIRED))
                 and (type(size) is int and size >= 0 or (size is None and action not in _SIZE_REQUIRED))
                 and (type(addr) is int and addr >= 0 or (addr is None and action not in segment_actions))
                 and (stream is None or type(stream) is int) and (step is None or type(step) is int)
                 and (pool is None or type(pool) is str) and (tag is None or type(tag) is str)
                 and (time is None or (type(time) is float and time - time == 0) or type(time) is int))
        if plain and type(time) is int and not _finite_number(time):
            plain = False
        if plain:
            event = Event(action, ident, size or 0, addr, stream or 0, pool, time, tag, step)
        else:
            event = _checked_event(obj, action, source, number)
        if checker is not None:
            checker.feed(event, number)
        yield event


def _checked_event(obj: dict, action: str, source: str, number: int) -> Event:
    """The event of a JSONL object, each field checked with a message naming it."""
    size = _int_field(obj, "size", source, number, required=action in _SIZE_REQUIRED) or 0
    addr = _int_field(obj, "addr", source, number, required=action in SEGMENT_ACTIONS)
    time = obj.get("time")
    if time is not None and not _finite_number(time):
        raise InputError(f"'time' must be a finite number, got {short_repr(time)}", source=source, line=number)
    for name in ("pool", "tag"):
        if obj.get(name) is not None and not isinstance(obj[name], str):
            raise InputError(f"{name!r} must be a string, got {obj[name]!r}", source=source, line=number)
    return Event(
        action=action,
        id=_int_field(obj, "id", source, number, required=action in _ID_REQUIRED),
        size=size,
        addr=addr,
        stream=_int_field(obj, "stream", source, number) or 0,
        pool=obj.get("pool"),
        time=time,
        tag=obj.get("tag"),
        step=_int_field(obj, "step", source, number),
    )


def read_jsonl(path: str | Path) -> Trace:
    """Read an ms-memopt JSONL event file.

    Raises:
        InputError: not our format, or a malformed line (the message names file and line).
    """
    source = str(path)
    with open_input(path, expected="an ms-memopt JSONL event file") as handle:
        meta = _jsonl_header(handle, source)
        checker = TraceChecker()
        events = []
        for event in iter_jsonl(handle, source, checker):
            events.append(event)
            if len(events) > MAX_EVENTS_IN_MEMORY:
                raise too_many_events(source)
    return Trace(events, source=source, format="jsonl", meta=meta, inconsistencies=checker.found.to_meta())


def too_many_events(source: str) -> InputError:
    """The error of a trace too long to hold whole (:data:`MAX_EVENTS_IN_MEMORY`)."""
    return InputError(f"more than {MAX_EVENTS_IN_MEMORY:,} events: this command holds the whole trace in memory; "
                      "`ms-memopt replay` reads a trace this long as a stream, or cut the recording", source=source)


class _JsonlEvents:
    """The events of a JSONL file, read each time they are iterated (memory: one line)."""

    def __init__(self, path: str | Path, trace: Trace) -> None:
        self.path = path
        self.trace = trace      # what the checker found is put on it at the end

    def __iter__(self) -> Iterator[Event]:
        source = str(self.path)
        checker = TraceChecker()
        with open_input(self.path, expected="an ms-memopt JSONL event file") as handle:
            _jsonl_header(handle, source)
            yield from iter_jsonl(handle, source, checker)
        self.trace.inconsistencies = checker.found.to_meta()


def stream_jsonl(path: str | Path) -> Trace:
    """:func:`read_jsonl` as a stream: ``trace.events`` reads the file as it is iterated.

    Raises:
        InputError: not our format (checked now), or a malformed line (when iterated).
    """
    source = str(path)
    with open_input(path, expected="an ms-memopt JSONL event file") as handle:
        meta = _jsonl_header(handle, source)
    trace = Trace([], source=source, format="jsonl", meta=meta)
    trace.events = _JsonlEvents(path, trace)   # type: ignore[assignment]
    return trace


def _jsonl_header(handle, source: str) -> dict:
    """The header line's ``meta`` (the header read from ``handle``), checked."""
    first = handle.readline()
    try:
        header = parse_json(first, source=source, line=1) if first.strip() else None
    except InputError:
        header = None
    if not isinstance(header, dict) or header.get("format") != JSONL_FORMAT:
        raise InputError(f'expected the header line {{"format": "{JSONL_FORMAT}", "version": 1}}',
                         source=source, line=1)
    if header.get("version") != JSONL_VERSION:
        raise InputError(f"unsupported version {header.get('version')!r}; expected {JSONL_VERSION}",
                         source=source, line=1)
    meta = header.get("meta") or {}
    return meta if isinstance(meta, dict) else {}

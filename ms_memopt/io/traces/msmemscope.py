"""Huawei msMemScope dump CSV (``memscope_dump_*.csv``) -> :class:`~ms_memopt.core.events.Trace`.

Columns (msMemScope's output spec; seen in ``shared/data/traces/msmemscope/baseline.csv``):
``ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr,
Call Stack(Python),Call Stack(C)``. ``Attr`` is a quoted ``{key:value,...}`` list; for memory
events it holds ``allocation_id``, ``addr``, ``size`` and, for framework allocations, the pool's
``total`` (reserved) and ``used`` (allocated) bytes after the event.

Mapping (``Event`` / ``Event Type``):

* ``MALLOC``/``FREE`` of a framework allocator (``PTA`` = torch_npu caching allocator,
  ``MINDSPORE``, ``ATB``, ``PTA_WORKSPACE``) -> ``alloc``/``free`` paired by ``allocation_id``
  (by address when absent); ``tag`` = the sub-type.
* ``MALLOC``/``FREE`` of type ``HAL`` (the driver, ``aclrtMalloc``): a pool *segment* when some
  framework allocation falls inside it while it lives -> ``segment_alloc``/``segment_free``;
  other driver allocations (op workspaces, communication buffers) are outside the pool and only
  counted in ``meta["other_device_allocs"]`` / ``meta["other_device_bytes"]``.
* ``HOST``/``HOST_PINNED`` memory is ignored; ``MSTX`` marks become ``mark`` events.
* Segments that existed before recording started: when framework allocations fall outside every
  recorded segment, and the first event's ``total`` says how much the pool already held, one
  segment of that size is inferred, placed at the allocations' lowest address rounded down to
  2 MiB when it still covers them (``tag="inferred"``, ``meta["inferred_segments"]``). When the
  lowest such allocation lies above that base, the space below it is held by an ``alloc`` of id 0
  (``tag="pre-trace"``, ``meta["pre_trace_bytes"]``): memory allocated before recording began and
  not freed while it ran (with it, the torch model reproduces every recorded address of the
  shared baseline).

Rows are sorted by ``Timestamp(ns)`` (the file is not in time order), then by ``ID``; another
unit in the column name (``Timestamp(us)``) is accepted and kept in ``meta["time_unit"]``. Only one
device is replayed: the lowest ``Device Id`` with memory events (``meta["devices"]`` lists all).
``time`` is the timestamp in nanoseconds.
"""
from __future__ import annotations

import bisect
import csv
from pathlib import Path

from ms_memopt.core.consistency import TraceChecker
from ms_memopt.core.errors import InputError
from ms_memopt.core.lines import open_input
from ms_memopt.core.events import Event, MAX_EVENTS_IN_MEMORY, Trace, too_many_events
from ms_memopt.io.traces.fields import parse_address, parse_int

__all__ = ["FORMAT", "REQUIRED_COLUMNS", "looks_like_msmemscope", "read_msmemscope", "parse_attr"]

FORMAT = "msmemscope"
REQUIRED_COLUMNS = ("ID", "Event", "Event Type", "Device Id", "Attr")  # plus Timestamp(<unit>)
_SEGMENT_TYPE = "HAL"
_HOST_TYPES = {"HOST", "HOST_PINNED"}
_SEGMENT_ALIGN = 2 * 2**20


def looks_like_msmemscope(first_line: str) -> bool:
    """True when ``first_line`` is an msMemScope dump header."""
    try:
        columns = next(csv.reader([first_line.lstrip("\ufeff")]))
    except (csv.Error, StopIteration):
        return False
    return all(name in columns for name in REQUIRED_COLUMNS) and _time_column(columns) is not None


def _time_column(columns: list[str]) -> str | None:
    return next((c for c in columns if c.startswith("Timestamp")), None)


def parse_attr(text: str, *, source: str | None = None, line: int | None = None) -> dict[str, str]:
    """Split an ``Attr`` cell ``{allocation_id:4,addr:0x12c0,size:512}`` into a dict of strings.

    Example:
        >>> parse_attr("{allocation_id:4,addr:0x10,size:512}")["size"]
        '512'
    """
    text = text.strip()
    if not text:
        return {}
    if not (text.startswith("{") and text.endswith("}")):
        raise InputError(f"Attr: expected {{key:value,...}}, got {text[:60]!r}", source=source, line=line)
    out: dict[str, str] = {}
    for item in text[1:-1].split(","):
        key, sep, value = item.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _attr_int(attr: dict[str, str], key: str, source: str, line: int, *, required: bool = False) -> int | None:
    value = attr.get(key)
    if value is None or value == "":
        if required:
            raise InputError(f"Attr: missing {key!r}; expected {{allocation_id:..,addr:..,size:..}}",
                             source=source, line=line)
        return None
    return parse_int(value, f"Attr {key}", source=source, line=line, allow_hex=True, non_negative=True)


class _Row:
    __slots__ = ("time", "order", "line", "event", "kind", "handle", "addr", "size", "total", "name")

    def __init__(self, time, order, line, event, kind, handle, addr, size, total, name):
        self.time, self.order, self.line, self.event, self.kind = time, order, line, event, kind
        self.handle, self.addr, self.size, self.total, self.name = handle, addr, size, total, name


def read_msmemscope(path: str | Path) -> Trace:
    """Read an msMemScope dump CSV (see the module docstring for the mapping).

    Raises:
        InputError: missing columns, a short row, a bad timestamp, size or address, or a
            malformed ``Attr``; the message names the file and line.
    """
    with open_input(path, expected="an msMemScope CSV") as handle:
        return _read(handle, str(path))


def _read(handle, source: str) -> Trace:
    reader = csv.reader(handle)
    try:
        header = next(reader, None)
        if not header:
            raise InputError("empty file; expected the msMemScope header ID,Event,Event Type,...",
                             source=source, line=1)
        header[0] = header[0].lstrip("\ufeff")
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        time_column = _time_column(header)
        if time_column is None:
            missing.append("Timestamp(ns)")
        if missing:
            raise InputError(f"not an msMemScope CSV header: missing {', '.join(missing)}", source=source, line=1)
        col = {name: i for i, name in enumerate(header)}
        width = max(col[c] for c in REQUIRED_COLUMNS + (time_column,)) + 1
        i_ptr, i_name = col.get("Ptr"), col.get("Name")
        rows: list[_Row] = []
        devices: set[str] = set()
        start_line = 2
        for fields in reader:
            line = start_line
            start_line = reader.line_num + 1
            if not fields or all(not f.strip() for f in fields):
                continue
            if len(fields) < width:
                raise InputError(f"expected at least {width} fields as in the header, got {len(fields)} "
                                 "(truncated row?)", source=source, line=line)
            event = fields[col["Event"]].strip()
            kind = fields[col["Event Type"]].strip()
            if event not in ("MALLOC", "FREE", "MSTX"):
                continue
            time = parse_int(fields[col[time_column]], time_column, source=source, line=line)
            order = parse_int(fields[col["ID"]], "ID", source=source, line=line)
            if event == "MSTX":
                name = fields[i_name].strip() if i_name is not None else ""
                rows.append(_Row(time, order, line, event, kind, None, None, 0, None, name or kind))
                continue
            if kind.upper() in _HOST_TYPES:
                continue
            device = fields[col["Device Id"]].strip()
            attr = parse_attr(fields[col["Attr"]], source=source, line=line)
            addr_text = attr.get("addr") or (fields[i_ptr] if i_ptr is not None else "")
            addr = parse_address(addr_text, source=source, line=line, what="addr")
            size = _attr_int(attr, "size", source, line, required=event == "MALLOC") or 0
            handle_id = _attr_int(attr, "allocation_id", source, line)
            total = _attr_int(attr, "total", source, line)
            devices.add(device)
            rows.append(_Row(time, order, line, event, kind, handle_id, addr, size, total, device))
            if len(rows) > MAX_EVENTS_IN_MEMORY:      # rows are held whole: the file is not in time order
                raise too_many_events(source)
    except csv.Error as exc:
        raise InputError(f"malformed CSV ({exc})", source=source, line=reader.line_num) from None
    unit = time_column[len("Timestamp"):].strip("() ") or "ns"
    return _to_trace(rows, devices, source, unit)


def _device_key(device: str):
    """Device ids in numeric order, then the others (``host``) by name; digits are compared by
    length and text, not converted: a 5,000-digit id is beyond ``int()``'s string limit."""
    if device.isdigit():
        digits = device.lstrip("0") or "0"
        return (0, len(digits), digits)
    return (1, 0, device)


def _to_trace(rows: list[_Row], devices: set[str], source: str, unit: str) -> Trace:
    rows.sort(key=lambda r: (r.time, r.order))
    device = min(devices, key=_device_key) if devices else None
    rows = [r for r in rows if r.event == "MSTX" or r.name == device]

    # which driver allocations are pool segments: those holding a framework allocation
    live_hal: dict[int, tuple[int, int]] = {}  # base -> (size, row index)
    bases: list[int] = []
    pool_segment: set[int] = set()
    outside: list[_Row] = []
    first_total: int | None = None
    for index, row in enumerate(rows):
        if row.event == "MSTX" or row.addr is None:
            continue
        if row.kind == _SEGMENT_TYPE:
            if row.event == "MALLOC":
                live_hal[row.addr] = (row.size, index)
                bisect.insort(bases, row.addr)
            elif row.addr in live_hal:
                del live_hal[row.addr]
                bases.pop(bisect.bisect_left(bases, row.addr))
            continue
        if first_total is None and row.total is not None:
            first_total = row.total
        if row.event != "MALLOC":
            continue
        at = bisect.bisect_right(bases, row.addr) - 1
        if at >= 0 and row.addr < bases[at] + live_hal[bases[at]][0]:
            pool_segment.add(live_hal[bases[at]][1])
        else:
            outside.append(row)

    events: list[Event] = []
    meta: dict = {"devices": sorted(devices, key=_device_key), "device": device, "time_unit": unit,
                  "other_device_allocs": 0, "other_device_bytes": 0, "inferred_segments": 0}
    inferred = _infer_initial_segment(outside, first_total, rows, pool_segment)
    if inferred is not None:
        base, size = inferred
        start = rows[0].time if rows else None
        events.append(Event("segment_alloc", size=size, addr=base, time=start, tag="inferred"))
        meta["inferred_segments"] = 1
        low = min(r.addr for r in outside)
        if low > base:
            # the pool placed the first recorded tensor above the segment's base: something
            # allocated before recording began still holds [base, low)
            events.append(Event("alloc", id=0, size=low - base, addr=base, time=start, tag="pre-trace"))
            meta["pre_trace_bytes"] = low - base

    segment_of_free: dict[int, bool] = {}  # base -> is a pool segment (for matching HAL frees)
    open_ids: dict[int, int] = {}  # allocation_id or addr -> event id
    next_id = 1
    checker = TraceChecker()        # what cannot have happened, by kind with its first line
    first_malloc: dict[tuple, int] = {}
    for index, row in enumerate(rows):
        if row.event == "MALLOC" and row.kind != _SEGMENT_TYPE:
            key = ("id", row.handle) if row.handle is not None else ("addr", row.addr)
            first_malloc.setdefault(key, index)
    for index, row in enumerate(rows):
        if row.event == "MSTX":
            events.append(Event("mark", time=row.time, tag=row.name))
            continue
        if row.kind == _SEGMENT_TYPE:
            if row.event == "MALLOC":
                is_pool = index in pool_segment
                segment_of_free[row.addr] = is_pool
                if is_pool:
                    events.append(Event("segment_alloc", size=row.size, addr=row.addr, time=row.time))
                else:
                    meta["other_device_allocs"] += 1
                    meta["other_device_bytes"] += row.size
            elif segment_of_free.pop(row.addr, False):
                events.append(Event("segment_free", size=row.size, addr=row.addr, time=row.time))
            continue
        key = ("id", row.handle) if row.handle is not None else ("addr", row.addr)
        if row.event == "MALLOC":
            if key in open_ids:     # the first one never freed in the events: it leaks in replay
                checker.found.note("duplicate_live_id", row.line)
            open_ids[key] = next_id
            events.append(Event("alloc", id=next_id, size=row.size, addr=row.addr, time=row.time, tag=row.kind))
            checker.feed(events[-1], row.line)
            next_id += 1
        else:
            event_id = open_ids.pop(key, None)
            if event_id is None and row.handle is not None:
                event_id = open_ids.pop(("addr", row.addr), None)
            if event_id is not None:
                events.append(Event("free", id=event_id, addr=row.addr, time=row.time))
                checker.feed(events[-1], row.line)
            else:
                meta["unmatched_frees"] = meta.get("unmatched_frees", 0) + 1
                first = first_malloc.get(key)
                kind = "unknown_free" if first is None else ("free_before_malloc" if first > index else "double_free")
                checker.found.note(kind, row.line)
    return Trace(events, source=source, format=FORMAT, meta=meta, inconsistencies=checker.found.to_meta())


def _infer_initial_segment(outside: list[_Row], first_total: int | None, rows: list[_Row],
                           pool_segment: set[int]) -> tuple[int, int] | None:
    """One pre-existing segment covering the allocations no recorded segment holds, if consistent."""
    if not outside or not first_total:
        return None
    # reserved at the first framework event, minus pool segments recorded before it
    recorded_before = 0
    for index, row in enumerate(rows):
        if row.event == "MSTX":
            continue
        if row.kind != _SEGMENT_TYPE and row.total is not None:
            break
        if row.kind == _SEGMENT_TYPE and row.event == "MALLOC" and index in pool_segment:
            recorded_before += row.size
    size = first_total - recorded_before
    low = min(r.addr for r in outside)
    high = max(r.addr + r.size for r in outside)
    if size <= 0 or high - low > size:
        return None
    base = low - low % _SEGMENT_ALIGN
    if base + size < high:
        base = low
    return base, size

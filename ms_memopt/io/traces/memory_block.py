"""MindSpore memory tracker ``memory_block.csv`` -> :class:`~ms_memopt.core.events.Trace`.

MindSpore writes the file at process exit when ``MS_ALLOC_CONF="memory_tracker:True"``. Each row
is one *pool block handed out by the device memory pool* (one tensor, a SOMAS plan, a workspace,
...) with the logical times it was allocated and freed. Facts used here (MindSpore's
``mem_tracker.cc`` writer, 2.x; see docs/traces.md):

* Every field, the header's too, is followed by a comma, and nothing is quoted or escaped, so a
  free-text field (``python_stack``) may contain commas or even newlines. Fixed columns before
  ``python_stack`` are read from the left, those after it from the right.
* 2.10 header: ``start_time_stamp,end_time_stamp,device_addr,stream_id,pool_type,size,
  actual_used_memory,actual_peak_memory,file_name,line_num,type,producer_task,task_name,
  node_name,graph_name,user_tasks,last_user_task,python_stack,is_persistent,is_small,``. Older
  releases lack ``actual_used_memory``, ``last_user_task``, ``is_persistent`` and ``is_small``.
  Columns are found by name, so either layout (and reorderings) read the same.
* Timestamps are one logical counter shared by allocations, frees and tasks, so every alloc and
  free has its own time and sorting by it gives the recorded order.
* ``end_time_stamp = 9223372036854775807`` (INT64_MAX): never freed -> no ``free`` event.
* ``start_time_stamp = end_time_stamp = -1``: a tensor *inside* a static SOMAS plan, bound to a
  slice of a plan block that has its own row. Replaying it would count the plan's memory twice,
  so these rows are **not** turned into events; ``meta["somas_inner_rows"]`` and
  ``meta["somas_inner_bytes"]`` count them.
* ``device_addr`` is printed by ``operator<<(void*)`` (``0x7f...``); decimal is accepted too.
  ``is_persistent`` = 1 -> ``pool="persistent"``; ``stream_id`` -> ``stream``; ``type`` -> ``tag``.

Example:
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "memory_block.csv")
    >>> _ = open(path, "w").write(
    ...     "start_time_stamp,end_time_stamp,device_addr,stream_id,pool_type,size,type,\\n"
    ...     "1,3,0x1000,0,Ascend,512,Kernel,\\n")
    >>> [(e.action, e.time) for e in read_memory_block(path).events]
    [('alloc', 1), ('free', 3)]
"""
from __future__ import annotations

import gc
import re
from pathlib import Path

from ms_memopt.core.errors import InputError
from ms_memopt.core.lines import open_input
from ms_memopt.core.events import Event, MAX_EVENTS_IN_MEMORY, Trace, too_many_events
from ms_memopt.io.traces.fields import parse_address, parse_int

__all__ = ["FORMAT", "NEVER_FREED", "REQUIRED_COLUMNS", "looks_like_memory_block", "read_memory_block"]

FORMAT = "mindspore-memory-block"
NEVER_FREED = 9223372036854775807
REQUIRED_COLUMNS = ("start_time_stamp", "end_time_stamp", "device_addr", "size")
_FREE_TEXT_COLUMN = "python_stack"
# a data row starts with a (possibly negative) integer timestamp; anything else continues the
# previous row's free text (a python_stack with newlines)
_ROW_START = re.compile(r"^-?\d+,")
_ROW_FIRST = set("-0123456789")


def _header_columns(line: str) -> list[str]:
    columns = [c.strip() for c in line.strip().lstrip("\ufeff").split(",")]
    while columns and columns[-1] == "":
        columns.pop()
    return columns


def looks_like_memory_block(first_line: str) -> bool:
    """True when ``first_line`` is a memory_block.csv header (it names the required columns)."""
    columns = set(_header_columns(first_line))
    return all(name in columns for name in REQUIRED_COLUMNS)


def _records(handle, source: str, width: int):
    """Yield ``(line_number, fields)`` per logical row, joining continuation lines."""
    pending: list[str] | None = None
    pending_line = 0
    for number, text in enumerate(handle, start=2):
        text = text.rstrip("\r\n")
        if text[:1] in _ROW_FIRST and _ROW_START.match(text):
            if pending is not None:
                yield pending_line, "\n".join(pending)
            pending, pending_line = [text], number
        elif pending is None:
            if text.strip():
                raise InputError("expected a data row starting with start_time_stamp (an integer)",
                                 source=source, line=number)
        else:
            pending.append(text)
    if pending is not None:
        yield pending_line, "\n".join(pending)


def _split_row(text: str, columns: list[str], free_text: int | None, trailing: bool, source: str,
               line: int) -> list[str]:
    parts = text.split(",")
    width = len(columns)
    if trailing:
        # the writer ends every field with a comma; a row without the last one was cut short
        if parts[-1].strip() != "":
            raise InputError(f"expected {width} fields each followed by a comma as in the header; the row "
                             "does not end with a comma (truncated row?)", source=source, line=line)
        parts.pop()
    if len(parts) == width:
        return parts
    if len(parts) > width and free_text is not None:
        after = width - free_text - 1
        if len(parts) >= width:
            head = parts[:free_text]
            tail = parts[len(parts) - after:] if after else []
            middle = ",".join(parts[free_text:len(parts) - after])
            return head + [middle] + tail
    raise InputError(f"expected {width} comma-separated fields as in the header, got {len(parts)}"
                     + (" (truncated row?)" if len(parts) < width else ""), source=source, line=line)


def read_memory_block(path: str | Path) -> Trace:
    """Read a MindSpore ``memory_block.csv`` into a time-ordered event stream.

    Each row with a real start time becomes an ``alloc`` at ``start_time_stamp`` (``addr`` =
    ``device_addr``) and, unless never freed, a ``free`` at ``end_time_stamp``. Event ids are the
    rows' 1-based positions. ``meta`` holds ``rows``, ``never_freed``, ``somas_inner_rows``,
    ``somas_inner_bytes``, ``pools`` (the ``pool_type`` values), ``layout`` (``"2.10"`` when
    ``actual_used_memory`` is present, else ``"older"``) and ``time_unit`` (``"logical"``).

    Raises:
        InputError: not UTF-8, missing columns, a short row, a non-integer time or size, or a
            free before its alloc; the message names the file and line.
    """
    source = str(path)
    with open_input(path, expected="a MindSpore memory_block.csv") as handle:
        header = handle.readline()
        if not header.strip():
            raise InputError("empty file; expected a memory_block.csv header line", source=source, line=1)
        columns = _header_columns(header)
        missing = [name for name in REQUIRED_COLUMNS if name not in columns]
        if missing:
            raise InputError(f"not a MindSpore memory_block.csv header: missing {', '.join(missing)}; "
                             f"expected columns {', '.join(REQUIRED_COLUMNS)}, ...", source=source, line=1)
        return _read_rows(handle, columns, header.rstrip().endswith(","), source)


def _read_rows(handle, columns: list[str], trailing: bool, source: str) -> Trace:
    # building a million small objects triggers the cyclic GC over and over; none of them form cycles
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _read_rows_fast(handle, columns, trailing, source)
    finally:
        if was_enabled:
            gc.enable()


def _row_values(fields: list[str], cols: tuple, source: str, line: int) -> tuple[int, int, int, int | None, int]:
    """(start, end, size, addr, stream) of a row, with messages naming the bad field."""
    i_start, i_end, i_size, i_addr, i_stream = cols
    start = parse_int(fields[i_start], "start_time_stamp", source=source, line=line)
    end = parse_int(fields[i_end], "end_time_stamp", source=source, line=line)
    size = parse_int(fields[i_size], "size", source=source, line=line, non_negative=True)
    addr = parse_address(fields[i_addr], source=source, line=line)
    stream = (parse_int(fields[i_stream], "stream_id", source=source, line=line)
              if i_stream is not None and fields[i_stream].strip() else 0)
    return start, end, size, addr, stream


def _read_rows_fast(handle, columns: list[str], trailing: bool, source: str) -> Trace:
    index = {name: i for i, name in enumerate(columns)}
    free_text = index.get(_FREE_TEXT_COLUMN)
    i_start, i_end = index["start_time_stamp"], index["end_time_stamp"]
    i_addr, i_size = index["device_addr"], index["size"]
    i_stream, i_type = index.get("stream_id"), index.get("type")
    i_persistent, i_pool = index.get("is_persistent"), index.get("pool_type")
    cols = (i_start, i_end, i_size, i_addr, i_stream)
    width = len(columns) + (1 if trailing else 0)

    keys: list[int] = []
    events: list[Event] = []
    rows = never_freed = inner_rows = inner_bytes = unknown_end = 0
    pools: set[str] = set()
    last_pool = None
    for line, text in _records(handle, source, len(columns)):
        fields = text.split(",")
        if len(fields) == width and (not trailing or fields[-1] == ""):
            if trailing:
                fields.pop()
        else:
            fields = _split_row(text, columns, free_text, trailing, source, line)
        rows += 1
        if rows > MAX_EVENTS_IN_MEMORY // 2:    # an alloc and a free a row, held whole to sort by time
            raise too_many_events(source)
        try:  # fast path; any doubt goes through the checks that name the field
            start, end, size = int(fields[i_start]), int(fields[i_end]), int(fields[i_size])
            addr = int(fields[i_addr], 0) or None
            stream = int(fields[i_stream]) if i_stream is not None else 0
            if size < 0 or addr is not None and addr < 0:
                raise ValueError
        except ValueError:
            start, end, size, addr, stream = _row_values(fields, cols, source, line)
        if start < 0:
            inner_rows += 1
            inner_bytes += size
            continue
        tag = (fields[i_type].strip() or None) if i_type is not None else None
        pool = None
        if i_persistent is not None and fields[i_persistent].strip() in ("1", "true", "True"):
            pool = "persistent"
        if i_pool is not None and fields[i_pool] != last_pool:
            last_pool = fields[i_pool]
            if last_pool.strip():
                pools.add(last_pool.strip())
        # sort key: time, then frees (0) before allocs (1), then row order
        keys.append(((start << 1) | 1) << 40 | rows)
        events.append(Event("alloc", rows, size, addr, stream, pool, start, tag, None))
        if end == NEVER_FREED:
            never_freed += 1
        elif end < 0:
            unknown_end += 1  # no free time recorded: treated like never freed
        elif end < start:
            raise InputError(f"end_time_stamp {end} is before start_time_stamp {start}", source=source, line=line)
        else:
            keys.append((end << 1) << 40 | rows)
            events.append(Event("free", rows, 0, addr, stream, None, end, None, None))
    order = sorted(range(len(keys)), key=keys.__getitem__)
    meta = {"rows": rows, "never_freed": never_freed, "somas_inner_rows": inner_rows,
            "somas_inner_bytes": inner_bytes, "unknown_end_rows": unknown_end, "pools": sorted(pools),
            "layout": "2.10" if "actual_used_memory" in index else "older", "time_unit": "logical"}
    return Trace([events[i] for i in order], source=source, format=FORMAT, meta=meta)

"""The Ascend profiler's SQLite export (``ascend_pytorch_profiler_N.db``): its memory tables as timelines.

``OP_MEMORY`` as ``operator_memory.csv`` but bytes and ns as integers and names as ``STRING_IDS``
ids (torch_npu's ``TableColumnsManager``); GE's rows there have no active totals and no stream.
``NPU_OP_MEM`` (msprof's) holds GE's allocate/release records with device addresses: when present
the GE component is read from it. ``MEMORY_RECORD`` as ``memory_record.csv``. Called by
:func:`ms_memopt.io.traces.ascend_profiler.read_ascend_profiler`; bad values are an
:class:`~ms_memopt.core.errors.InputError` naming the table and row.
"""
from __future__ import annotations

import os
import sqlite3
import stat
import urllib.parse
from pathlib import Path

from ms_memopt.core.errors import InputError
from ms_memopt.io.traces.ascend_profiler.timeline import (
    FRAMEWORK,
    GE,
    TORCH_NPU,
    WORKSPACE,
    OutOfOrder,
    RowMerge,
    Timeline,
    better_figures,
    check_held,
    new_timeline,
)
from ms_memopt.io.traces.fields import parse_int

__all__ = ["read_db", "read_db_modules", "read_db_steps"]


def read_db(path: Path, writer: str, record: dict) -> dict[str, Timeline]:
    """``OP_MEMORY`` (the framework's tensors) and ``NPU_OP_MEM`` (GE's records with addresses)."""
    db = _open_db(path)
    source = str(path)
    strings = _Strings(db)
    framework = FRAMEWORK[writer]
    timelines: dict[str, Timeline] = {}
    try:
        if not _has_table(db, "OP_MEMORY") and not _has_table(db, "NPU_OP_MEM"):
            tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
            raise InputError(f"no OP_MEMORY or NPU_OP_MEM table (tables: {', '.join(tables[:12]) or 'none'}); "
                             f"the profiler writes them with profile_memory=True", source=source)
        ge_from_op_mem = _has_table(db, "NPU_OP_MEM")
        if _has_table(db, "OP_MEMORY"):
            for sort in (False, True):
                try:
                    timelines = _db_op_memory(db, strings, writer, sort, skip_ge=ge_from_op_mem, source=source)
                    break
                except OutOfOrder:
                    continue
            if any(t.fig.allocated_max_diff for t in timelines.values()):
                for name, timeline in list(timelines.items()):
                    if timeline.fig.allocated_max_diff:
                        again = _db_op_memory(db, strings, writer, True, skip_ge=ge_from_op_mem, source=source,
                                              only=name, release_after={name: not timeline.release_after})[name]
                        if better_figures(again.fig, timeline.fig):
                            timelines[name] = again
        if ge_from_op_mem:
            timeline = _db_npu_op_mem(db, strings, writer, source)
            if timeline is not None:
                timelines[GE] = timeline
        record.update(_db_memory_record(db, strings, source))
    except sqlite3.Error as exc:
        raise InputError(f"SQLite error reading the memory tables: {exc}", source=source) from None
    finally:
        db.close()
    order = [framework] + sorted(n for n in timelines if n != framework)
    return {n: timelines[n] for n in order if n in timelines}


_OP_MEMORY_SQL = ("SELECT rowid, name, size, allocationTime, releaseTime, allocationTotalAllocated, "
                  "allocationTotalReserved, releaseTotalAllocated, releaseTotalReserved, streamPtr, "
                  "allocationTotalActive FROM OP_MEMORY")


def read_db_modules(path: Path) -> dict[str, int]:
    """Peak reserved bytes per CANN module of ``NPU_MODULE_MEM`` (names from ``ENUM_MODULE``), the
    modules that held any; empty without the table."""
    db = _open_db(path)
    try:
        if not _has_table(db, "NPU_MODULE_MEM"):
            return {}
        names = dict(db.execute("SELECT id, name FROM ENUM_MODULE")) if _has_table(db, "ENUM_MODULE") else {}
        peaks = {}
        for module, peak in db.execute("SELECT moduleId, max(totalReserved) FROM NPU_MODULE_MEM GROUP BY moduleId"):
            value = _db_int(peak, "totalReserved", str(path), f"NPU_MODULE_MEM module {module}",
                            non_negative=True)
            if value:
                peaks[str(names.get(module, module))] = value
        return dict(sorted(peaks.items()))
    except sqlite3.Error as exc:
        raise InputError(f"SQLite error reading NPU_MODULE_MEM: {exc}", source=str(path)) from None
    finally:
        db.close()


def _db_op_memory(db, strings, writer, sort, *, skip_ge, source, only=None, release_after=None):
    framework = FRAMEWORK[writer]
    sql = _OP_MEMORY_SQL + (" ORDER BY allocationTime IS NOT NULL, allocationTime, rowid" if sort else " ORDER BY rowid")
    timelines: dict[str, Timeline] = {}
    merges: dict[str, RowMerge] = {}
    streams: dict[str, dict] = {}
    for rowid, name, size, at, rt, aa, ar, ra, rr, stream, active in db.execute(sql):
        where = f"OP_MEMORY row {rowid}"
        # GE's rows carry no active totals and no stream (torch_npu's MemoryDbParser)
        comp = GE if (active is None and stream is None and aa is not None) else framework
        if comp == framework and writer == TORCH_NPU and ar == 0 and (aa or 0) > 0:
            comp = WORKSPACE        # the workspace allocator's rows (reserved not reported), as in the text export
        if comp == GE and skip_ge:
            continue
        if only is not None and comp != only:
            continue
        size = _db_int(size, "size", source, where)
        if size is None or size < 0:
            raise InputError(f"size: expected a non-negative integer, got {size!r}", source=source, key=where)
        row = (_db_int(at, "allocationTime", source, where), _db_int(rt, "releaseTime", source, where), size,
               _db_int(aa, "allocationTotalAllocated", source, where, non_negative=True),
               _db_int(ar, "allocationTotalReserved", source, where, non_negative=True),
               _db_int(ra, "releaseTotalAllocated", source, where, non_negative=True),
               _db_int(rr, "releaseTotalReserved", source, where, non_negative=True),
               rowid, strings(name), None)
        merge = merges.get(comp)
        if merge is None:
            timelines[comp] = new_timeline(comp, writer, (release_after or {}).get(comp))
            merge = merges[comp] = RowMerge(timelines[comp], source)
            streams[comp] = {}
        ids = streams[comp]
        merge.push(row + (ids.setdefault(stream, len(ids)),))
    for comp, merge in merges.items():
        merge.finish()
        timelines[comp].fig.unsorted = sort
    return timelines


def _db_npu_op_mem(db, strings, writer, source) -> Timeline | None:
    """GE's allocate/release records (``NPU_OP_MEM``, time-sorted) with their device addresses."""
    timeline = new_timeline(GE, writer)
    open_ids: dict[tuple, int] = {}
    sizes: dict[int, int] = {}
    any_rows = False
    pending: list[tuple] = []
    for rowid, name, addr, kind, size, time, total, reserved in db.execute(
            "SELECT rowid, operatorName, addr, type, size, timestampNs, totalAllocate, totalReserve FROM NPU_OP_MEM "
            "ORDER BY timestampNs, rowid"):
        any_rows = True
        if len(pending) & 0xFFF == 0:
            check_held(len(pending), source)
        where = f"NPU_OP_MEM row {rowid}"
        kind_name = strings(kind)
        size = _db_int(size, "size", source, where)
        time = _db_int(time, "timestampNs", source, where)
        addr = _db_int(addr, "addr", source, where)
        if size is None or time is None:
            raise InputError("size and timestampNs must be integers", source=source, key=where)
        size = abs(size)
        total = _db_int(total, "totalAllocate", source, where, non_negative=True)
        reserved = _db_int(reserved, "totalReserve", source, where, non_negative=True)
        op = strings(name)
        key = (op, addr)
        if kind_name == "allocate":
            timeline.fig.rows += 1
            open_ids[key] = rowid
            sizes[rowid] = size
            pending.append((time, 1, rowid, size, total, reserved, rowid, op, addr, 0))
        elif kind_name == "release":
            ident = open_ids.pop(key, None)
            if ident is None:
                # released in the capture, allocated before it: a tensor of the initial state
                ident = rowid
                timeline.add_initial(ident, size, op)
                timeline.fig.rows += 1
            pending.append((time, 0, ident, size, total, reserved, rowid, op, addr, 0))
        else:
            raise InputError(f"type {kind_name!r}: expected allocate or release", source=source, key=where)
    if not any_rows:
        return None
    for item in pending:
        timeline.feed(item)
    timeline.finish()
    return timeline


def _db_memory_record(db, strings, source) -> dict[str, dict]:
    if not _has_table(db, "MEMORY_RECORD"):
        return {}
    series: dict[str, dict] = {}
    for rowid, component, time, allocated, reserved in db.execute(
            "SELECT rowid, component, timestamp, totalAllocated, totalReserved FROM MEMORY_RECORD ORDER BY rowid"):
        where = f"MEMORY_RECORD row {rowid}"
        name = strings(component) or "?"
        entry = series.setdefault(name, {"rows": 0, "peak_allocated": None, "peak_reserved": None, "points": []})
        entry["rows"] += 1
        a = _db_int(allocated, "totalAllocated", source, where, non_negative=True)
        r = _db_int(reserved, "totalReserved", source, where, non_negative=True)
        if a is not None and (entry["peak_allocated"] is None or a > entry["peak_allocated"]):
            entry["peak_allocated"] = a
        if r is not None and (entry["peak_reserved"] is None or r > entry["peak_reserved"]):
            entry["peak_reserved"] = r
        entry["points"].append((_db_int(time, "timestamp", source, where), a, r, rowid))
        if len(entry["points"]) & 0xFFF == 0:
            check_held(len(entry["points"]), source)
    return series


class _Strings:
    """``STRING_IDS`` of a profiler db, looked up once per id."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.cache: dict[int, str] = {}
        self.has = _has_table(db, "STRING_IDS")

    def __call__(self, ident) -> str | None:
        if ident is None or not isinstance(ident, int):
            return None if ident is None else str(ident)
        if ident not in self.cache:
            value = None
            if self.has:
                got = self.db.execute("SELECT value FROM STRING_IDS WHERE id = ?", (ident,)).fetchone()
                value = got[0] if got else None
            self.cache[ident] = value if value is not None else str(ident)
        return self.cache[ident]


def _has_table(db: sqlite3.Connection, name: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None


#: the longest string or blob a query may make (names and ids are short; a generated column of
#: 300 MB in an 800 KB file took 6 GB): SQLite refuses longer ones ("string or blob too big")
MAX_CELL_BYTES = 1 << 20


def _open_db(path: Path) -> sqlite3.Connection:
    """The db opened read-only and ``immutable``: nothing is written beside it (``mode=ro`` alone still
    makes ``-wal`` and ``-shm`` files for a WAL db, and fails on a read-only mount). A FIFO or device
    is refused before SQLite opens it (it would wait forever)."""
    source = str(path)
    try:
        info = os.stat(path)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", source=source) from None
    if not stat.S_ISREG(info.st_mode):
        raise InputError("not a regular file (a FIFO, device or folder); expected an SQLite database "
                         "(ascend_*_profiler_N.db)", source=source)
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro&immutable=1"
    try:
        db = sqlite3.connect(uri, uri=True)
        db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_CELL_BYTES)
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.Error as exc:
        raise InputError(f"not a readable SQLite database ({exc})", source=source) from None
    return db


def _db_int(value, what: str, source: str, where: str, *, non_negative: bool = False) -> int | None:
    """An integer cell (None when NULL), within int64 (``non_negative``: a size or total, at least 0);
    the error names the file, the table and row, and the column."""
    if value is None or value == "":
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        value = parse_int(value, f"{where}: {what}", source=source)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: {what}: expected an integer, got {str(value)[:40]!r}", source=source)
    if not -_INT64 <= value < _INT64:
        raise InputError(f"{where}: {what}: expected an integer within int64, got {str(value)[:40]}", source=source)
    if non_negative and value < 0:
        raise InputError(f"{where}: {what}: expected a non-negative size, got {value}", source=source)
    return value


_INT64 = 1 << 63


def read_db_steps(path: Path) -> list[tuple[int, int, int]] | None:
    """The db's ``STEP_TIME`` rows ``(id, startNs, endNs)`` by start, the profiler's step markers
    (``ProfilerStep#id``); ``None`` when the table is absent. A NULL or negative cell is an
    :class:`InputError` naming the table and row."""
    db = _open_db(path)
    source = str(path)
    try:
        if not _has_table(db, "STEP_TIME"):
            return None
        out = []
        for rowid, ident, start, end in db.execute("SELECT rowid, id, startNs, endNs FROM STEP_TIME"):
            where = f"STEP_TIME row {rowid}"
            values = [_db_int(v, what, source, where, non_negative=True)
                      for v, what in ((ident, "id"), (start, "startNs"), (end, "endNs"))]
            if None in values:
                raise InputError(f"{where}: id, startNs and endNs must all be set", source=source)
            if values[2] < values[1]:
                raise InputError(f"{where}: endNs {values[2]} before startNs {values[1]}", source=source)
            out.append(tuple(values))
        return sorted(out, key=lambda r: (r[1], r[0]))
    except sqlite3.Error as exc:
        raise InputError(f"STEP_TIME: not readable ({exc})", source=source) from None
    finally:
        db.close()

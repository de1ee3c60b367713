"""Write events as the Ascend profiler writes its memory files (``replay --export-profiler``, tests, benchmarks).

:func:`write_profiler_output` lays out a rank's folder as torch_npu's or MindSpore's profiler
does, with ``operator_memory.csv`` and ``memory_record.csv`` in the writers' exact text format
(facts from their sources, docs/traces.md): torch_npu's times are ns printed as microseconds
with a trailing TAB, sizes ``bytes / 1024.0``, totals ``bytes / 1024.0**2``, empty fields empty;
MindSpore 2.10's times are ``ns / 1000`` floats, empty fields ``N/A``, and its memory_record's
"MB" is KB / 1000. Rows come sorted by allocation time, as both writers sort them (``shuffle``
scrambles them); a tensor allocated before the capture (``initial``) has no row and its release
shows only in the totals, as in the real files.

The pool's totals are ``totals`` when given (an allocator model's allocated and reserved bytes after
each event, what ``replay --export-profiler`` writes), else those of an allocator holding exactly the
live blocks with a synthetic reserved high-water mark (allocated rounded up to 2 MiB, never shrinking).
With ``operators``, ``trace_view.json`` also holds a ``cpu_op`` span around each run of allocations of
one name (the operator msprof-analyze's ``compare`` charges their memory to), and with ``db`` the same
data goes to ``ascend_pytorch_profiler_N.db`` in the profiler's schema (:func:`write_db`).

Example:
    >>> import tempfile
    >>> from ms_memopt.core.events import Event
    >>> folder = write_profiler_output(tempfile.mkdtemp(), [Event("alloc", id=1, size=512, time=1000),
    ...                                                       Event("free", id=1, time=2500)])
    >>> (folder / "ASCEND_PROFILER_OUTPUT" / "operator_memory.csv").read_text().splitlines()[1]
    'aten::empty,0.5,1.000\\t,2.500\\t,2.500\\t,1.500\\t,1.500\\t,0.00048828125,2.0,0.00048828125,0.0,2.0,0.0,1,NPU:0'
"""
from __future__ import annotations

import csv
import json
import os
import random
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from ms_memopt.core.events import Event

__all__ = ["ENUM_API_TYPE", "us_text", "write_db", "write_profiler_output"]

_KB, _MB = 1024.0, 1024.0 ** 2
_RESERVE_STEP = 2 << 20
#: torch_npu's ``ENUM_API_TYPE`` (id, name) as its db export holds it; ``PYTORCH_API.type`` of an operator is ``op``
ENUM_API_TYPE = ((5000, "runtime"), (5500, "hccl"), (10000, "node"), (15000, "model"), (20000, "acl"),
                 (50001, "op"), (50002, "queue"), (50003, "trace"), (50004, "mstx"))


def us_text(ns: int, tail: str = "\t") -> str:
    """torch_npu's ``convert_ns2us_str``: integer ns as microseconds with 3 decimals, plus ``tail``.

    Example:
        >>> us_text(1736408883694624810)
        '1736408883694624.810\\t'
    """
    digits = str(ns)
    if len(digits) <= 3:
        return "0." + digits.rjust(3, "0") + tail
    return digits[:-3] + "." + digits[-3:] + tail


def write_profiler_output(directory: str | Path, events: Iterable[Event], *, writer: str = "torch_npu",
                          rank: int = 0, initial: dict[int, int] | None = None, line_end: str = "\r\n",
                          shuffle: int | None = None, name: str = "aten::empty", ge: Iterable[Event] = (),
                          alloc_conf: str = "", steps: Iterable[tuple[int, int, int]] = (),
                          step_trace: bool = True, totals: Iterable[tuple[int, int]] | None = None,
                          operators: bool = False, db: bool = False) -> Path:
    """Write a rank's profiler folder for ``events`` (alloc/free with ``time`` in ns); return the folder.

    Args:
        directory: where the rank's folder ``rank{rank}_ascend_pt`` (``_ascend_ms``) is made.
        events: the framework pool's events; ``tag`` names the operator (else ``name``).
        writer: ``"torch_npu"`` or ``"mindspore"``.
        initial: id -> bytes of tensors allocated before the capture (their frees may be in ``events``).
        line_end: ``"\\r\\n"`` (Python's csv default, what both writers produce) or ``"\\n"``.
        shuffle: a seed to scramble the rows (files whose rows are not in time order).
        ge: the graph engine's events (torch_npu only): ``cann::`` rows, totals before each release.
        alloc_conf: ``PYTORCH_NPU_ALLOC_CONF`` as ``profiler_metadata.json`` records it.
        steps: the step markers ``(number, start ns, end ns)``: ``ProfilerStep#N`` events in
            ``trace_view.json`` as the writer writes them (torch_npu: ``ts`` a string of
            ``convert_ns2us_str``, ``dur`` a float; MindSpore: both strings of a ``Decimal``)
            and, with ``step_trace``, a ``step_trace_time.csv`` of their numbers.
        totals: the pool's (allocated, reserved) bytes after each of ``events``, in order (else made up).
        operators: ``cpu_op`` spans in ``trace_view.json`` around each run of allocations of one name.
        db: also write ``ascend_pytorch_profiler_{rank}.db`` (torch_npu only).
    """
    if writer not in ("torch_npu", "mindspore"):
        raise ValueError(f"writer must be torch_npu or mindspore, not {writer!r}")
    torch = writer == "torch_npu"
    folder = Path(directory) / f"rank{rank}_ascend_{'pt' if torch else 'ms'}"
    out = folder / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True, exist_ok=True)
    if db and not torch:
        raise ValueError("db: only torch_npu's db export is written")
    rows, records = _rows(events, initial or {}, name, release_after=True, totals=totals)
    if torch:
        ge_rows, ge_records = _rows(ge, {}, name, release_after=False)
    else:
        ge_rows, ge_records = [], []
    rows.sort(key=lambda r: r[0])
    ge_rows.sort(key=lambda r: r[0])
    table = [_cells(r, torch, False) for r in rows] + [_cells(r, torch, True) for r in ge_rows]
    if shuffle is not None:
        random.Random(shuffle).shuffle(table)
    header = ["Name", "Size(KB)", "Allocation Time(us)", "Release Time(us)", "Active Release Time(us)",
              "Duration(us)", "Active Duration(us)", "Allocation Total Allocated(MB)",
              "Allocation Total Reserved(MB)", "Allocation Total Active(MB)", "Release Total Allocated(MB)",
              "Release Total Reserved(MB)", "Release Total Active(MB)", "Stream Ptr", "Device Type"]
    _write(out / "operator_memory.csv", header, table, line_end)
    component = "PTA" if torch else "MindSpore"
    record_header = ["Component", "Timestamp(us)", "Total Allocated(MB)", "Total Reserved(MB)", "Total Active(MB)"]
    record_header += ["Stream Ptr", "Device Type"] if torch else ["Device Type"]
    record_rows = []
    for time, allocated, reserved in sorted(records, key=lambda r: r[0]):
        if torch:
            record_rows.append([component, us_text(time), allocated / _MB, reserved / _MB, allocated / _MB, 1, "NPU:0"])
        else:
            record_rows.append([component, time / 1000, allocated / 1024 / 1000, reserved / 1024 / 1000,
                                allocated / 1024 / 1000, "NPU:0"])
    for time, allocated, reserved in sorted(ge_records, key=lambda r: r[0]):
        record_rows.append(["GE", us_text(time), allocated / _MB, reserved / _MB, None, None, "NPU:0"])
    _write(out / "memory_record.csv", record_header, record_rows, line_end)
    steps = list(steps)
    spans = operator_spans(rows) if operators else []
    if steps or spans:
        _write_steps(out, steps, torch, line_end, step_trace, spans)
    if db:
        write_db(out / f"ascend_pytorch_profiler_{rank}.db", rows, records, steps=steps, spans=spans,
                 alloc_conf=alloc_conf, rank=rank)
    if torch:
        info = {"config": {"common_config": {"profile_memory": True},
                           "experimental_config": {"_export_type": "text"}}, "rank_id": rank}
        (folder / "profiler_metadata.json").write_text(json.dumps(
            {"ENV_VARIABLES": {"PYTORCH_NPU_ALLOC_CONF": alloc_conf}}, indent=4))
    else:
        info = {"profiler_parameters": {"profile_memory": True}, "ms_version": "2.10.0"}
    (folder / f"profiler_info_{rank}.json").write_text(json.dumps(info, indent=4))
    return folder


def operator_spans(rows: list[tuple]) -> list[tuple[str, int, int]]:
    """``(name, start ns, end ns)`` around each run of consecutive allocations (rows sorted by
    allocation time, as :func:`_rows` gives them) of one operator name.

    Example:
        >>> operator_spans([(10, 512, "a", 0, 0, None), (15, 512, "a", 0, 0, None), (20, 512, "b", 0, 0, None)])
        [('a', 10, 15), ('b', 20, 20)]
    """
    spans: list[list] = []
    for at, _size, name, *_ in rows:
        if spans and spans[-1][0] == name:
            spans[-1][2] = at
        else:
            spans.append([name, at, at])
    return [tuple(span) for span in spans]


def _write_steps(out: Path, steps: list[tuple[int, int, int]], torch: bool, line_end: str, step_trace: bool,
                 spans: list[tuple[str, int, int]] = ()) -> None:
    """``trace_view.json`` with one ``ProfilerStep#N`` event per step (and a process name event,
    as the writers put first), an operator's ``cpu_op`` event per span (1 us at least: the file's
    unit), and ``step_trace_time.csv`` (its ``Step`` column and durations)."""
    trace = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "Python" if torch else "MindSpore"}}]
    marks = [(f"ProfilerStep#{number}", start, end) for number, start, end in steps]
    for name, start, end in marks + [(name, start, max(end, start + 1000)) for name, start, end in spans]:
        if torch:
            ts, dur = us_text(start, ""), (end - start) / 1000
        else:
            ts, dur = us_text(start, ""), us_text(end - start, "")
        trace.append({"ph": "X", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                      "cat": "cpu_op" if torch else "MindSpore", "args": {}})
    (out / "trace_view.json").write_text(json.dumps(trace))
    if step_trace and steps:
        header = ["Step", "Computing", "Communication(Not Overlapped)", "Overlapped", "Communication", "Free",
                  "Stage", "Bubble", "Communication(Not Overlapped and Exclude Receive)", "Preparing"]
        rows = [[number, (end - start) / 1000, 0, 0, 0, 0, 0, 0, 0, 0] for number, start, end in steps]
        _write(out / "step_trace_time.csv", header, rows, line_end)


def _rows(events: Iterable[Event], initial: dict[int, int], default_name: str, *, release_after: bool,
          totals: Iterable[tuple[int, int]] | None = None) -> tuple[list, list]:
    """Rows ``(alloc ns, bytes, name, allocated, reserved, (release ns, allocated, reserved) or None)``
    and memory records (ns, allocated, reserved) of one pool; ``totals``: its figures after each event."""
    sizes = dict(initial)
    allocated = sum(initial.values())
    reserved = -(-allocated // _RESERVE_STEP) * _RESERVE_STEP
    given = iter(totals) if totals is not None else None
    open_rows: dict[int, list] = {}
    rows, records = [], []
    for event in events:
        if given is not None:
            before = allocated
            allocated, reserved = next(given)
        if event.action == "alloc":
            sizes[event.id] = event.size
            if given is None:
                allocated += event.size
                reserved = max(reserved, -(-allocated // _RESERVE_STEP) * _RESERVE_STEP)
            open_rows[event.id] = [event.time, event.size, event.tag or default_name, allocated, reserved, None]
            records.append((event.time, allocated, reserved))
        elif event.action == "free" and event.id in sizes:
            size = sizes.pop(event.id)
            if given is None:
                before = allocated
                allocated -= size
            row = open_rows.pop(event.id, None)
            if row is not None:
                row[5] = (event.time, before if not release_after else allocated, reserved)
                rows.append(tuple(row))
            records.append((event.time, before if not release_after else allocated, reserved))
    rows += [tuple(row) for row in open_rows.values()]
    return rows, records


def _cells(row: tuple, torch: bool, ge: bool) -> list:
    at, size, name, a_total, a_res, release = row
    if torch:
        rt = rel_total = rel_res = duration = None
        if release is not None:
            rt, rel_total, rel_res = us_text(release[0]), release[1] / _MB, release[2] / _MB
            duration = us_text(release[0] - at)
        if ge:
            # CANN's rows: no active figures, no stream (torch_npu's GeOpMemoryBean)
            return ["cann::" + name, size / _KB, us_text(at), rt, None, duration and duration.rstrip("\t"), None,
                    a_total / _MB, a_res / _MB, None, rel_total, rel_res, None, None, "NPU:0"]
        return [name, size / _KB, us_text(at), rt, rt, duration, duration, a_total / _MB, a_res / _MB, a_total / _MB,
                rel_total, rel_res, rel_total, 1, "NPU:0"]
    na = "N/A"
    if release is None:
        return [name, size / 1024, at / 1000, na, na, na, na, a_total / _MB, a_res / _MB, a_total / _MB, na, na, na, 1,
                "NPU:0"]
    return [name, size / 1024, at / 1000, release[0] / 1000, na, (release[0] - at) / 1000, na, a_total / _MB,
            a_res / _MB, a_total / _MB, release[1] / _MB, release[2] / _MB, release[1] / _MB, 1, "NPU:0"]


def write_db(path: str | Path, rows: list[tuple], records: list[tuple[int, int, int]], *,
             steps: Iterable[tuple[int, int, int]] = (), spans: Iterable[tuple[str, int, int]] = (),
             alloc_conf: str = "", rank: int = 0) -> Path:
    """torch_npu's db export of one pool: ``OP_MEMORY`` and ``MEMORY_RECORD`` (bytes and ns as
    integers, names as ``STRING_IDS`` ids; component ``PTA``), ``PYTORCH_API`` (the operators'
    ``spans``, ``type`` the ``op`` of ``ENUM_API_TYPE``, times as text as the profiler writes them),
    ``STEP_TIME``, and the ``CONNECTION_IDS``, ``TASK`` (empty: no device task is modelled),
    ``META_DATA``, ``RANK_DEVICE_MAP`` and ``SESSION_TIME_INFO`` a reader joins or looks up
    (docs/traces.md). ``rows`` and ``records``
    as :func:`_rows` makes them. Refuses a file already there (``FileExistsError``).

    Example:
        >>> import os, tempfile
        >>> path = write_db(os.path.join(tempfile.mkdtemp(), "ascend_pytorch_profiler_0.db"),
        ...                 [(1000, 512, "aten::empty", 512, 2 << 20, None)], [(1000, 512, 2 << 20)])
        >>> sqlite3.connect(path).execute("SELECT size, allocationTotalReserved FROM OP_MEMORY").fetchall()
        [(512, 2097152)]
    """
    path = Path(path)
    if os.path.lexists(path):
        raise FileExistsError(path)
    strings: dict[str, int] = {}

    def ident(text: str) -> int:
        return strings.setdefault(text, len(strings))

    steps, spans = list(steps), list(spans)
    op_rows = []
    for at, size, name, a_total, a_res, release in rows:
        rt, r_total, r_res = release if release is not None else (None, None, None)
        duration = None if rt is None else rt - at
        op_rows.append((ident(name), size, at, rt, rt, duration, duration, a_total, a_res, a_total,
                        r_total, r_res, r_total, 1, rank))
    pta = ident("PTA")
    api = [(str(start), str(max(end, start + 1000)), 1, None, ident(name), None, None, None, None, None, 50001, 0)
           for name, start, end in [(f"ProfilerStep#{n}", start, end) for n, start, end in steps] + spans]
    times = [row[0] for row in rows] + [r[0] for r in records] + [s[1] for s in steps]
    schema = (
        ("STRING_IDS", "id INTEGER PRIMARY KEY,value TEXT", [(v, k) for k, v in strings.items()]),
        ("ENUM_API_TYPE", "id INTEGER PRIMARY KEY,name TEXT", list(ENUM_API_TYPE)),
        ("OP_MEMORY", "name INTEGER, size INTEGER, allocationTime INTEGER, releaseTime INTEGER, "
                      "activeReleaseTime INTEGER, duration INTEGER, activeDuration INTEGER, "
                      "allocationTotalAllocated INTEGER, allocationTotalReserved INTEGER, allocationTotalActive INTEGER, "
                      "releaseTotalAllocated INTEGER, releaseTotalReserved INTEGER, releaseTotalActive INTEGER, "
                      "streamPtr INTEGER, deviceId INTEGER", op_rows),
        ("MEMORY_RECORD", "component INTEGER, timestamp INTEGER, totalAllocated INTEGER, totalReserved INTEGER, "
                          "totalActive INTEGER, streamPtr INTEGER, deviceId INTEGER",
         [(pta, t, a, r, a, 1, rank) for t, a, r in sorted(records, key=lambda r: r[0])]),
        ("PYTORCH_API", "startNs TEXT, endNs TEXT, globalTid INTEGER, connectionId INTEGER, name INTEGER, "
                        "sequenceNumber INTEGER, fwdThreadId INTEGER, inputDtypes INTEGER, inputShapes INTEGER, "
                        "callchainId INTEGER, type INTEGER, depth integer", api),
        ("CONNECTION_IDS", "id INTEGER, connectionId INTEGER", []),
        ("TASK", "startNs INTEGER,endNs INTEGER,deviceId INTEGER,connectionId INTEGER,globalTaskId INTEGER,"
                 "globalPid INTEGER,taskType INTEGER,contextId INTEGER,streamId INTEGER,taskId INTEGER,"
                 "modelId INTEGER, depth integer", []),
        ("STEP_TIME", "id INTEGER, startNs INTEGER, endNs INTEGER", steps),
        ("META_DATA", "name TEXT,value TEXT", [("SCHEMA_VERSION", "1.0.0"), ("ENV_VARIABLES", json.dumps(
            {"PYTORCH_NPU_ALLOC_CONF": alloc_conf}))]),
        ("RANK_DEVICE_MAP", "rankId INTEGER, deviceId INTEGER", [(rank, rank)]),
        ("SESSION_TIME_INFO", "startTimeNs INTEGER,endTimeNs INTEGER",
         [(min(times), max(times))] if times else []),
    )
    db = sqlite3.connect(path)
    try:
        with db:
            for table, columns, values in schema:
                db.execute(f"CREATE TABLE {table} ({columns})")
                if values:
                    marks = ",".join("?" * len(values[0]))
                    db.executemany(f"INSERT INTO {table} VALUES ({marks})", values)
    finally:
        db.close()
    return path


def _write(path: Path, header: list, rows: list, line_end: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        out = csv.writer(handle, lineterminator=line_end)
        out.writerow(header)
        out.writerows(rows)

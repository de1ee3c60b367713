"""Write events as the Ascend profiler writes its memory files (for tests and benchmarks).

:func:`write_profiler_output` lays out a rank's folder as torch_npu's or MindSpore's profiler
does, with ``operator_memory.csv`` and ``memory_record.csv`` in the writers' exact text format
(facts from their sources, docs/traces.md): torch_npu's times are ns printed as microseconds
with a trailing TAB, sizes ``bytes / 1024.0``, totals ``bytes / 1024.0**2``, empty fields empty;
MindSpore 2.10's times are ``ns / 1000`` floats, empty fields ``N/A``, and its memory_record's
"MB" is KB / 1000. Rows come sorted by allocation time, as both writers sort them (``shuffle``
scrambles them); a tensor allocated before the capture (``initial``) has no row and its release
shows only in the totals, as in the real files.

The pool's totals are those of an allocator holding exactly the live blocks; reserved is a
synthetic high-water mark (allocated rounded up to 2 MiB, never shrinking).

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
import random
from collections.abc import Iterable
from pathlib import Path

from ms_memopt.core.events import Event

__all__ = ["us_text", "write_profiler_output"]

_KB, _MB = 1024.0, 1024.0 ** 2
_RESERVE_STEP = 2 << 20


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
                          step_trace: bool = True) -> Path:
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
    """
    if writer not in ("torch_npu", "mindspore"):
        raise ValueError(f"writer must be torch_npu or mindspore, not {writer!r}")
    torch = writer == "torch_npu"
    folder = Path(directory) / f"rank{rank}_ascend_{'pt' if torch else 'ms'}"
    out = folder / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True, exist_ok=True)
    rows, records = _rows(events, initial or {}, torch, name, release_after=True)
    if torch:
        ge_rows, ge_records = _rows(ge, {}, torch, name, release_after=False, ge=True)
    else:
        ge_rows, ge_records = [], []
    rows.sort(key=lambda r: r[0])
    ge_rows.sort(key=lambda r: r[0])
    table = [r[1] for r in rows] + [r[1] for r in ge_rows]
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
    if steps:
        _write_steps(out, steps, torch, line_end, step_trace)
    if torch:
        info = {"config": {"common_config": {"profile_memory": True},
                           "experimental_config": {"_export_type": "text"}}, "rank_id": rank}
        (folder / "profiler_metadata.json").write_text(json.dumps(
            {"ENV_VARIABLES": {"PYTORCH_NPU_ALLOC_CONF": alloc_conf}}, indent=4))
    else:
        info = {"profiler_parameters": {"profile_memory": True}, "ms_version": "2.10.0"}
    (folder / f"profiler_info_{rank}.json").write_text(json.dumps(info, indent=4))
    return folder


def _write_steps(out: Path, steps: list[tuple[int, int, int]], torch: bool, line_end: str, step_trace: bool) -> None:
    """``trace_view.json`` with one ``ProfilerStep#N`` event per step (and a process name event,
    as the writers put first), and ``step_trace_time.csv`` (its ``Step`` column and durations)."""
    trace = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "Python" if torch else "MindSpore"}}]
    for number, start, end in steps:
        if torch:
            ts, dur = us_text(start, ""), (end - start) / 1000
        else:
            ts, dur = us_text(start, ""), us_text(end - start, "")
        trace.append({"ph": "X", "name": f"ProfilerStep#{number}", "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                      "cat": "cpu_op" if torch else "MindSpore", "args": {}})
    (out / "trace_view.json").write_text(json.dumps(trace))
    if step_trace:
        header = ["Step", "Computing", "Communication(Not Overlapped)", "Overlapped", "Communication", "Free",
                  "Stage", "Bubble", "Communication(Not Overlapped and Exclude Receive)", "Preparing"]
        rows = [[number, (end - start) / 1000, 0, 0, 0, 0, 0, 0, 0, 0] for number, start, end in steps]
        _write(out / "step_trace_time.csv", header, rows, line_end)


def _rows(events: Iterable[Event], initial: dict[int, int], torch: bool, default_name: str, *,
          release_after: bool, ge: bool = False) -> tuple[list, list]:
    """Rows (alloc time, cells) and memory records (time, allocated, reserved) of one pool."""
    sizes = dict(initial)
    allocated = sum(initial.values())
    reserved = -(-allocated // _RESERVE_STEP) * _RESERVE_STEP
    open_rows: dict[int, list] = {}
    rows, records = [], []
    for event in events:
        if event.action == "alloc":
            sizes[event.id] = event.size
            allocated += event.size
            reserved = max(reserved, -(-allocated // _RESERVE_STEP) * _RESERVE_STEP)
            open_rows[event.id] = [event.time, event.size, event.tag or default_name, allocated, reserved, None]
            records.append((event.time, allocated, reserved))
        elif event.action == "free" and event.id in sizes:
            size = sizes.pop(event.id)
            before = allocated
            allocated -= size
            row = open_rows.pop(event.id, None)
            if row is not None:
                row[5] = (event.time, before if not release_after else allocated, reserved)
                rows.append((row[0], _cells(row, torch, ge)))
            records.append((event.time, before if not release_after else allocated, reserved))
    for row in open_rows.values():
        rows.append((row[0], _cells(row, torch, ge)))
    return rows, records


def _cells(row: list, torch: bool, ge: bool) -> list:
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


def _write(path: Path, header: list, rows: list, line_end: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        out = csv.writer(handle, lineterminator=line_end)
        out.writerow(header)
        out.writerows(rows)

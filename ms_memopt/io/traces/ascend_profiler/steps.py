"""The Ascend profiler's own step markers: where each captured training step starts and ends.

Both profilers mark a step by a ``RecordFunction`` named ``ProfilerStep#N`` (``prof.step()``;
torch_npu's ``profiler.py``, MindSpore 2.10's ``ProfilerStepNameConstant.PROFILER_STEP``) and
write it in three places (docs/traces.md, "Steps"):

* ``trace_view.json``, the Chrome trace (a JSON array): an ``"X"`` event
  ``{"ph": "X", "name": "ProfilerStep#N", "ts": ..., "dur": ...}``, ``ts`` and ``dur`` in us:
  torch_npu writes ``ts`` as the string ``convert_ns2us_str(ns)`` (``"1736408883694624.810"``) and
  ``dur`` as a float, MindSpore both as strings of a ``Decimal`` (``MsprofCompleteEvent``'s
  ``to_trace_format``);
* the db's ``STEP_TIME`` table (``id, startNs, endNs``, integers);
* ``step_trace_time.csv``: a ``Step`` column of the step numbers beside durations, no start time
  (so it numbers the steps but cannot place them).

:func:`trace_view_steps` scans ``trace_view.json`` for the markers without parsing the whole file
(it holds every operator and is often hundreds of MB); :func:`step_trace_numbers` reads the step
numbers of ``step_trace_time.csv``.

Example:
    >>> import json, pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "trace_view.json"
    >>> _ = path.write_text(json.dumps([{"ph": "X", "name": "ProfilerStep#7", "pid": 1, "tid": 1,
    ...                                  "ts": "1000.500", "dur": 2.25, "args": {}}]))
    >>> trace_view_steps(path)
    [StepMark(number=7, start=1000500, end=1002750)]
"""
from __future__ import annotations

import csv
import json
import mmap
import os
import re
import stat
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from ms_memopt.core.errors import InputError

__all__ = ["STEP_PREFIX", "STEP_TRACE_TIME", "TRACE_VIEW", "StepMark", "StepMarks", "step_trace_numbers",
           "trace_view_steps", "us_to_ns"]

#: the name prefix both profilers give a step's RecordFunction
STEP_PREFIX = "ProfilerStep#"
TRACE_VIEW = "trace_view.json"
STEP_TRACE_TIME = "step_trace_time.csv"

_MARKER = re.compile(rb'"name"\s*:\s*"ProfilerStep#(\d{1,18})"')
_OBJECT_WINDOW = 1 << 16        # bytes read around a marker: its event object is far smaller
_NS_LIMIT = 1 << 63


@dataclass(frozen=True)
class StepMark:
    """One captured step: its number (``ProfilerStep#N``) and its start and end, in ns."""

    number: int
    start: int
    end: int


@dataclass
class StepMarks:
    """A capture's steps (by start time) and where they were read: ``source`` is ``"STEP_TIME"``,
    ``"trace_view.json"`` or ``None`` (no marker); ``notes`` say what else was found."""

    steps: list[StepMark]
    source: str | None
    notes: list[str]


def us_to_ns(value, what: str, source: str, where: str) -> int:
    """A time in microseconds (a string such as ``"1736408883694624.810"`` or a number) as integer ns.

    Example:
        >>> us_to_ns("1736408883694624.810", "ts", "f", "x"), us_to_ns(2.25, "dur", "f", "x")
        (1736408883694624810, 2250)
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or \
            (isinstance(value, str) and (len(value) > 64 or not value.strip().isascii())):
        raise InputError(f"{where}: {what}: expected a time in microseconds, got {str(value)[:40]!r}", source=source)
    try:
        ns = Decimal(str(value).strip()) * 1000
    except InvalidOperation:
        raise InputError(f"{where}: {what}: expected a time in microseconds, got {str(value)[:40]!r}",
                         source=source) from None
    if not ns.is_finite() or not 0 <= ns < _NS_LIMIT:
        raise InputError(f"{where}: {what}: expected a time within int64 ns, got {str(value)[:40]!r}", source=source)
    return int(ns.to_integral_value())


def trace_view_steps(path: str | Path) -> list[StepMark]:
    """The ``ProfilerStep#N`` events of a ``trace_view.json``, by start time.

    Raises:
        InputError: the file cannot be read, or a marker's event is not a JSON object with
            ``ts`` and ``dur`` in microseconds (the message names the file and the line).
    """
    source = str(path)
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise InputError("not a regular file (a FIFO, device or folder); expected the profiler's "
                             f"{TRACE_VIEW}", source=source)
        if info.st_size == 0:
            return []
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return sorted(_marks(data, source), key=lambda m: (m.start, m.number))
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", source=source) from None


def _marks(data: mmap.mmap, source: str) -> list[StepMark]:
    out: dict[int, StepMark] = {}
    decoder = json.JSONDecoder()
    for match in _MARKER.finditer(data):
        begin = data.rfind(b"{", max(0, match.start() - _OBJECT_WINDOW), match.start())
        line = data[:match.start()].count(b"\n") + 1 if begin < 0 else None
        where = f"the {match.group().decode()} event"
        if begin < 0:
            raise InputError(f"{where} is not inside a JSON object", source=source, line=line)
        window = data[begin:begin + _OBJECT_WINDOW].decode("utf-8", errors="replace")
        try:
            event, _ = decoder.raw_decode(window)
        except (json.JSONDecodeError, RecursionError, ValueError):
            event = None
        if not isinstance(event, dict) or "ts" not in event or "dur" not in event:
            line = data[:match.start()].count(b"\n") + 1
            raise InputError(f"{where} is not a JSON object with ts and dur (microseconds)", source=source, line=line)
        if event.get("ph", "X") != "X":
            continue
        number = int(match.group(1))
        start = us_to_ns(event["ts"], "ts", source, where)
        end = start + us_to_ns(event["dur"], "dur", source, where)
        out.setdefault(number, StepMark(number, start, end))      # a marker written twice counts once
    return list(out.values())


def step_trace_numbers(path: str | Path) -> list[int]:
    """The step numbers of a ``step_trace_time.csv`` (its ``Step`` column; rows of other
    numbering, such as a pipeline stage's totals, skipped).

    Raises:
        InputError: no ``Step`` column (names the file and line 1).
    """
    from ms_memopt.core.lines import open_input

    source = str(path)
    numbers: list[int] = []
    with open_input(path, expected=f"the profiler's {STEP_TRACE_TIME}") as handle:
        rows = csv.reader(handle)
        header = [cell.strip() for cell in next(rows, [])]
        if "Step" not in header:
            raise InputError(f"no Step column (header {header[:6]}); expected the profiler's {STEP_TRACE_TIME}",
                             source=source, line=1)
        column = header.index("Step")
        for row in rows:
            cell = row[column].strip() if column < len(row) else ""
            if cell.isdigit() and len(cell) <= 18:
                numbers.append(int(cell))
    return numbers

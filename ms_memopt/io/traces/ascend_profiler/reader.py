"""The Ascend profiler's memory output -> :class:`~ms_memopt.core.events.Trace`.

``torch_npu.profiler`` and MindSpore's profiler, run with ``profile_memory=True``, write under a
rank's folder (``*_ascend_pt`` for torch_npu, ``*_ascend_ms`` for MindSpore) the folder
``ASCEND_PROFILER_OUTPUT/`` with (text export) ``operator_memory.csv``, ``memory_record.csv`` and
``npu_module_mem.csv``, or (db export) the SQLite file ``ascend_pytorch_profiler_N.db`` whose
tables ``OP_MEMORY``, ``MEMORY_RECORD``, ``NPU_MODULE_MEM`` and ``NPU_OP_MEM`` hold the same data.
:func:`read_ascend_profiler` takes the rank's folder, ``ASCEND_PROFILER_OUTPUT/``, any one of
the CSV files, the ``.db``, or a job's folder of ranks' folders (the lowest rank is read);
:func:`stream_ascend_profiler` makes the events as they are iterated. Facts from the writers'
sources (docs/traces.md):

* ``operator_memory.csv``: one row per tensor: ``Size(KB)`` (block bytes / 1024), allocation and
  release time (us), and the pool's total allocated / reserved / active (MB = bytes / 2**20)
  just after the allocation and at the release. torch_npu (``MemoryPrepareParser``) writes every
  time as ns with the decimal point moved, plus a literal TAB (``"1736408883694624.810\\t"``),
  so it is read as integer ns, never as a float. Rows whose name starts with ``cann::`` are the
  graph engine's (GE) memory, copied from CANN's own file: a separate pool with its own
  reserved figure, and its release totals are taken *before* the release (torch_npu's after).
  MindSpore 2.10 (``ascend_op_memory_viewer.py``) writes float microseconds with no TAB and
  ``N/A`` for an empty field.
* A tensor allocated before the capture and released in it has no row in either writer (the
  release alone is dropped); it shows only as a fall of the recorded totals. The reader finds
  each such fall between two rows and makes it the release of a tensor of the initial state. A
  row with an empty allocation time is also a tensor of the initial state; one with an empty
  release time is live at the end. What the first row's totals say was allocated before it,
  and no release accounts for, is one more initial tensor held all through.
* Rows are not sorted by release time (nor, in some files, by allocation time). Allocations and
  releases are merged by time as a stream (memory bounded by the live tensors), the whole
  component sorted only when a row comes out of order. Equal times are ordered by the recorded
  totals (each event starts where the total stands; the fewest unseen releases; ending where
  the next event starts), else releases first.
* torch_npu's workspace allocator reports through the same records with reserved 0: those rows
  are the ``WORKSPACE`` component.
* ``memory_record.csv``: the totals over time per component (torch_npu: ``PTA``, ``GE``,
  ``PTA+GE``, ``APP``; db also ``WORKSPACE``; MindSpore: ``MindSpore``, ``GE``,
  ``MindSpore+GE``, ``APP``). MindSpore's "MB" there is KB / 1000 (``MemoryRecordBean``).
  Beside ``operator_memory.csv`` it is not read (the rows carry the same series); on its own it
  gives the recorded curves and events made from the allocated deltas.
* ``npu_module_mem.csv``: reserved memory per CANN module over time (figures only).
* The db: bytes and ns as integers; names are ``STRING_IDS`` ids. ``NPU_OP_MEM`` holds GE's
  allocate/release records with device addresses: used for the GE component (``addr``).

Each component is one event stream; the Trace holds the framework's (``PTA`` or ``MindSpore``;
``component=`` picks another) and ``meta["components"]`` the recorded figures of all:
``peak_allocated``, ``peak_reserved``, ``allocated_max_diff`` (the largest difference between
the recorded allocated total and the events' own at any row: 0 when the reader is right), and
how the initial state was made. For torch_npu's ``PTA`` the initial state is ``Trace.initial``:
the pre-capture tensors laid out in the recorded reserved total (placement guessed; no
addresses are recorded); elsewhere allocations before the first event.
``meta["allocator_candidates"]`` lists the models that fit, best first (replay takes the first
one registered), ``meta["framework"]`` names the writer.

Example:
    >>> trace = read_ascend_profiler("rank0_ascend_pt")                    # doctest: +SKIP
    >>> trace.meta["recorded"]["allocated_max_diff"]                        # doctest: +SKIP
    0
"""
from __future__ import annotations

import csv
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from operator import itemgetter
from pathlib import Path
from sys import intern

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event, Trace
from ms_memopt.core.lines import iter_lines, read_head
from ms_memopt.io.traces.ascend_profiler.db import read_db, read_db_modules, read_db_steps
from ms_memopt.io.traces.ascend_profiler.steps import (
    STEP_TRACE_TIME,
    TRACE_VIEW,
    StepMark,
    StepMarks,
    step_trace_numbers,
    trace_view_steps,
)
from ms_memopt.io.traces.ascend_profiler.timeline import (
    FRAMEWORK,
    GE,
    MINDSPORE,
    NPU_PAD,
    TORCH_NPU,
    WORKSPACE,
    OutOfOrder,
    RowMerge,
    Timeline,
    better_figures,
    check_held,
    new_timeline,
)

__all__ = [
    "FORMAT",
    "MEMORY_RECORD",
    "NPU_MODULE_MEM",
    "OPERATOR_MEMORY",
    "OUTPUT_DIR",
    "is_profiler_dir",
    "is_sqlite",
    "profiler_file_kind",
    "profiler_size",
    "read_ascend_profiler",
    "read_step_marks",
    "stream_ascend_profiler",
]

FORMAT = "ascend-profiler"
OUTPUT_DIR = "ASCEND_PROFILER_OUTPUT"
OPERATOR_MEMORY = "operator_memory.csv"
MEMORY_RECORD = "memory_record.csv"
NPU_MODULE_MEM = "npu_module_mem.csv"
_DB_NAME = re.compile(r"^ascend_(pytorch|mindspore)_profiler(_\d+)?\.db$")
_SQLITE_MAGIC = b"SQLite format 3\x00"

_OPERATOR_COLUMNS = ("Name", "Size(KB)", "Allocation Time(us)", "Release Time(us)",
                     "Allocation Total Allocated(MB)", "Allocation Total Reserved(MB)",
                     "Release Total Allocated(MB)", "Release Total Reserved(MB)")
_RECORD_COLUMNS = ("Component", "Timestamp(us)", "Total Allocated(MB)", "Total Reserved(MB)")
_MODULE_COLUMNS = ("Component", "Timestamp(us)", "Total Reserved(MB)")

_GE_PREFIX = "cann::"
_KB, _MB = 1024, 1 << 20


# --------------------------------------------------------------------------- detection

def profiler_file_kind(first_line: str) -> str | None:
    """Which profiler file a CSV header line is: ``operator_memory``, ``memory_record``,
    ``npu_module_mem``, or ``None``.

    Example:
        >>> profiler_file_kind("Component,Timestamp(us),Total Reserved(MB),Device")
        'npu_module_mem'
    """
    columns = [c.strip() for c in first_line.lstrip("\ufeff").strip().split(",")]
    if all(c in columns for c in _OPERATOR_COLUMNS):
        return "operator_memory"
    if all(c in columns for c in _RECORD_COLUMNS):
        return "memory_record"
    if all(c in columns for c in _MODULE_COLUMNS):
        return "npu_module_mem"
    return None


def is_sqlite(head: bytes) -> bool:
    """True when ``head`` (a file's first bytes) starts an SQLite database."""
    return head.startswith(_SQLITE_MAGIC)


def is_profiler_dir(path: str | Path) -> bool:
    """True when ``path`` is ``ASCEND_PROFILER_OUTPUT/``, a rank's folder holding it, or a folder
    of ranks' folders (the lowest rank is read)."""
    path = Path(path)
    return path.is_dir() and (_output_dir(path) is not None or bool(_rank_dirs(path)))


def profiler_size(path: str | Path) -> int:
    """Bytes of the file a read of ``path`` goes through (``operator_memory.csv`` of a folder, the
    file itself otherwise; 0 when there is none): how large a replay's stream would be."""
    path = Path(path)
    try:
        if path.is_dir():
            inputs = _locate(path)
            target = inputs.operator_memory or inputs.db or inputs.memory_record
            return target.stat().st_size if target is not None else 0
        return path.stat().st_size
    except (OSError, InputError):
        return 0


def _rank_dirs(path: Path) -> list[Path]:
    """The ranks' folders directly inside ``path``, lowest rank first (``profiler_info_N.json``,
    else the first number in the folder's name, else the name)."""
    ranks = [p for p in _list(path) if p.is_dir() and (p / OUTPUT_DIR).is_dir()]

    def rank_of(folder: Path) -> tuple:
        for item in _list(folder):
            match = re.fullmatch(r"profiler_info_(\d+)\.json", item.name)
            if match:
                return (int(match.group(1)), folder.name)
        match = re.search(r"\d+", folder.name)
        return (int(match.group()) if match else 1 << 30, folder.name)
    return sorted(ranks, key=rank_of)


def _output_dir(path: Path) -> Path | None:
    if (path / OUTPUT_DIR).is_dir():
        return path / OUTPUT_DIR
    if path.name == OUTPUT_DIR or any((path / name).is_file() for name in (OPERATOR_MEMORY, MEMORY_RECORD)) \
            or any(_DB_NAME.match(p.name) for p in _list(path)):
        return path
    return None


def _list(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except OSError:
        return []


# --------------------------------------------------------------------------- fields

def _empty(text: str | None) -> bool:
    return text is None or text.strip() in ("", "N/A", "None", "NULL")


#: a time is integer ns within int64 (the profiler's clock, ~1.7e18 ns now, is far inside it)
_NS_LIMIT = 1 << 63
#: the longest time text read (torch_npu writes 20 characters, MindSpore a float's repr)
_MAX_TIME_TEXT = 64


def _ns(text: str | None, what: str, source: str, line: int) -> int | None:
    """A microseconds field (``"1736408883694624.810\\t"``, ``1.7364e15``) as integer ns; None when empty.

    ASCII digits only (``int()`` takes ``'١٢٣'`` and refuses ``'1²3'`` with a ValueError), at most
    :data:`_MAX_TIME_TEXT` characters, and within int64 ns: anything else is an :class:`InputError`
    naming the field, the file and the line (a 5,000-digit time, or 10**303 ns, was a traceback).
    """
    if text is None:
        return None
    text = text.strip()
    if _empty(text):
        return None
    if len(text) > _MAX_TIME_TEXT or not text.isascii():
        raise InputError(f"{what}: expected a time in microseconds (ASCII digits, at most {_MAX_TIME_TEXT} "
                         f"characters), got {text[:40]!r}{'...' if len(text) > 40 else ''}", source=source, line=line)
    value = None
    # torch_npu's form, exactly three decimals: the digits are the ns
    if text[-4:-3] == "." and text[:1].isdigit():
        try:
            value = int(text[:-4] + text[-3:])
        except ValueError:
            pass
    if value is None:
        whole, _, frac = text.partition(".")
        if whole.lstrip("-").isdigit() and (not frac or frac.isdigit()):
            value = int(whole) * 1000
            digits = (frac + "000")[:3]
            if digits:
                value += (-1 if whole.startswith("-") else 1) * int(digits)
        else:
            try:
                exact = Decimal(text) * 1000
            except InvalidOperation:
                raise InputError(f"{what}: expected a time in microseconds, got {text[:40]!r}", source=source,
                                 line=line) from None
            if not exact.is_finite() or not -_NS_LIMIT < exact < _NS_LIMIT:
                raise InputError(f"{what}: expected a finite time within int64 ns, got {text[:40]!r}",
                                 source=source, line=line)
            value = int(exact.to_integral_value())
    if not -_NS_LIMIT < value < _NS_LIMIT:
        raise InputError(f"{what}: expected a time within int64 ns (about 292 years), got {text[:40]!r}",
                         source=source, line=line)
    return value


def _bytes(text: str | None, unit: int, what: str, source: str, line: int) -> int | None:
    """A size in ``unit`` bytes (KB, MB; floats as Python prints them) as an integer byte count."""
    value = _number(text, what, source, line)
    return None if value is None else round(value * unit)


def _number(text: str | None, what: str, source: str, line: int) -> float | None:
    """A non-negative finite number field; None when empty."""
    try:
        value = float(text)         # surrounding whitespace (a TAB) is allowed by float()
    except (ValueError, TypeError):
        if _empty(text):
            return None
        raise InputError(f"{what}: expected a number, got {text.strip()[:40]!r}", source=source, line=line) from None
    if value < 0:
        raise InputError(f"{what}: expected a non-negative size, got {text.strip()[:40]!r}", source=source, line=line)
    if not value <= 1e18:          # inf and nan too
        raise InputError(f"{what}: expected a finite number, got {text.strip()[:40]!r}", source=source, line=line)
    return value


# --------------------------------------------------------------------------- inputs

@dataclass
class _Inputs:
    """The files of one rank's profiler output."""

    operator_memory: Path | None = None
    memory_record: Path | None = None
    npu_module_mem: Path | None = None
    db: Path | None = None
    rank_dir: Path | None = None
    notes: list[str] = field(default_factory=list)


def _locate(path: Path) -> _Inputs:
    source = str(path)
    if path.is_dir():
        out_dir = _output_dir(path)
        ranks = _rank_dirs(path) if out_dir is None else []
        if ranks:
            # a job's folder: the lowest rank is read, as other readers read the lowest device
            found = _locate(ranks[0])
            found.notes.append(f"{len(ranks)} ranks' folders here ({', '.join(p.name for p in ranks[:8])}"
                               f"{' ...' if len(ranks) > 8 else ''}): {ranks[0].name} read")
            return found
        if out_dir is None:
            raise InputError(f"is a directory without {OUTPUT_DIR}/, {OPERATOR_MEMORY}, {MEMORY_RECORD} or an "
                             f"ascend_*_profiler_N.db; expected the Ascend profiler's output of one rank",
                             source=source)
        found = _Inputs(rank_dir=out_dir.parent if out_dir.name == OUTPUT_DIR else path)
        for name, attr in ((OPERATOR_MEMORY, "operator_memory"), (MEMORY_RECORD, "memory_record"),
                           (NPU_MODULE_MEM, "npu_module_mem")):
            # there in any form: a file that cannot be read (a symlink loop, a folder) is an error
            # when read, never a silent fall back to the next file
            if os.path.lexists(out_dir / name):
                setattr(found, attr, out_dir / name)
        dbs = [p for p in _list(out_dir) if _DB_NAME.match(p.name)]
        if dbs:
            found.db = dbs[0]
        if found.operator_memory is None and found.memory_record is None and found.db is None:
            raise InputError(f"{out_dir.name}/ holds no memory files ({OPERATOR_MEMORY}, {MEMORY_RECORD} or "
                             f"ascend_*_profiler_N.db); the profiler writes them with profile_memory=True",
                             source=source)
        if found.operator_memory is not None or found.memory_record is not None:
            found.db = None         # the text export is the one read; the db holds the same data
        if found.operator_memory is not None and found.memory_record is not None:
            # the rows carry the same PTA/GE totals at every event; memory_record.csv (2-4 lines a
            # tensor) is read only on its own
            found.notes.append(f"{MEMORY_RECORD} not read: {OPERATOR_MEMORY}'s totals are the same series")
            found.memory_record = None
        return found
    head = _head(path)
    found = _Inputs(rank_dir=path.parent.parent if path.parent.name == OUTPUT_DIR else None)
    if is_sqlite(head):
        found.db = path
        return found
    kind = profiler_file_kind(head.decode("utf-8", errors="replace").split("\n", 1)[0])
    if kind is None:
        raise InputError("not an Ascend profiler memory file; expected operator_memory.csv, memory_record.csv, "
                         "npu_module_mem.csv or ascend_*_profiler_N.db", source=source, line=1)
    setattr(found, kind, path)
    return found


def _head(path: Path, size: int = 4096) -> bytes:
    """The file's first bytes through core.lines (a FIFO with no writer refused in MS_MEMOPT_PIPE_WAIT
    seconds; a pipe's head kept for the reader): ``--format ascend-profiler`` skips detection."""
    return read_head(path, size, expected="the Ascend profiler's memory output")


def _csv_reader(path: Path, expected: str):
    """``csv.reader`` over the file's bounded lines (core.lines: CRLF or LF, a line over 1 MiB an
    error); its ``line_num`` is the file's line number (no field spans lines in these files)."""
    return csv.reader(map(itemgetter(1), iter_lines(path, expected=expected)))


def _csv_rows(path: Path, expected: str) -> Iterator[tuple[int, list[str]]]:
    """``(line, cells)`` of a CSV file (see :func:`_csv_reader`)."""
    reader = _csv_reader(path, expected)
    try:
        for cells in reader:
            yield reader.line_num, cells
    except csv.Error as exc:
        raise InputError(f"malformed CSV: {exc}", source=str(path), line=reader.line_num + 1) from None


def _csv_with_header(path: Path, name: str, needed: Iterable[str]
                     ) -> tuple[Iterator[tuple[int, list[str]]], list[str], dict[str, int]]:
    """The rows after the header of the profiler's ``name`` CSV, the header, and the index of each
    column (``needed`` must be there)."""
    rows = _csv_rows(path, f"the Ascend profiler's {name}")
    try:
        _, header = next(rows)
    except StopIteration:
        raise InputError(f"empty file; expected {name}'s header", source=str(path)) from None
    return rows, header, _columns(header, needed, str(path))


def _columns(header: list[str], needed: Iterable[str], source: str) -> dict[str, int]:
    names = [c.strip().lstrip("\ufeff") for c in header]
    index = {name: i for i, name in enumerate(names)}
    missing = [c for c in needed if c not in index]
    if missing:
        raise InputError(f"missing column(s) {', '.join(missing)}; header is {','.join(names)[:200]!r}",
                         source=source, line=1)
    return index


# --------------------------------------------------------------------------- writer and model

#: the largest sidecar JSON read (the real ones are a few KB)
MAX_SIDECAR_BYTES = 1 << 20


def _profiler_info(rank_dir: Path | None) -> tuple[dict, dict]:
    """``profiler_info_N.json`` and ``profiler_metadata.json`` of the rank (empty when absent).

    Raises:
        InputError: one is there but is not a regular file (a FIFO, ``/dev/zero``), is larger than
            :data:`MAX_SIDECAR_BYTES`, cannot be read (a symlink loop) or is not a JSON object.
    """
    info: dict = {}
    metadata: dict = {}
    if rank_dir is None:
        return info, metadata
    for candidate in _list(rank_dir):
        if candidate.name.startswith("profiler_info") and candidate.suffix == ".json":
            info = _json(candidate)
            break
    if os.path.lexists(rank_dir / "profiler_metadata.json"):
        metadata = _json(rank_dir / "profiler_metadata.json")
    return info, metadata


def _json(path: Path) -> dict:
    """A sidecar JSON object, read in bounded memory and time (never a FIFO's wait or a device's endless bytes)."""
    from ms_memopt.core.jsontext import parse_json

    source = str(path)
    expected = f"the profiler's {path.name}, a JSON object of at most {MAX_SIDECAR_BYTES} bytes"
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"not a regular file (a FIFO, device or folder); expected {expected}", source=source)
        if info.st_size > MAX_SIDECAR_BYTES:
            raise InputError(f"{info.st_size} bytes; expected {expected}", source=source)
        with open(path, "rb") as handle:
            data = handle.read(MAX_SIDECAR_BYTES + 1)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}; expected {expected}", source=source) from None
    if len(data) > MAX_SIDECAR_BYTES:
        raise InputError(f"larger than {MAX_SIDECAR_BYTES} bytes; expected {expected}", source=source)
    value = parse_json(data.decode("utf-8", errors="replace"), source=source)
    if not isinstance(value, dict):
        raise InputError(f"a JSON {type(value).__name__}; expected {expected}", source=source)
    return value


def _writer(inputs: _Inputs, info: dict, hints: dict[str, str]) -> tuple[str, str]:
    """Which profiler wrote the files (``torch_npu`` or ``mindspore``) and what said so."""
    if inputs.db is not None:
        match = _DB_NAME.match(inputs.db.name)
        if match:
            return (TORCH_NPU if match.group(1) == "pytorch" else MINDSPORE), f"the db's name {inputs.db.name}"
    if inputs.rank_dir is not None:
        if inputs.rank_dir.name.endswith("_ascend_pt"):
            return TORCH_NPU, f"the folder's name {inputs.rank_dir.name} (*_ascend_pt)"
        if inputs.rank_dir.name.endswith("_ascend_ms"):
            return MINDSPORE, f"the folder's name {inputs.rank_dir.name} (*_ascend_ms)"
    if "ms_version" in info or "ms_profiler_info" in info:
        return MINDSPORE, "profiler_info_N.json (ms_version)"
    if isinstance(info.get("config"), dict) and "common_config" in info["config"]:
        return TORCH_NPU, "profiler_info_N.json (torch_npu's config)"
    if hints:
        writer, why = next(iter(hints.items()))
        return writer, why
    return TORCH_NPU, "nothing in the files (torch_npu assumed)"


def _allocator(writer: str, metadata: dict, info: dict, small_growths: int) -> tuple[list[str], str]:
    """The models that fit, best first (replay takes the first one registered), and why."""
    if writer == TORCH_NPU:
        env = metadata.get("ENV_VARIABLES") if isinstance(metadata.get("ENV_VARIABLES"), dict) else {}
        conf = str(env.get("PYTORCH_NPU_ALLOC_CONF") or "")
        if re.search(r"expandable_segments\s*:\s*true", conf, re.IGNORECASE):
            return (["torch-npu-expandable", "torch-expandable"],
                    f"torch_npu's profiler; PYTORCH_NPU_ALLOC_CONF={conf!r} in profiler_metadata.json")
        said = f"PYTORCH_NPU_ALLOC_CONF={conf!r}" if conf else "PYTORCH_NPU_ALLOC_CONF unset"
        return ["torch-npu", "torch"], f"torch_npu's profiler; {said} in profiler_metadata.json" if metadata else \
            "torch_npu's profiler (no profiler_metadata.json: default settings assumed)"
    # MindSpore's pool grows by increase_size blocks (1 GiB default); VMM maps 2 MiB chunks
    if small_growths:
        return ["mindspore-vmm", "mindspore"], (f"MindSpore's profiler; its reserved total grew by less than 1 GiB "
                                                f"({small_growths} times): VMM's 2 MiB chunks, not the pool's blocks")
    return ["mindspore", "mindspore-vmm"], "MindSpore's profiler; reserved grew in blocks of 1 GiB or more"


# --------------------------------------------------------------------------- readers

def _operator_rows(path: Path, writer_hints: dict) -> Iterator[tuple[str | None, tuple]]:
    """``(component, row)`` for each row of ``operator_memory.csv`` (component None: the framework's);
    the stream pointers numbered 0, 1, ... in the order they appear."""
    source = str(path)
    reader = _csv_reader(path, "the Ascend profiler's operator_memory.csv")
    try:
        header = next(reader)
    except StopIteration:
        raise InputError("empty file; expected operator_memory.csv's header", source=source) from None
    except csv.Error as exc:
        raise InputError(f"malformed CSV: {exc}", source=source, line=1) from None
    col = _columns(header, _OPERATOR_COLUMNS, source)
    stream_col = col.get("Stream Ptr")
    i_name, i_size, i_at, i_rt = col["Name"], col["Size(KB)"], col["Allocation Time(us)"], col["Release Time(us)"]
    i_aa, i_ar = col["Allocation Total Allocated(MB)"], col["Allocation Total Reserved(MB)"]
    i_ra, i_rr = col["Release Total Allocated(MB)"], col["Release Total Reserved(MB)"]
    width = len(header)
    streams: dict[str, int] = {}
    last_ar = last_rr = None           # the reserved totals' text last parsed, and its bytes
    last_ar_bytes = last_rr_bytes = 0
    try:
        for cells in reader:
            line = reader.line_num
            if len(cells) < width:
                if not cells or (len(cells) == 1 and not cells[0].strip()):
                    continue
                raise InputError(f"{len(cells)} fields; expected {width} (the header's columns)", source=source,
                                 line=line)
            if not writer_hints:
                if "N/A" in cells:
                    writer_hints[MINDSPORE] = "operator_memory.csv's N/A fields (MindSpore's writer)"
                elif cells[i_at].endswith("\t"):
                    writer_hints[TORCH_NPU] = "operator_memory.csv's times ending in a TAB (torch_npu's writer)"
            name = intern(cells[i_name])          # one string per operator name, not per row
            ge = name.startswith(_GE_PREFIX)
            raw_stream = cells[stream_col] if stream_col is not None else ""
            stream = streams.get(raw_stream)
            if stream is None:          # numbered by the pointer, whatever spaces surround it
                stream = streams[raw_stream] = streams.setdefault(raw_stream.strip(), len(set(streams.values())))
            try:
                # the common row, every field present: float() takes the TAB, the ns are the digits;
                # the reserved totals seldom change, so a text seen last time is not parsed again
                at, rt = cells[i_at].strip(), cells[i_rt].strip()
                size = float(cells[i_size])
                a_total, r_total = float(cells[i_aa]), float(cells[i_ra])
                if cells[i_ar] != last_ar:
                    last_ar, last_ar_bytes = cells[i_ar], round(float(cells[i_ar]) * _MB)
                if cells[i_rr] != last_rr:
                    last_rr, last_rr_bytes = cells[i_rr], round(float(cells[i_rr]) * _MB)
                if at[-4:-3] != "." or rt[-4:-3] != "." or not (
                        0 <= size < 1e15 and 0 <= a_total < 1e12 and 0 <= r_total < 1e12
                        and 0 <= last_ar_bytes < 1e18 and 0 <= last_rr_bytes < 1e18):
                    raise ValueError
                at_ns, rt_ns = int(at.replace(".", "", 1)), int(rt.replace(".", "", 1))
                if not (-_NS_LIMIT < at_ns < _NS_LIMIT and -_NS_LIMIT < rt_ns < _NS_LIMIT and at.isascii()
                        and rt.isascii()):
                    raise ValueError
                row = (at_ns, rt_ns, int(size * _KB + 0.5),
                       int(a_total * _MB + 0.5), last_ar_bytes, int(r_total * _MB + 0.5), last_rr_bytes, line,
                       intern(name[len(_GE_PREFIX):]) if ge else name, None, stream)
            except (ValueError, OverflowError):
                last_ar = last_rr = None        # parsed afresh next time
                row = _operator_row(cells, (i_size, i_at, i_rt, i_aa, i_ar, i_ra, i_rr), source, line,
                                    intern(name[len(_GE_PREFIX):]) if ge else name, stream)
            yield (GE if ge else None), row
    except csv.Error as exc:
        raise InputError(f"malformed CSV: {exc}", source=source, line=reader.line_num + 1) from None


def _operator_row(cells: list[str], index: tuple, source: str, line: int, name: str, stream: str) -> tuple:
    """One row with empty fields, or a bad one: each field checked, the error naming it."""
    i_size, i_at, i_rt, i_aa, i_ar, i_ra, i_rr = index
    size = _bytes(cells[i_size], _KB, "Size(KB)", source, line)
    if size is None:
        raise InputError("Size(KB): empty; expected the block size in KB", source=source, line=line)
    row = (_ns(cells[i_at], "Allocation Time(us)", source, line), _ns(cells[i_rt], "Release Time(us)", source, line),
           size, _bytes(cells[i_aa], _MB, "Allocation Total Allocated(MB)", source, line),
           _bytes(cells[i_ar], _MB, "Allocation Total Reserved(MB)", source, line),
           _bytes(cells[i_ra], _MB, "Release Total Allocated(MB)", source, line),
           _bytes(cells[i_rr], _MB, "Release Total Reserved(MB)", source, line), line, name, None, stream)
    if row[0] is None and row[1] is None and row[3] is None:
        raise InputError("neither an allocation nor a release time nor totals; expected a tensor's row",
                         source=source, line=line)
    return row


def _record_series(path: Path, writer_hints: dict, *, keep_points: bool = True) -> dict[str, dict]:
    """Per component of ``memory_record.csv``: rows, peak allocated and reserved (bytes) and, with
    ``keep_points``, every ``(time, allocated, reserved, line)``."""
    source = str(path)
    rows, header, col = _csv_with_header(path, "memory_record.csv", _RECORD_COLUMNS)
    i_comp, i_time = col["Component"], col["Timestamp(us)"]
    i_alloc, i_res = col["Total Allocated(MB)"], col["Total Reserved(MB)"]
    width = len(header)
    series: dict[str, dict] = {}
    for line, cells in rows:
        if len(cells) < width:
            if not cells or (len(cells) == 1 and not cells[0].strip()):
                continue
            raise InputError(f"{len(cells)} fields; expected {width}", source=source, line=line)
        component = cells[i_comp].strip()
        entry = series.get(component)
        if entry is None:
            entry = series[component] = {"rows": 0, "peak_allocated": None, "peak_reserved": None, "points": []}
            if component.startswith("MindSpore"):
                writer_hints.setdefault(MINDSPORE, "memory_record.csv's MindSpore component")
            elif component.startswith("PTA"):
                writer_hints.setdefault(TORCH_NPU, "memory_record.csv's PTA component")
        entry["rows"] += 1
        try:
            a, r = float(cells[i_alloc]), float(cells[i_res])
            if not (0 <= a < 1e12 and 0 <= r < 1e12):
                raise ValueError
        except ValueError:
            a = _number(cells[i_alloc], "Total Allocated(MB)", source, line)
            r = _number(cells[i_res], "Total Reserved(MB)", source, line)
        time = _ns(cells[i_time], "Timestamp(us)", source, line) if keep_points else None
        if a is not None and (entry["peak_allocated"] is None or a > entry["peak_allocated"]):
            entry["peak_allocated"] = a
        if r is not None and (entry["peak_reserved"] is None or r > entry["peak_reserved"]):
            entry["peak_reserved"] = r
        if keep_points:
            entry["points"].append((time, a, r, line))
            if line & 0xFFF == 0:
                check_held(line, source)
    # MindSpore's MemoryRecordBean divides KB by 1000 and calls it MB
    unit = 1000 * _KB if any(name.startswith("MindSpore") for name in series) else _MB
    for entry in series.values():
        for key in ("peak_allocated", "peak_reserved"):
            if entry[key] is not None:
                entry[key] = round(entry[key] * unit)
        entry["points"] = [(t, None if a is None else round(a * unit), None if r is None else round(r * unit), n)
                           for t, a, r, n in entry["points"]]
    return series


def _module_series(path: Path) -> dict[str, int]:
    """Peak reserved bytes per CANN module of ``npu_module_mem.csv`` (modules that held any)."""
    source = str(path)
    rows, header, col = _csv_with_header(path, "npu_module_mem.csv", _MODULE_COLUMNS)
    peaks: dict[str, int] = {}
    for line, cells in rows:
        if not cells or (len(cells) == 1 and not cells[0].strip()):
            continue
        if len(cells) < len(header):
            raise InputError(f"{len(cells)} fields; expected {len(header)}", source=source, line=line)
        _ns(cells[col["Timestamp(us)"]], "Timestamp(us)", source, line)
        value = _bytes(cells[col["Total Reserved(MB)"]], _MB, "Total Reserved(MB)", source, line) or 0
        module = cells[col["Component"]].strip()
        peaks[module] = max(peaks.get(module, 0), value)
    return {m: v for m, v in sorted(peaks.items()) if v > 0}


def read_ascend_profiler(path: str | Path, *, component: str | None = None, initial_as_events: bool = False,
                         _emit: bool = True) -> Trace:
    """Read the Ascend profiler's memory output of one rank (see the module docstring).

    Args:
        path: the rank's folder (``*_ascend_pt``, ``*_ascend_ms``), ``ASCEND_PROFILER_OUTPUT/``,
            ``operator_memory.csv``, ``memory_record.csv``, ``npu_module_mem.csv`` or the ``.db``.
        component: the component whose events the Trace holds (``"PTA"``, ``"MindSpore"``,
            ``"GE"``); default the framework's, else the first with events.
        initial_as_events: the tensors held before the capture as allocations before the first
            event (``meta["recorded"]["initial_tensors"]`` of them, first), never as
            ``Trace.initial``'s layout (a step template's prologue is made of them).

    Returns:
        A :class:`Trace` of format ``ascend-profiler``; sizes in bytes, ``time`` in ns.
        ``meta["recorded"]`` holds the chosen component's recorded figures (peak allocated and
        reserved, ``allocated_max_diff``), ``meta["components"]`` every component's,
        ``meta["allocator_candidates"]`` the models that fit, best first.

    Raises:
        InputError: an unreadable or malformed file, naming the file and line (or table and row).
    """
    path = Path(path)
    source = str(path)
    inputs = _locate(path)
    info, metadata = _profiler_info(inputs.rank_dir)
    hints: dict[str, str] = {}
    record = _record_series(inputs.memory_record, hints) if inputs.memory_record is not None else {}
    modules = _module_series(inputs.npu_module_mem) if inputs.npu_module_mem is not None else {}
    timelines: dict[str, Timeline] = {}
    files: list[str] = []
    if inputs.db is not None:
        writer, why = _writer(inputs, info, hints)
        timelines = read_db(inputs.db, writer, record)
        modules = read_db_modules(inputs.db)
        files.append(inputs.db.name)
    elif inputs.operator_memory is not None:
        timelines, writer, why = _read_operator_memory(inputs, info, hints, emit=_emit)
        files.append(OPERATOR_MEMORY)
    else:
        writer, why = _writer(inputs, info, hints)
        if record:
            timelines = _from_record(record, writer)
    if inputs.memory_record is not None:
        files.append(MEMORY_RECORD)
    if inputs.npu_module_mem is not None:
        files.append(NPU_MODULE_MEM)

    framework = FRAMEWORK[writer]
    if component is None:
        component = framework if framework in timelines else next(iter(timelines), framework)
    elif component not in timelines and timelines:
        raise InputError(f"no component {component!r} in the recording; it has {', '.join(timelines)}",
                         source=source, key="component")
    chosen = timelines.get(component)
    events: list[Event] = []
    initial = None
    if chosen is not None:
        start = chosen.first_time
        if component == framework and not initial_as_events:
            initial = chosen.initial_layout(torch=writer == TORCH_NPU)
        events = chosen.events if initial is not None else chosen.initial_events(start) + chosen.events

    components = {}
    for name, timeline in timelines.items():
        figures = timeline.fig.to_dict()
        figures["initial_tensors"] = len(timeline.initial)
        components[name] = figures
    for name, entry in record.items():
        figures = components.setdefault(name, {})
        figures["memory_record_rows"] = entry["rows"]
        for key in ("peak_allocated", "peak_reserved"):
            value = entry[key]
            if value is not None and (figures.get(key) is None or value > figures[key]):
                figures[key] = value
    small = components.get(framework, {}).get("reserved_small_growths", 0)
    allocator, allocator_why = _allocator(writer, metadata, info, small)
    if component != framework:
        allocator, allocator_why = (["mindspore", "torch"],
                                    f"the {component} component: no model of its own allocator (closest given)")
    recorded = dict(components.get(component, {}))
    recorded["component"] = component
    meta = {
        "writer": writer, "writer_evidence": why, "files": files,
        "component": component, "components": components,
        "recorded": recorded, "allocator_candidates": allocator, "allocator_evidence": allocator_why,
        "framework": writer,
        "time_unit": "ns",
    }
    if modules:
        meta["modules_peak_reserved"] = modules
    if inputs.notes:
        meta["notes"] = inputs.notes
    if writer == TORCH_NPU and component == framework:
        meta["size_rule"] = (f"events ask for the recorded block size - {NPU_PAD} B: torch_npu's round_size adds "
                             f"{NPU_PAD} B and rounds up to 512 B, so the model's block is the recorded one")
    if initial is not None:
        meta["initial_state"] = (f"{len(chosen.initial)} tensors allocated before the capture in "
                                 f"{len(initial.segments)} segments of the recorded reserved total at the first row; "
                                 f"their placement is a guess")
    trace = Trace(events, source=source, format=FORMAT, initial=initial, meta=meta)
    if not _emit and chosen is not None:
        trace.meta["_stream"] = (inputs.operator_memory, writer, component, chosen.release_after, chosen.fig.unsorted,
                                 [] if initial is not None else events)
    return trace


def read_step_marks(path: str | Path) -> StepMarks:
    """The capture's steps from the profiler's own markers (``ProfilerStep#N``,
    :mod:`ms_memopt.io.traces.ascend_profiler.steps`): the db's ``STEP_TIME`` table, else
    ``trace_view.json`` beside the memory files; ``StepMarks.source`` is ``None`` when neither has
    one (``step_trace_time.csv`` alone numbers steps without placing them: a note says so).

    Example:
        >>> read_step_marks("rank0_ascend_pt").source                    # doctest: +SKIP
        'trace_view.json'
    """
    inputs = _locate(Path(path))
    notes: list[str] = []
    if inputs.db is not None:
        rows = read_db_steps(inputs.db)
        if rows:
            return StepMarks([StepMark(*row) for row in rows], "STEP_TIME", notes)
        notes.append(f"{inputs.db.name}: no STEP_TIME rows")
    found = inputs.operator_memory or inputs.memory_record or inputs.npu_module_mem or inputs.db
    out_dir = found.parent if found is not None else None
    if out_dir is not None and os.path.lexists(out_dir / TRACE_VIEW):
        steps = trace_view_steps(out_dir / TRACE_VIEW)
        if steps:
            return StepMarks(steps, TRACE_VIEW, notes)
        notes.append(f"{TRACE_VIEW}: no ProfilerStep#N event (the run called no prof.step())")
    if out_dir is not None and os.path.lexists(out_dir / STEP_TRACE_TIME):
        numbers = step_trace_numbers(out_dir / STEP_TRACE_TIME)
        notes.append(f"{STEP_TRACE_TIME} numbers {len(numbers)} step(s) but gives no start times; "
                     f"{TRACE_VIEW} or the db places them")
    return StepMarks([], None, notes)


def stream_ascend_profiler(path: str | Path, *, component: str | None = None) -> Trace:
    """:func:`read_ascend_profiler` as a stream (``load_trace(..., stream=True)``): the events of
    ``operator_memory.csv`` are produced as ``trace.events`` is iterated, from a second read of
    the file, so memory is the live tensors', not the file's events.

    A first read learns what the events need before they start (the initial state, the rule of
    the release totals) and every figure; a file whose rows are out of time order, the db and a
    lone ``memory_record.csv`` are read whole, as :func:`read_ascend_profiler` does.
    """
    trace = read_ascend_profiler(path, component=component, _emit=False)
    plan = trace.meta.pop("_stream", None)
    if plan is None or plan[0] is None or plan[4]:
        return read_ascend_profiler(path, component=component)
    trace.events = _ProfilerEvents(*plan[:4], initial_events=plan[5])
    trace.meta["streamed"] = True
    return trace


class _ProfilerEvents:
    """One component's events of an ``operator_memory.csv``, made from the file each time they are
    iterated (after the initial state's allocations, when it is not a layout)."""

    def __init__(self, path: Path, writer: str, component: str, release_after: bool, *,
                 initial_events: list[Event]) -> None:
        self.path, self.writer, self.component = path, writer, component
        self.release_after = release_after
        self.initial_events = initial_events

    def __iter__(self) -> Iterator[Event]:
        yield from self.initial_events
        framework = FRAMEWORK[self.writer]
        timeline = new_timeline(self.component, self.writer, self.release_after)
        merge = RowMerge(timeline, str(self.path))
        events = timeline.events
        for comp, row in _operator_rows(self.path, {}):
            if comp is None:
                comp = WORKSPACE if self.writer == TORCH_NPU and row[4] == 0 and (row[3] or 0) > 0 else framework
            if comp != self.component:
                continue
            merge.push(row)
            if events:
                yield from events
                events.clear()
        merge.finish()
        yield from events
        events.clear()


def _read_operator_memory(inputs: _Inputs, info: dict, hints: dict, *,
                          emit: bool = True) -> tuple[dict[str, Timeline], str, str]:
    """Stream ``operator_memory.csv`` into one timeline per component; read again where needed."""
    path = inputs.operator_memory
    # the writer decides the framework component's name; the file's first rows may say who wrote it
    local_hints: dict[str, str] = {}
    first = _operator_rows(path, local_hints)
    next(first, None)
    first.close()
    for key, value in local_hints.items():
        hints.setdefault(key, value)
    writer, why = _writer(inputs, info, hints)
    framework = FRAMEWORK[writer]

    def run(only: str | None, sort: bool, release_after: dict[str, bool]) -> dict[str, Timeline]:
        timelines: dict[str, Timeline] = {}
        merges: dict[str, RowMerge] = {}
        rows = _operator_rows(path, {})
        if sort:
            rows = sorted(_held((r for r in rows if only is None or (r[0] or _framework_or_workspace(r[1])) == only),
                                str(path)),
                          key=lambda r: (-1 if r[1][0] is None else r[1][0], r[1][7]))
        for comp, row in rows:
            if comp is None:
                # torch_npu's NPUWorkspaceAllocator reports its own allocated total with reserved 0
                # ("reserved_bytes not used"); no caching-allocator total has reserved < allocated
                comp = WORKSPACE if writer == TORCH_NPU and row[4] == 0 and (row[3] or 0) > 0 else framework
            if only is not None and comp != only:
                continue
            merge = merges.get(comp)
            if merge is None:
                timelines[comp] = new_timeline(comp, writer, release_after.get(comp), emit)
                merge = merges[comp] = RowMerge(timelines[comp], str(path))
            merge.push(row)
        for comp, merge in merges.items():
            merge.finish()
            timelines[comp].fig.unsorted = sort
        return timelines

    def _framework_or_workspace(row: tuple) -> str:
        return WORKSPACE if writer == TORCH_NPU and row[4] == 0 and (row[3] or 0) > 0 else framework

    try:
        timelines = run(None, False, {})
    except OutOfOrder:
        timelines = {}
        names = {(comp or _framework_or_workspace(row)) for comp, row in _operator_rows(path, {})}
        for name in sorted(names):
            try:
                timelines.update(run(name, False, {}))
            except OutOfOrder:
                timelines.update(run(name, True, {}))
    for name in list(timelines):
        if timelines[name].fig.allocated_max_diff:
            # the release totals may be the other way round (taken before the release, as CANN's)
            flipped = not timelines[name].release_after
            again = run(name, timelines[name].fig.unsorted, {name: flipped})[name]
            if better_figures(again.fig, timelines[name].fig):
                timelines[name] = again
    order = [framework] + sorted(n for n in timelines if n != framework)
    return {n: timelines[n] for n in order if n in timelines}, writer, why


def _held(rows: Iterable, source: str) -> Iterator:
    """``rows`` as they come, refused past the events a whole read may hold (they are sorted whole)."""
    for count, row in enumerate(rows, 1):
        if count & 0xFFF == 0:
            check_held(2 * count, source)       # an allocation and a release a row
        yield row


def _from_record(record: dict[str, dict], writer: str) -> dict[str, Timeline]:
    """``memory_record.csv`` alone: each change of a component's allocated total is one event.

    A rise is an allocation of its size; a fall frees the newest live tensor of that size, else
    it is a tensor of the initial state released (the file names no tensor, so the pairing is a
    guess; the curve is the recorded one by construction).
    """
    timelines: dict[str, Timeline] = {}
    for component, entry in record.items():
        if "+" in component or component in ("APP", "WORKSPACE"):
            continue        # sums of the others, and the whole process: not one pool's events
        timeline = new_timeline(component, writer, True)
        live_by_size: dict[int, list[int]] = {}
        points = sorted((p for p in entry["points"] if p[0] is not None and p[1] is not None),
                        key=lambda p: (p[0], p[3]))
        last = None
        for time, allocated, reserved, line in points:
            if last is None:
                timeline.running = timeline.fig.allocated_first = last = allocated
                continue
            delta = allocated - last
            if delta > 0:
                live_by_size.setdefault(delta, []).append(line)
                timeline.feed((time, 1, line, delta, allocated, reserved, line, None, None, 0))
            elif delta < 0:
                ids = live_by_size.get(-delta)
                if ids:
                    timeline.feed((time, 0, ids.pop(), -delta, allocated, reserved, line, None, None, 0))
                else:
                    # an unseen release: the timeline makes it one of the initial state
                    timeline.feed((time, 0, -1, 0, allocated, reserved, line, None, None, 0))
            last = allocated
        timeline.finish()
        timeline.fig.rows = len(points)
        timelines[component] = timeline
    return timelines

"""Placement instances as CSV: ``id,lower,upper,size`` (the format of MiniMalloc and SOMAS exports).

One buffer per row, lifetime half-open ``[lower, upper)``, ``size`` in bytes. The header is
required; extra columns are allowed and ignored; ids are kept as strings (``"7"`` or ``"b7"``).

Example:
    >>> import io
    >>> read_instance(io.StringIO("id,lower,upper,size\\nb1,0,3,4\\n"))
    [Buffer(id='b1', lower=0, upper=3, size=4)]
"""
from __future__ import annotations

import csv
import os
import time
from pathlib import Path
from typing import IO, Iterable, Iterator, Mapping

from ms_memopt.core.errors import InputError
from ms_memopt.core.lines import open_text, read_head
from ms_memopt.core.placement import Buffer, range_problem
from ms_memopt.io.traces.fields import parse_int

__all__ = ["COLUMNS", "is_instance_header", "read_instance", "write_instance", "write_offsets", "looks_like_instance"]

COLUMNS = ("id", "lower", "upper", "size")


def is_instance_header(first_line: str) -> bool:
    """True when ``first_line`` is a CSV header holding the four instance columns."""
    try:
        cells = next(csv.reader([first_line]), [])
    except csv.Error:   # a bare CR inside the line, a field over csv.field_size_limit()
        return False
    names = {name.strip().lower().lstrip("\ufeff") for name in cells}
    return set(COLUMNS) <= names


def looks_like_instance(path: str | os.PathLike) -> bool:
    """True when the file's first line is an instance header (:func:`is_instance_header`)."""
    try:
        head = read_head(path, 65536)
    except InputError:
        return False
    return is_instance_header(head.decode("utf-8", errors="replace").split("\n", 1)[0])


def read_instance(source: str | os.PathLike | IO[str], *, deadline: float | None = None) -> list[Buffer]:
    """Read an ``id,lower,upper,size`` CSV into buffers, checking every row.

    Raises:
        InputError: with the file and 1-based line for: a missing file, an empty file, a
            missing header or column, a short row, a non-integer, a negative size,
            ``lower >= upper``, a duplicate id, or a header without any row; or reading still
            going at ``deadline`` (a ``time.perf_counter()`` value: ``pack --time-limit`` covers reading).
    """
    if isinstance(source, (str, os.PathLike)):
        name = str(source)
        if not os.path.lexists(name):
            raise InputError("no such file", source=name)
        # bounded lines, gzip as a stream, a pipe read once (core.lines)
        with open_text(source, expected="an id,lower,upper,size CSV file") as handle:
            return _read(handle, name, deadline)
    return _read(source, getattr(source, "name", "<instance>"), deadline)


def _rows(reader: Iterator[list[str]], name: str) -> Iterator[list[str]]:
    """``reader``'s rows, with its :class:`csv.Error` (a bare CR in a field, a field over
    ``csv.field_size_limit()``) as an :class:`InputError` naming the line."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise InputError(f"not a CSV row ({exc})", source=name, line=reader.line_num) from None
        yield row


def _read(handle: IO[str], name: str, deadline: float | None = None) -> list[Buffer]:
    reader = csv.reader(handle)
    rows = _rows(reader, name)
    header = next(rows, None)
    while header is not None and not any(cell.strip() for cell in header):
        header = next(rows, None)  # tolerate blank lines before the header
    if header is None:
        raise InputError("empty file; expected a header 'id,lower,upper,size' and one row per buffer",
                         source=name, line=1)
    header_line = reader.line_num
    columns = [cell.strip().lower() for cell in header]
    missing = [c for c in COLUMNS if c not in columns]
    if missing:
        raise InputError(f"header {','.join(header)!r} lacks column(s) {', '.join(missing)}; "
                         "expected 'id,lower,upper,size'", source=name, line=header_line)
    where = {c: columns.index(c) for c in COLUMNS}
    width = max(where.values()) + 1
    buffers: list[Buffer] = []
    seen: dict[str, int] = {}
    total = 0
    for row in rows:
        line = reader.line_num
        if deadline is not None and not line % 4096 and time.perf_counter() > deadline:
            raise InputError(f"the time limit ran out while reading ({len(buffers):,} rows read); give more time",
                             source=name, line=line, key="--time-limit")
        if not any(cell.strip() for cell in row):
            continue
        if len(row) < width:
            raise InputError(f"expected at least {width} columns ({','.join(header)}), got {len(row)}",
                             source=name, line=line)
        ident = row[where["id"]].strip()
        if not ident:
            raise InputError("empty id", source=name, line=line)
        lower = parse_int(row[where["lower"]], "column 'lower'", source=name, line=line)
        upper = parse_int(row[where["upper"]], "column 'upper'", source=name, line=line)
        size = parse_int(row[where["size"]], "column 'size'", source=name, line=line)
        if size < 0:
            raise InputError(f"buffer {ident!r}: size must be >= 0, got {size}", source=name, line=line)
        if lower >= upper:
            raise InputError(f"buffer {ident!r}: lower ({lower}) must be < upper ({upper}); "
                             "lifetimes are half-open [lower, upper)", source=name, line=line)
        if ident in seen:
            raise InputError(f"duplicate id {ident!r} (first on line {seen[ident]})", source=name, line=line)
        seen[ident] = line
        buffer = Buffer(ident, lower, upper, size)
        problem = range_problem(buffer, total)
        if problem:
            raise InputError(problem, source=name, line=line)
        total += size
        buffers.append(buffer)
    if not buffers:
        raise InputError("no buffers after the header; expected one row per buffer",
                         source=name, line=header_line)
    return buffers


def write_instance(buffers: Iterable[Buffer], target: str | os.PathLike | IO[str]) -> None:
    """Write buffers as an ``id,lower,upper,size`` CSV (readable by :func:`read_instance`)."""
    rows = [(b.id, b.lower, b.upper, b.size) for b in buffers]
    _write(target, COLUMNS, rows)


def write_offsets(offsets: Mapping[str, int], target: str | os.PathLike | IO[str]) -> None:
    """Write a placement as an ``id,offset`` CSV, in the mapping's order."""
    _write(target, ("id", "offset"), list(offsets.items()))


def _write(target: str | os.PathLike | IO[str], header: Iterable[str], rows: list) -> None:
    if isinstance(target, (str, os.PathLike)):
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        with open(target, "w", newline="", encoding="utf-8") as handle:
            _write(handle, header, rows)
        return
    writer = csv.writer(target, lineterminator="\n")
    writer.writerow(list(header))
    writer.writerows(rows)

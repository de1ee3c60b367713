"""One guarded JSON parse for every reader of JSON text (JSONL traces, scan logs, headers).

``json.loads`` raises more than :class:`json.JSONDecodeError` on hostile text: deep nesting
raises :class:`RecursionError`, an integer of more than 4300 digits a plain
:class:`ValueError` (Python's int/str conversion limit), and it accepts ``NaN`` and
``Infinity``, which are not JSON. :func:`parse_json` turns all of these into
:class:`~ms_memopt.core.errors.InputError` naming the file and line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from ms_memopt.core.errors import InputError

__all__ = ["parse_json", "read_json_lines"]


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(text: str | bytes, *, source: str | None = None, line: int | None = None) -> object:
    """Parse one JSON value; every way it can fail is an :class:`InputError`.

    Raises:
        InputError: not JSON, nested too deep, an integer too long to convert, or
            ``NaN``/``Infinity``; the message names ``source`` and ``line``.

    Example:
        >>> parse_json('{"size": 4096}')
        {'size': 4096}
    """
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise InputError(f"not a JSON value ({exc.msg})", source=source, line=line) from None
    except RecursionError:
        raise InputError("not a JSON value we read: nested too deeply", source=source, line=line) from None
    except ValueError as exc:   # int digit limit, NaN/Infinity, bad UTF-8 in bytes
        raise InputError(f"not a JSON value we read ({exc})", source=source, line=line) from None


def read_json_lines(path: str | Path) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for every complete line of a JSONL file.

    A torn last line (no newline: a writer killed mid-line) is dropped, blank lines are
    skipped. Every log this project writes is read through here.

    Raises:
        InputError: unreadable file, or a complete line that is not a JSON object (names the
            file and line).
    """
    source = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", source=source) from None
    text = data[: data.rfind(b"\n") + 1].decode("utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        obj = parse_json(line, source=source, line=number)
        if not isinstance(obj, dict):
            raise InputError("expected a JSON object per line", source=source, line=number)
        yield number, obj

"""One guarded JSON parse for every reader of JSON text (JSONL traces, scan logs, headers).

``json.loads`` raises more than :class:`json.JSONDecodeError` on hostile text: deep nesting
raises :class:`RecursionError`, an integer of more than 4300 digits a plain
:class:`ValueError` (Python's int/str conversion limit), and it accepts ``NaN`` and
``Infinity``, which are not JSON. :func:`parse_json` turns all of these into
:class:`~ms_memopt.core.errors.InputError` naming the file and line.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

from ms_memopt.core.errors import InputError
from ms_memopt.core.lines import iter_lines

__all__ = ["MAX_DEPTH", "parse_json", "read_json_lines", "json_depth"]

#: deepest JSON nesting accepted (our own files nest under 8; MindFormers' config.json under 5).
#: Bounded explicitly because the recursion limit is not ours: MindSpore raises it to 10000, and
#: a value nested that deep would then pass ``json.loads`` and exhaust the stack of whatever
#: walks it next.
MAX_DEPTH = 100
_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]')


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


# one decoder for every call: json.loads(..., parse_constant=...) builds a new one each time,
# a third of the cost of a short JSONL line
_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def parse_json(text: str | bytes, *, source: str | None = None, line: int | None = None) -> object:
    """Parse one JSON value; every way it can fail is an :class:`InputError`.

    Raises:
        InputError: not JSON, nested too deep, an integer too long to convert, or
            ``NaN``/``Infinity``; the message names ``source`` and ``line``.

    Example:
        >>> parse_json('{"size": 4096}')
        {'size': 4096}
    """
    if isinstance(text, bytes):
        opens = text.count(b"[") + text.count(b"{")
    else:
        opens = text.count("[") + text.count("{")
    if opens > MAX_DEPTH:       # a cheap count first: only text with many brackets is scanned
        depth = json_depth(text if isinstance(text, str) else text.decode("utf-8", "replace"))
        if depth > MAX_DEPTH:
            raise InputError(f"not a JSON value we read: nested too deeply (more than {MAX_DEPTH} levels)",
                             source=source, line=line)
    try:
        if isinstance(text, (bytes, bytearray)):
            text = text.decode("utf-8")     # as json.loads does, minus its BOM guessing
        return _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"not a JSON value ({exc.msg})", source=source, line=line) from None
    except RecursionError:
        raise InputError("not a JSON value we read: nested too deeply", source=source, line=line) from None
    except ValueError as exc:   # int digit limit, NaN/Infinity, bad UTF-8 in bytes
        raise InputError(f"not a JSON value we read ({exc})", source=source, line=line) from None


def json_depth(text: str) -> int:
    """The deepest bracket nesting of JSON ``text`` (brackets inside strings not counted), in one
    linear pass that stops once past :data:`MAX_DEPTH`.

    Example:
        >>> json_depth('{"a": [1, {"b": "[[["}]}')
        3
    """
    depth = deepest = 0
    for match in _BRACKETS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    break
        elif token in "]}":
            depth -= 1
    return deepest


def read_json_lines(path: str | Path) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for every complete line of a JSONL file.

    A torn last line (no newline: a writer killed mid-line) is dropped, blank lines are
    skipped. Every log this project writes is read through here.

    Raises:
        InputError: unreadable file, or a complete line that is not a JSON object (names the
            file and line).
    """
    source = str(path)
    for number, line in iter_lines(path, expected="a JSONL file", keep_torn=False):
        if not line.strip():
            continue
        obj = parse_json(line, source=source, line=number)
        if not isinstance(obj, dict):
            raise InputError("expected a JSON object per line", source=source, line=number)
        yield number, obj

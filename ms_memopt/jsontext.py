"""One guarded JSON parse for every reader of JSON text (JSONL traces, scan logs, headers).

``json.loads`` raises more than :class:`json.JSONDecodeError` on hostile text: deep nesting
raises :class:`RecursionError`, an integer of more than 4300 digits a plain
:class:`ValueError` (Python's int/str conversion limit), and it accepts ``NaN`` and
``Infinity``, which are not JSON. :func:`parse_json` turns all of these into
:class:`~ms_memopt.errors.InputError` naming the file and line.
"""
from __future__ import annotations

import json

from .errors import InputError

__all__ = ["parse_json"]


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

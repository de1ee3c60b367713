"""Integer and address fields as trace files write them: the readers' one parser.

Every :class:`~ms_memopt.core.errors.InputError` names the field, the file and the line.
"""
from __future__ import annotations

from ms_memopt.core.errors import InputError

__all__ = ["parse_int", "parse_address"]

_NULL_ADDRESSES = {"", "0", "(nil)", "nil", "null", "nullptr", "0x0"}


def parse_int(text: str, what: str, *, source: str | None = None, line: int | None = None,
              allow_hex: bool = False, non_negative: bool = False) -> int:
    """Parse a decimal integer field (with ``allow_hex`` also ``0x``-prefixed hex, as C++ prints pointers).

    The readers' one integer parser: the :class:`InputError` names ``what``, the file and the line.

    Example:
        >>> parse_int("512", "size"), parse_int("0x200", "addr", allow_hex=True)
        (512, 512)
    """
    text = text.strip()
    try:
        value = int(text, 16) if allow_hex and text[:2].lower() == "0x" else int(text, 10)
    except ValueError:
        raise InputError(f"{what}: expected an integer, got {text[:40]!r}", source=source, line=line) from None
    if non_negative and value < 0:
        raise InputError(f"{what}: expected a non-negative integer, got {text[:40]!r}", source=source, line=line)
    return value


def parse_address(text: str, *, source: str | None = None, line: int | None = None,
                  what: str = "device_addr") -> int | None:
    """Parse an address as C++ prints a pointer (``0x12c0``) or as a decimal integer.

    Returns ``None`` for a null pointer (``0``, ``(nil)``, empty).

    Example:
        >>> parse_address("0x12c041400000"), parse_address("4096"), parse_address("(nil)")
        (20616937734144, 4096, None)
    """
    if text.strip().lower() in _NULL_ADDRESSES:
        return None
    return parse_int(text, what, source=source, line=line, allow_hex=True, non_negative=True)

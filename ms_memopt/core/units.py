"""Sizes and counts as people write them, turned into integers (bytes inside, units at the edges).

Conventions (also in docs/metrics.md):

* ``KB``, ``MB``, ``GB``, ``TB`` are decimal (10**3 ...), ``KiB``, ``MiB``, ``GiB``, ``TiB``
  binary (2**10 ...), ``B`` or nothing is bytes. ``K``, ``M``, ``G``, ``T`` alone are binary,
  as in MindSpore's ``max_device_memory`` strings.
* Counts (parameters, tokens) accept ``7.5e9``, ``100B`` (billions), ``1.5M``, ``70b``.
"""
from __future__ import annotations

import math
import re

from ms_memopt.core.errors import InputError

__all__ = ["MAX_VALUE", "GRANULE", "short_repr", "parse_size", "parse_count", "format_size", "aligned"]

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")


#: the largest size or count we accept: a signed 64-bit integer, beyond any device or model
MAX_VALUE = 2**63 - 1


def short_repr(text: object) -> str:
    """``repr`` for messages, short even for a 5000-digit integer (whose ``repr`` would raise)."""
    if isinstance(text, int) and not isinstance(text, bool) and abs(text).bit_length() > 64:
        return f"an integer of about {'-' if text < 0 else ''}2**{abs(text).bit_length() - 1}"
    shown = repr(text)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _split(text: object, noun: str, source: str | None, key: str | None) -> tuple[int | float, str]:
    if isinstance(text, bool):
        raise InputError(f"expected a {noun}, got the boolean {short_repr(text)}", source=source, key=key)
    if isinstance(text, (int, float)):
        value, unit = text, ""    # an int stays exact: float(10**400) would overflow
    elif isinstance(text, str):
        match = _NUMBER.match(text)
        if not match:
            raise InputError(f"expected a {noun} such as '4.2GB', '512MiB' or '1048576', got {short_repr(text)}",
                             source=source, key=key)
        value, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise InputError(f"expected a {noun}, got {type(text).__name__} {short_repr(text)}", source=source, key=key)
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"expected a finite {noun}, got {short_repr(text)}", source=source, key=key)
    if value < 0:
        raise InputError(f"expected a non-negative {noun}, got {short_repr(text)}", source=source, key=key)
    return value, unit


def _scaled(value: int | float, factor: int, text: object, noun: str, source: str | None,
            key: str | None) -> int:
    """``value * factor`` rounded to an integer, refused beyond :data:`MAX_VALUE`."""
    if isinstance(value, int):
        result = value * factor
    else:
        product = value * factor
        result = int(round(product)) if product <= MAX_VALUE else MAX_VALUE + 1   # may be inf
    if result > MAX_VALUE:
        raise InputError(f"{noun} {short_repr(text)} is too large; expected at most {MAX_VALUE} (2**63 - 1)",
                         source=source, key=key)
    return result


def parse_size(text: object, *, source: str | None = None, key: str | None = None,
               positive: bool = False) -> int:
    """Parse a byte size: ``4.2GB``, ``512MiB``, ``96G``, ``1048576`` or a number.

    Returns:
        The size in bytes (rounded to the nearest byte).

    Raises:
        InputError: unknown unit, negative (or zero with ``positive``, as for a capacity),
            not a number, or more than :data:`MAX_VALUE` bytes; the message names
            ``source``/``key``.

    Example:
        >>> parse_size("512MiB"), parse_size("4.2GB"), parse_size(1024)
        (536870912, 4200000000, 1024)
    """
    value, unit = _split(text, "size", source, key)
    if unit not in _SIZE_UNITS:
        raise InputError(f"unknown size unit {unit!r} in {short_repr(text)}; expected one of "
                         "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB", source=source, key=key)
    nbytes = _scaled(value, _SIZE_UNITS[unit], text, "size", source, key)
    if positive and nbytes <= 0:
        raise InputError(f"expected a positive size, got {short_repr(text)}", source=source, key=key)
    return nbytes


def parse_count(text: object, *, source: str | None = None, key: str | None = None) -> int:
    """Parse a count: ``7.5e9``, ``100B`` (billions), ``1.5M``, ``4096``.

    Example:
        >>> parse_count("7.5e9"), parse_count("100B"), parse_count("70b")
        (7500000000, 100000000000, 70000000000)
    """
    value, unit = _split(text, "count", source, key)
    if unit not in _COUNT_UNITS:
        raise InputError(f"unknown count suffix {unit!r} in {short_repr(text)}; expected K, M, B (billions) or T",
                         source=source, key=key)
    return _scaled(value, _COUNT_UNITS[unit], text, "count", source, key)


def format_size(nbytes: int | float | None, *, digits: int = 2) -> str:
    """Human-readable binary size for logs and tables.

    Example:
        >>> format_size(4509715660)
        '4.20 GiB'
    """
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(nbytes)} B"
    if unit == "GiB" and abs(value) >= 1024:
        return f"{value / 1024:.{digits}f} TiB"
    return f"{value:.{digits}f} {unit}"


#: the granule every pool model rounds a request to (MindSpore's pools and PyTorch's caching allocator)
GRANULE = 512


def aligned(nbytes: int | float, granule: int = GRANULE) -> int:
    """``nbytes`` rounded up to a multiple of ``granule`` bytes, at least one granule.

    Example:
        >>> aligned(1), aligned(512), aligned(513), aligned(0)
        (512, 512, 1024, 512)
    """
    n = int(nbytes)
    return max(granule, -(-n // granule) * granule)

"""Pool layouts on disk: ``layouts.jsonl``, one :class:`LayoutSnapshot` a line, sizes and
addresses in bytes. Written by ``ms-memopt run`` and ``simulate --out``, drawn by
:func:`ms_memopt.report.memory_map.plot_memory_map`.

Example:
    >>> seg = Segment(0, 1024, [Block(0, 512, True, tag="activation"), Block(512, 512, False)])
    >>> snap = layout_from_dict(layout_to_dict(Layout([seg]), step=3, label="x"))
    >>> snap.step, snap.layout.segments[0].blocks[0].tag
    (3, 'activation')
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ms_memopt.core.errors import InputError
from ms_memopt.core.jsontext import read_json_lines
from ms_memopt.core.layout import DEVICE_ADDRESS_LIMIT, Block, Layout, Segment

__all__ = ["LAYOUTS_NAME", "LayoutSnapshot", "layout_to_dict", "layout_from_dict", "read_layouts", "write_layouts"]

LAYOUTS_NAME = "layouts.jsonl"


@dataclass
class LayoutSnapshot:
    """A pool layout at one step, with a label for the memory map (``"baseline step 300"``)."""
    step: int
    label: str
    layout: Layout


def layout_to_dict(layout: Layout, *, step: int, label: str) -> dict:
    """One JSON object of ``layouts.jsonl``: blocks as ``[addr, size, live, tag]``, bytes.

    Example:
        >>> seg = Segment(0, 1024, [Block(0, 512, True, tag="activation"), Block(512, 512, False)])
        >>> layout_to_dict(Layout([seg]), step=3, label="x")["segments"][0]["blocks"][0]
        [0, 512, True, 'activation']
    """
    return {"step": int(step), "label": label, "capacity": layout.capacity,
            "segments": [{"addr": s.addr, "size": s.size, "stream": s.stream, "pool": s.pool,
                          "blocks": [[b.addr, b.size, bool(b.live), b.tag] for b in s.blocks]}
                         for s in layout.segments]}


def _tag(tag: object) -> str | None:
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"a block tag must be a string or null, got {tag!r:.40}")
    return tag


def _bytes(value) -> int:
    """An address or size of a layout record: an integer in [0, DEVICE_ADDRESS_LIMIT)."""
    number = int(value)
    if not 0 <= number < DEVICE_ADDRESS_LIMIT:
        raise ValueError(f"{value!r} is outside [0, 2**48)")
    return number


def layout_from_dict(obj: dict, *, source: str = "<layout>", line: int | None = None) -> LayoutSnapshot:
    """Inverse of :func:`layout_to_dict`.

    Raises:
        InputError: a field missing or of the wrong type (names the file and line).
    """
    try:
        segments = []
        for s in obj["segments"]:
            blocks = [Block(_bytes(a), _bytes(n), bool(live), tag=_tag(tag)) for a, n, live, tag in s["blocks"]]
            segments.append(Segment(_bytes(s["addr"]), _bytes(s["size"]), blocks, stream=int(s.get("stream", 0)),
                                    pool=str(s.get("pool", "common"))))
        capacity = obj.get("capacity")
        layout = Layout(segments, capacity=None if capacity is None else int(capacity))
        step = int(obj["step"])
        return LayoutSnapshot(step=step, label=str(obj.get("label") or f"step {step}"), layout=layout)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:    # OverflowError: int(inf)
        raise InputError(f"not a layout record ({type(exc).__name__}: {exc}); expected step, segments "
                         f"[{{addr, size, blocks: [[addr, size, live, tag], ...]}}]", source=source,
                         line=line) from None


def write_layouts(path: str | Path, snapshots: Iterable[LayoutSnapshot]) -> Path:
    """Write snapshots as ``layouts.jsonl`` (one object per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for snap in snapshots:
            f.write(json.dumps(layout_to_dict(snap.layout, step=snap.step, label=snap.label)) + "\n")
    return path


def read_layouts(directory_or_file: str | Path, *, at_most: int | None = None) -> list[LayoutSnapshot]:
    """Snapshots from ``layouts.jsonl`` (a directory's, its ``rank_N/``'s, or the file given);
    a torn last line is ignored. Empty list when there is none.

    ``at_most``: keep no more than this many, evenly spread over the file (every k-th, k doubling
    as the file goes on), so memory stays bounded whatever the number of lines; every line is
    still checked.
    """
    path = Path(directory_or_file)
    files = [path] if path.is_file() else sorted([path / LAYOUTS_NAME, *path.glob(f"rank_*/{LAYOUTS_NAME}")])
    out: list[LayoutSnapshot] = []
    stride, seen = 1, 0
    for file in files:
        if not file.is_file():
            continue
        for number, obj in read_json_lines(file):
            snapshot = layout_from_dict(obj, source=str(file), line=number)
            seen += 1
            if at_most is None or (seen - 1) % stride == 0:
                out.append(snapshot)
            if at_most is not None and len(out) > at_most:
                out = out[::2]
                stride *= 2
    return out

"""MindSpore pool layouts: the Ascend pool's debug dump, and the layout at a moment of a trace.

**``MemoryDebugInfo<N>.txt``** is written by ``AbstractDynamicMemPool::DumpDynamicMemPoolDebugInfo``
(on an allocation failure, and at every defrag step when ``MS_ALLOC_CONF`` has
``defrag_memory_step_freq`` with ``dump``) under the tracker path. Its shape, from MindSpore's
source (``abstract_dynamic_mem_pool.cc``, ``dynamic_mem_pool.h``)::

    The dynamic memory pool stat info : {"in used mem":1.00MB,"peak used mem":...}
    \tIn used mem buf info for <allocator>, mem_bufs size : 2
    \t\t{"addr_":0x12c0...,"size_":1024,"stream_id_":0,"status_":used,"owner_name_":...,"alloc_type_":...}
    stream id : 0, is persistent : 0
    Dump debug info for <allocator>
    \tMem block info - total count : 1
    \t\t{"addr_":0x12c0...,"size_":1073741824,"stream_id_":0,"min_addr_":...,"max_addr_":...}
    \tFree mem buf info - total count : 1
    \t\t{mem buf}
    \tEager free mem buf info - total count : 0

``<allocator>`` is ``Mem buf allocator, enable vmm : 0, is persistent : 0, stream id : 0.``
(newer releases append ``, is small : 0, is customized : 0``). The "JSON" is not JSON: values
are printed raw (pointers as ``0x...``, strings unquoted), so each buffer line is matched
against the fixed key sequence. ``status_`` is ``used``, ``used_by_event``, ``idle`` or
``eager_free``.

:func:`read_pool_debug_dump` returns a :class:`~ms_memopt.core.layout.Layout`: one segment per pool
block (``pool`` = ``"persistent"``, ``"small"`` or ``"common"``), live blocks for ``used`` and
``used_by_event`` buffers (the latter ``pinned``: freed by the program but still awaited by a
stream event), and free blocks for ``idle`` and ``eager_free`` buffers. Adjacent idle and
eager-free buffers are merged into one free block: on a failed request the pool eager-frees every
idle buffer, which merges them, so together they bound the largest request it can serve.

**:func:`layout_at`** rebuilds the pool at one moment of a recorded trace (a memory_block.csv)
from the pool blocks' base addresses and sizes, as ``ms.runtime.memory_stats()`` reports them
on Ascend (``common_mem_pool_stats["blocks_info"]``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from ms_memopt.core.errors import InputError
from ms_memopt.core.lines import open_input
from ms_memopt.core.events import Trace
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.io.traces.fields import parse_address

__all__ = ["FORMAT", "looks_like_pool_debug_dump", "read_pool_debug_dump", "layout_at", "address_of"]

FORMAT = "mindspore-pool-debug-dump"
# decimal fields: at most 20 digits (2**64 has 20); a longer run is not a MindSpore number, and
# int() of thousands of digits raises ValueError (CPython's int_max_str_digits)
_N = r"\d{1,20}"
_STAT = re.compile(r"^The dynamic memory pool(?:\[[^\]]*\])? stat info\s*:")
_IN_USE = re.compile(r"^In used mem buf info for (?P<allocator>.*), mem_bufs size : (?P<count>" + _N + r")\s*$")
_STREAM = re.compile(r"^stream id : (?P<stream>" + _N + r"), is persistent : (?P<persistent>\S+)\s*$")
_DEBUG = re.compile(r"^Dump debug info for (?P<allocator>.*?)\s*$")
_SECTION = re.compile(r"^(?P<what>Mem block info|Free mem buf info|Eager free mem buf info) - total count : "
                      r"(?P<count>" + _N + r")\s*$")
_BUF = re.compile(r'^\{"addr_":(?P<addr>[^,]*),"size_":(?P<size>' + _N + r'),"stream_id_":(?P<stream>' + _N + r'),'
                  r'"status_":(?P<status>[^,]*),"owner_name_":(?P<owner>.*),"alloc_type_":(?P<type>[^,]*)\}$')
_BLOCK = re.compile(r'^\{"addr_":(?P<addr>[^,]*),"size_":(?P<size>' + _N + r'),"stream_id_":(?P<stream>' + _N + r')'
                    r'(?:,"min_addr_":[^,]*,"max_addr_":[^,]*)?\}$')
_LIVE = {"used", "used_by_event"}
_FREE = {"idle", "eager_free"}


def looks_like_pool_debug_dump(first_line: str) -> bool:
    """True when ``first_line`` opens a MemoryDebugInfo dump."""
    return bool(_STAT.match(first_line.lstrip("\ufeff").strip()))


def _allocator_key(brief: str, source: str, line: int) -> tuple[bool, int, bool]:
    """(persistent, stream, small) from ``Mem buf allocator, enable vmm : 0, is persistent : 1, ...``."""
    def flag(name: str) -> str | None:
        match = re.search(name + r" : (\w+)", brief)
        return match.group(1) if match else None
    persistent = flag("is persistent") in ("1", "true")
    stream = flag("stream id")
    small = flag("is small") in ("1", "true")
    if stream and stream.isdigit() and len(stream) > 20:
        raise InputError(f"stream id: expected a number below 2**64, got {len(stream)} digits", source=source, line=line)
    return persistent, int(stream) if stream and stream.isdigit() else 0, small


class _Buf:
    __slots__ = ("addr", "size", "status", "tag", "line")

    def __init__(self, addr: int, size: int, status: str, tag: str | None, line: int) -> None:
        self.addr, self.size, self.status, self.tag, self.line = addr, size, status, tag, line


def read_pool_debug_dump(path: str | Path) -> Layout:
    """Read ``MemoryDebugInfo<N>.txt`` into a layout: pool blocks with their buffers.

    Raises:
        InputError: an unknown line, a count that does not match the lines after it, a buffer
            outside every block of its allocator, or overlapping buffers (file and line named).

    Example:
        >>> layout = read_pool_debug_dump("tests/data/MemoryDebugInfo0.txt")   # doctest: +SKIP
        >>> layout.reserved                                                     # doctest: +SKIP
        3221225472
    """
    source = str(path)
    with open_input(path, expected="a MindSpore MemoryDebugInfo dump") as handle:
        lines = handle.read().splitlines()
    if not lines or not looks_like_pool_debug_dump(lines[0]):
        raise InputError("expected the first line 'The dynamic memory pool stat info : {...}' of a "
                         "MemoryDebugInfo dump", source=source, line=1)
    blocks: dict[tuple[bool, int, bool], list[tuple[int, int, int]]] = {}
    bufs: dict[tuple[bool, int, bool], list[_Buf]] = {}
    number = 1
    allocator: tuple[bool, int, bool] | None = None

    def take(count: int, pattern: re.Pattern, what: str) -> list[tuple[re.Match, int]]:
        nonlocal number
        out = []
        for _ in range(count):
            number += 1
            if number > len(lines):
                raise InputError(f"file ends inside a list: expected {count} {what} lines", source=source,
                                 line=number - 1)
            match = pattern.match(lines[number - 1].strip())
            if not match:
                raise InputError(f"expected a {what} line {{\"addr_\":...,\"size_\":...}}, got "
                                 f"{lines[number - 1].strip()[:60]!r}", source=source, line=number)
            out.append((match, number))
        return out

    def buf_of(match: re.Match, line: int) -> _Buf:
        addr = parse_address(match["addr"], source=source, line=line, what="addr_")
        status = match["status"].strip()
        if addr is None:
            raise InputError("addr_: expected a non-null address", source=source, line=line)
        if status not in _LIVE | _FREE:
            raise InputError(f"status_: expected one of used, used_by_event, idle, eager_free, got {status[:30]!r}",
                             source=source, line=line)
        return _Buf(addr, int(match["size"]), status, match["type"].strip() or None, line)

    while number < len(lines):
        number += 1
        text = lines[number - 1].strip()
        if not text:
            continue
        if match := _IN_USE.match(text):
            key = _allocator_key(match["allocator"], source, number)
            for buf_match, line in take(int(match["count"]), _BUF, "mem buf"):
                bufs.setdefault(key, []).append(buf_of(buf_match, line))
        elif _STREAM.match(text):
            continue
        elif match := _DEBUG.match(text):
            allocator = _allocator_key(match["allocator"], source, number)
            blocks.setdefault(allocator, [])
        elif match := _SECTION.match(text):
            if allocator is None:
                raise InputError(f"{match['what']} before any 'Dump debug info for' line", source=source, line=number)
            if match["what"] == "Mem block info":
                for block_match, line in take(int(match["count"]), _BLOCK, "mem block"):
                    addr = parse_address(block_match["addr"], source=source, line=line, what="addr_")
                    if addr is None:
                        raise InputError("addr_: expected a non-null block address", source=source, line=line)
                    blocks[allocator].append((addr, int(block_match["size"]), int(block_match["stream"])))
            else:
                for buf_match, line in take(int(match["count"]), _BUF, "mem buf"):
                    bufs.setdefault(allocator, []).append(buf_of(buf_match, line))
        elif _STAT.match(text) or text.startswith("Tiny allocator"):
            continue
        else:
            raise InputError(f"unexpected line in a MemoryDebugInfo dump: {text[:60]!r}", source=source, line=number)
    return _assemble(blocks, bufs, source)


def _pool_name(key: tuple[bool, int, bool]) -> str:
    persistent, _, small = key
    return "persistent" if persistent else ("small" if small else "common")


def _assemble(blocks, bufs, source: str) -> Layout:
    segments: list[Segment] = []
    for key in sorted(set(blocks) | set(bufs)):
        own = sorted(blocks.get(key, []))
        starts = [b[0] for b in own]
        placed: dict[int, list[_Buf]] = {addr: [] for addr in starts}
        for buf in bufs.get(key, []):
            home = _containing(own, buf.addr, buf.size)
            if home is None:
                raise InputError(f"mem buf at {buf.addr:#x} (+{buf.size}) lies in no mem block of its allocator",
                                 source=source, line=buf.line)
            placed[home].append(buf)
        for addr, size, stream in own:
            segments.append(Segment(addr, size, _tile(addr, size, placed[addr], source), stream=stream,
                                    pool=_pool_name(key)))
    segments.sort(key=lambda s: s.addr)
    for left, right in zip(segments, segments[1:]):
        if right.addr < left.end:
            raise InputError(f"mem blocks at {left.addr:#x} and {right.addr:#x} overlap", source=source)
    return Layout(segments)


def _containing(own: list[tuple[int, int, int]], addr: int, size: int) -> int | None:
    for base, length, _ in own:
        if base <= addr and addr + size <= base + length:
            return base
    return None


def _tile(base: int, size: int, items: list, source: str) -> list[Block]:
    """Blocks tiling ``[base, base + size)``: the live items, and free space merged between them."""
    out: list[Block] = []
    cursor = base
    free_tags: set[str] = set()

    def close_free(upto: int) -> None:
        nonlocal cursor
        if upto > cursor:
            tag = "+".join(sorted(free_tags)) if free_tags else None
            if out and not out[-1].live:
                out[-1].size += upto - cursor
            else:
                out.append(Block(cursor, upto - cursor, live=False, tag=tag))
            cursor = upto
        free_tags.clear()

    for item in sorted(items, key=lambda b: b.addr):
        if item.status in _FREE:
            free_tags.add(item.status)  # free space is whatever no live buffer holds
            continue
        if item.addr < cursor:
            raise InputError(f"buffer at {item.addr:#x} overlaps the live one before it", source=source,
                             line=item.line)
        close_free(item.addr)
        out.append(Block(item.addr, item.size, live=True, tag=item.tag, pinned=item.status == "used_by_event",
                         id=getattr(item, "id", None)))
        cursor = item.addr + item.size
    close_free(base + size)
    return out


class _Live:
    __slots__ = ("addr", "size", "status", "tag", "id", "line")

    def __init__(self, addr: int, size: int, tag: str | None, id: int | None) -> None:
        self.addr, self.size, self.status, self.tag, self.id, self.line = addr, size, "used", tag, id, None


def address_of(key: Any) -> int:
    """An address from an int, a hex/decimal string or a PyCapsule (``memory_stats()`` keys)."""
    if isinstance(key, bool):
        raise InputError(f"expected a block address, got {key!r}", key="block_bases")
    if isinstance(key, int):
        return key
    if isinstance(key, str):
        value = parse_address(key, what="block address")
        if value is None:
            raise InputError("expected a non-null block address", key="block_bases")
        return value
    if type(key).__name__ == "PyCapsule":
        import ctypes

        api = ctypes.pythonapi
        api.PyCapsule_GetName.restype = ctypes.c_char_p
        api.PyCapsule_GetName.argtypes = [ctypes.py_object]
        api.PyCapsule_GetPointer.restype = ctypes.c_void_p
        api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        try:
            pointer = api.PyCapsule_GetPointer(key, api.PyCapsule_GetName(key))
        except (ValueError, TypeError) as exc:  # a capsule whose name does not match its pointer
            raise InputError(f"cannot read the block address from a PyCapsule: {exc}", key="block_bases") from None
        if not pointer:
            raise InputError("expected a non-null block address, got a null PyCapsule", key="block_bases")
        return int(pointer)
    raise InputError(f"expected a block address (int, '0x...' or PyCapsule), got {type(key).__name__}",
                     key="block_bases")


def _block_list(bases: Mapping | Iterable | None) -> list[tuple[int, int, int]]:
    if bases is None:
        return []
    items = bases.items() if isinstance(bases, Mapping) else bases
    out = []
    for entry in items:
        try:
            key, value = entry
        except (TypeError, ValueError):
            raise InputError(f"expected (address, size) pairs, got {entry!r}", key="block_bases") from None
        stream = 0
        if isinstance(value, Mapping):
            size = value.get("block_memory_size")
            stream = int(value.get("block_stream_id", 0) or 0)
        else:
            size = value
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InputError(f"block size: expected a positive integer, got {size!r}", key="block_bases")
        out.append((address_of(key), size, stream))
    return out


def layout_at(trace: Trace, time: float, block_bases: Mapping | Iterable, *,
              persistent_bases: Mapping | Iterable | None = None, strict: bool = True) -> Layout:
    """The pool layout alive at ``time`` in ``trace``, inside the given pool blocks.

    Args:
        trace: a trace with addresses and times (e.g. from a memory_block.csv).
        time: a moment in the trace's clock; allocations with ``time <= t`` that are not freed by
            ``t`` are live.
        block_bases: the common pool's blocks: ``{base: size}``, ``{base: {"block_memory_size":
            size, "block_stream_id": s}}`` (``memory_stats()["common_mem_pool_stats"]["blocks_info"]``,
            PyCapsule keys accepted) or ``[(base, size), ...]``.
        persistent_bases: the persistent pool's blocks, same forms (``pool="persistent"``).
        strict: raise when a live allocation lies in no block or overlaps another; when False
            such allocations are left out.

    Returns:
        A layout: one segment per block, live blocks for live allocations (``id`` = event id,
        ``tag`` = the allocation's tag), free blocks between them.

    Example:
        >>> from ms_memopt.core.events import Event, Trace
        >>> trace = Trace([Event("alloc", id=1, size=512, addr=4096, time=1)])
        >>> [b.live for b in layout_at(trace, 1, {4096: 2048}).segments[0].blocks]
        [True, False]
    """
    live: dict[int, _Live] = {}
    for event in trace.events:
        if event.time is None:
            raise InputError("the trace has events without times; layout_at needs timed events", source=trace.source)
        if event.time > time:
            break
        if event.action == "alloc" and event.addr is not None:
            live[event.id] = _Live(event.addr, event.size, event.tag, event.id)
        elif event.action == "free":
            live.pop(event.id, None)
    segments = [(addr, size, stream, "common") for addr, size, stream in _block_list(block_bases)]
    segments += [(addr, size, stream, "persistent") for addr, size, stream in _block_list(persistent_bases)]
    segments.sort()
    placed: dict[int, list[_Live]] = {s[0]: [] for s in segments}
    own = [(addr, size, stream) for addr, size, stream, _ in segments]
    for item in sorted(live.values(), key=lambda b: b.addr):
        home = _containing(own, item.addr, item.size)
        if home is None:
            if strict:
                raise InputError(f"allocation {item.id} at {item.addr:#x} (+{item.size}) lies in no given pool "
                                 "block", source=trace.source)
            continue
        bucket = placed[home]
        if bucket and item.addr < bucket[-1].addr + bucket[-1].size:
            if strict:
                raise InputError(f"allocations {bucket[-1].id} and {item.id} overlap at {item.addr:#x}",
                                 source=trace.source)
            continue
        bucket.append(item)
    out = [Segment(addr, size, _tile(addr, size, placed[addr], trace.source), stream=stream, pool=pool)
           for addr, size, stream, pool in segments]
    for left, right in zip(out, out[1:]):
        if right.addr < left.end:
            raise InputError(f"pool blocks at {left.addr:#x} and {right.addr:#x} overlap", key="block_bases")
    return Layout(out)

"""Trace readers: every recorded format becomes one :class:`~ms_memopt.core.events.Trace`.

:func:`load_trace` recognises the format by the file's content, not its name:

==========================  =================================================================
``torch-snapshot``          a pickle (``torch.cuda.memory._dump_snapshot``), read with a
                            restricted unpickler by :mod:`ms_memopt.io.traces.torch_snapshot`
``jsonl``                   our own event log: first line ``{"format": "ms-memopt-events", ...}``
``mindspore-memory-block``  MindSpore memory tracker ``memory_block.csv``
``msmemscope``              Huawei msMemScope dump CSV
``instances``               offline placement instances ``id,lower,upper,size``
``mindspore-pool-log``      a stderr capture of a run with ``VLOG_v=12906`` (MindSpore's pool
                            log; unrelated lines allowed; ``.gz`` too), read by
                            :mod:`ms_memopt.io.traces.ms_pool_log`
``ascend-profiler``         the Ascend profiler's memory output (torch_npu or MindSpore,
                            ``profile_memory=True``): a rank's folder, ``ASCEND_PROFILER_OUTPUT/``,
                            ``operator_memory.csv``, ``memory_record.csv``, ``npu_module_mem.csv``
                            or ``ascend_*_profiler_N.db``, read by
                            :mod:`ms_memopt.io.traces.ascend_profiler`
==========================  =================================================================

Empty, binary, unreadable and unknown files raise :class:`~ms_memopt.core.errors.InputError` naming
the file (and line) and what was expected. See docs/traces.md.

Example:
    >>> trace = load_trace("tests/data/memory_block_2.10.csv")            # doctest: +SKIP
    >>> trace.format                                                        # doctest: +SKIP
    'mindspore-memory-block'
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import JSONL_FORMAT, Trace
from ms_memopt.core.jsontext import parse_json
from ms_memopt.core.lines import read_head

__all__ = ["FORMATS", "STREAMERS", "load_trace", "detect_format"]

# name -> (what it is, "module:function" reading a path into a Trace)
FORMATS: dict[str, tuple[str, str]] = {
    "torch-snapshot": ("PyTorch / torch_npu memory snapshot pickle",
                       "ms_memopt.io.traces.torch_snapshot:read_torch_snapshot"),
    "jsonl": ("ms-memopt JSONL event log", "ms_memopt.core.events:read_jsonl"),
    "mindspore-memory-block": ("MindSpore memory tracker memory_block.csv",
                               "ms_memopt.io.traces.memory_block:read_memory_block"),
    "msmemscope": ("msMemScope dump CSV", "ms_memopt.io.traces.msmemscope:read_msmemscope"),
    "instances": ("placement instances id,lower,upper,size", "ms_memopt.io.traces.instances_events:read_instances_trace"),
    "mindspore-pool-log": ("stderr of a MindSpore run with VLOG_v=12906 (the pool's log)",
                           "ms_memopt.io.traces.ms_pool_log:read_pool_log"),
    "ascend-profiler": ("the Ascend profiler's memory output (a rank's folder, ASCEND_PROFILER_OUTPUT/, "
                        "operator_memory.csv, memory_record.csv, npu_module_mem.csv or the .db)",
                        "ms_memopt.io.traces.ascend_profiler:read_ascend_profiler"),
}
_EXPECTED = ("a PyTorch snapshot pickle, an ms-memopt JSONL log, a MindSpore memory_block.csv, "
             "an msMemScope CSV, an id,lower,upper,size instance CSV, the stderr of a MindSpore "
             "run with VLOG_v=12906 or the Ascend profiler's memory output (folder, CSV or .db)")
_SNIFF_BYTES = 65536


def detect_format(path: str | Path) -> str:
    """The :data:`FORMATS` name of the file at ``path``, judged by its first bytes.

    Raises:
        InputError: unreadable, empty, binary or of no known format.
    """
    source = str(path)
    if Path(path).is_dir():
        from ms_memopt.io.traces.ascend_profiler import is_profiler_dir

        if is_profiler_dir(path):
            return "ascend-profiler"
        raise InputError("is a directory; expected a trace file or the Ascend profiler's output of one rank "
                         "(a folder holding ASCEND_PROFILER_OUTPUT/)", source=source)
    # a pipe's head is kept (core.lines): the reader opened next still starts at its first byte
    head = read_head(path, _SNIFF_BYTES, expected="a trace file")
    if not head.strip():
        raise InputError(f"empty file; expected {_EXPECTED}", source=source)
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        return "torch-snapshot"
    if head[:2] == b"\x1f\x8b":
        from ms_memopt.io.traces.ms_pool_log import looks_like_pool_log

        unzipped = read_head(path, _SNIFF_BYTES, expected="a trace file", gunzip=True)
        if looks_like_pool_log(unzipped.decode("utf-8", errors="replace")):
            return "mindspore-pool-log"
        raise InputError(f"gzip data of no known format; expected {_EXPECTED}", source=source)
    from ms_memopt.io.traces.ascend_profiler import is_sqlite, profiler_file_kind

    if is_sqlite(head):
        return "ascend-profiler"      # the reader names the tables it needs when they are absent
    text = head.decode("utf-8", errors="replace")
    if b"\x00" in head or text.count("\ufffd") > max(2, len(text) // 100):
        raise InputError(f"binary data of no known format; expected {_EXPECTED}", source=source)
    first_line = text.lstrip("\ufeff").split("\n", 1)[0].strip()
    from ms_memopt.io.traces.instances import is_instance_header
    from ms_memopt.io.traces.memory_block import looks_like_memory_block
    from ms_memopt.io.traces.ms_debug_dump import looks_like_pool_debug_dump
    from ms_memopt.io.traces.ms_pool_log import looks_like_pool_log
    from ms_memopt.io.traces.msmemscope import looks_like_msmemscope

    if first_line.startswith("{"):
        try:
            header = parse_json(first_line, source=source, line=1)
        except InputError:
            header = None
        if isinstance(header, dict) and header.get("format") == JSONL_FORMAT:
            return "jsonl"
        raise InputError(f'a JSON line that is not the ms-memopt header {{"format": "{JSONL_FORMAT}", ...}}; '
                         f"expected {_EXPECTED}", source=source, line=1)
    if profiler_file_kind(first_line) is not None:
        return "ascend-profiler"
    if looks_like_memory_block(first_line):
        return "mindspore-memory-block"
    if looks_like_msmemscope(first_line):
        return "msmemscope"
    if is_instance_header(first_line):
        return "instances"
    if looks_like_pool_log(text):     # a raw stderr capture: the first line may be anything
        return "mindspore-pool-log"
    if looks_like_pool_debug_dump(first_line):
        raise InputError("a MindSpore pool debug dump (MemoryDebugInfo*.txt) is a layout, not an event "
                         "trace; read it with ms_memopt.io.traces.ms_debug_dump.read_pool_debug_dump",
                         source=source, line=1)
    shown = first_line[:80] + ("..." if len(first_line) > 80 else "")
    raise InputError(f"unknown trace format (first line {shown!r}); expected {_EXPECTED}", source=source, line=1)



def _reader(name: str) -> Callable[[str | Path], Trace]:
    module_name, function = FORMATS[name][1].split(":")
    return getattr(importlib.import_module(module_name), function)


#: formats that can be read as a stream (``load_trace(..., stream=True)``): "module:function"
STREAMERS: dict[str, str] = {
    "mindspore-pool-log": "ms_memopt.io.traces.ms_pool_log:stream_pool_log",
    "jsonl": "ms_memopt.core.events:stream_jsonl",
    "ascend-profiler": "ms_memopt.io.traces.ascend_profiler:stream_ascend_profiler",
}


def load_trace(path: str | Path, *, format: str | None = None, stream: bool = False) -> Trace:
    """Read the trace at ``path``; ``format`` (a :data:`FORMATS` name) skips detection.

    With ``stream``, a format of :data:`STREAMERS` gives a trace whose ``events`` are an iterable
    that reads the file as it is iterated (memory: the reader's state, never the file; what the
    reader learns at the end, such as a pool log's final layout and counts, is set on the trace
    when the iteration ends); other formats are read whole as without it.

    Returns:
        The :class:`Trace`; ``trace.format`` names the reader used.

    Raises:
        InputError: unknown format name, unreadable/empty/binary/unknown file, or a file the
            reader rejects; the message names the file (and line) and what was expected.
    """
    source = str(path)
    if format is None:
        format = detect_format(path)
    elif format not in FORMATS:
        raise InputError(f"unknown trace format {format!r}; expected one of {', '.join(FORMATS)}", key="--format")
    if stream and format in STREAMERS:
        module_name, function = STREAMERS[format].split(":")
        trace = getattr(importlib.import_module(module_name), function)(path)
    else:
        trace = _reader(format)(path)
    if not trace.format:
        trace.format = format
    if not trace.source:
        trace.source = source
    return trace

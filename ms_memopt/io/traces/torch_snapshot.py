"""Read PyTorch / torch_npu memory snapshots (``torch.cuda.memory._dump_snapshot()`` pickles).

A snapshot is a pickled dict ``{"segments": [...], "device_traces": [[...], ...], ...}``:
the segments and blocks at the moment of the dump, and per device the recorded trace of
``alloc`` / ``free_requested`` / ``free_completed`` / ``segment_alloc`` / ``segment_free`` /
``oom`` / ``snapshot`` entries. Newer files add ``time_us`` to trace entries and
``allocator_settings`` at the top; older ones lack both. torch_npu writes the same shape.

Snapshots are untrusted input: a pickle can run any callable while it loads. They are read
with :class:`SafeUnpickler`, which refuses every global, so only builtin containers and scalars
(dict, list, tuple, str, bytes, int, float, bool, None) can come out and nothing is called.

Mapping to :class:`~ms_memopt.core.events.Event`:

* ``alloc`` -> ``alloc`` with the recorded ``addr`` and a fresh ``id`` (``time`` in seconds
  from ``time_us`` when present);
* ``free_completed`` (and the oldest files' ``free``) -> ``free`` of the latest live ``alloc``
  at that address: the block becomes reusable only once the stream has finished with it, so
  ``free_requested`` is left out;
* ``segment_alloc`` / ``segment_free`` / ``segment_map`` / ``segment_unmap`` -> the same
  actions (the last two: expandable segments' pages mapped and unmapped);
* ``oom`` and ``snapshot`` are skipped (counted in ``meta``).

``meta`` says who recorded it (:mod:`~ms_memopt.io.traces.torch_origin`): ``framework``
(``torch_npu`` or ``torch``), ``expandable_segments``, each with its ``..._evidence``; for a
snapshot ms-memopt wrote (:mod:`~ms_memopt.io.traces.memory_viz`), ``allocator`` (the model that
placed the blocks, e.g. ``mindspore``), ``allocator_options`` and ``recorded_by`` (what made it).

Recording often starts after segments already exist. ``Trace.initial`` is the reconstructed
start state (see :func:`reconstruct_initial`), ``Trace.final`` the recorded segments.

Example:
    >>> trace = read_torch_snapshot("memory_snapshot.pickle")      # doctest: +SKIP
    >>> trace.format, len(trace.final.segments)                      # doctest: +SKIP
    ('torch-snapshot', 215)
"""
from __future__ import annotations

import bisect
from bisect import bisect_left
import gc
import io
import math
import os
import pickle
import pickletools
from pathlib import Path

from ms_memopt.core import _build_hash
from ms_memopt.core.consistency import TraceChecker
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event, Trace
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.core.sortedkeys import SortedKeys
from ms_memopt.core.lines import open_binary
from ms_memopt.core.units import short_repr
from ms_memopt.io.traces.memory_viz import POOL_KEY, RECORDED_BY, STEP_KEY
from ms_memopt.io.traces.torch_origin import NPU_PAD, snapshot_origin

__all__ = ["SafeUnpickler", "safe_load", "recorded_by", "pickle_nesting", "nesting_reference", "MAX_NESTING", "read_torch_snapshot", "looks_like_torch_snapshot",
           "reconstruct_initial", "LIVE_STATES", "round_request"]

FORMAT = "torch-snapshot"
#: block states that hold memory (the block is not reusable yet)
LIVE_STATES = frozenset({"active_allocated", "active_pending_free", "active_awaiting_free"})
_ALL_STATES = LIVE_STATES | {"inactive"}
_MIN_BLOCK = 512
_SMALL_SIZE = 1 << 20          # requests <= 1 MiB go to the small pool
_SMALL_SEGMENT = 2 << 20       # small-pool segments are exactly 2 MiB
_SKIPPED_ACTIONS = ("oom", "snapshot", "free_requested")
_LARGE_PAGE = 20 << 20         # expandable segments map the large pool in 20 MiB pages


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that refuses every global: no class, function or module is ever looked up.

    Pickle's only ways to run code (``REDUCE``, ``BUILD``, ``INST``, ``OBJ``, ``NEWOBJ``) need
    a callable, and callables only come from ``find_class``; refusing it leaves the builtin
    containers and scalars the opcodes build directly.

    Example:
        >>> SafeUnpickler(io.BytesIO(pickle.dumps({"a": [1, 2.0, None]}))).load()
        {'a': [1, 2.0, None]}
    """

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle's hook
        raise pickle.UnpicklingError(f"refused to load global {module}.{name}: "
                                     "snapshots may only hold builtin containers and scalars")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused a persistent id: snapshots may not reference external objects")


#: deepest container nesting a snapshot may have (PyTorch's are 7 deep: dict, list, dict,
#: list, dict of a frame...); checked on the opcodes before anything is built
MAX_NESTING = 64
#: largest snapshot read, in bytes (a pickle is read whole; the biggest public ones are ~100 MB)
MAX_PICKLE_BYTES = 2 << 30


# what each opcode does to the nesting, for pickle_nesting's scan (the compiled scan numbers
# them in this order: _pickle_scan.c's KINDS, compared when it loads)
_KINDS = ("SCALAR", "MARK", "EMPTY", "BUILD_MARK", "BUILD_N", "FILL_MARK", "FILL_N", "PUT", "MEMOIZE", "GET", "DUP",
          "POP", "POP_MARK", "REFUSE_GLOBAL", "REFUSE_PERSISTENT", "NOTHING", "STOP", "OTHER")
(_SCALAR, _MARK, _EMPTY, _BUILD_MARK, _BUILD_N, _FILL_MARK, _FILL_N, _PUT, _MEMOIZE, _GET, _DUP, _POP, _POP_MARK,
 _REFUSE_GLOBAL, _REFUSE_PERSISTENT, _NOTHING, _STOP, _OTHER) = range(len(_KINDS))
_KIND_BY_NAME = {
    "MARK": _MARK, "EMPTY_LIST": _EMPTY, "EMPTY_DICT": _EMPTY, "EMPTY_SET": _EMPTY, "EMPTY_TUPLE": _EMPTY,
    "TUPLE": _BUILD_MARK, "LIST": _BUILD_MARK, "DICT": _BUILD_MARK, "FROZENSET": _BUILD_MARK,
    "TUPLE1": _BUILD_N, "TUPLE2": _BUILD_N, "TUPLE3": _BUILD_N,
    "APPENDS": _FILL_MARK, "SETITEMS": _FILL_MARK, "ADDITEMS": _FILL_MARK, "APPEND": _FILL_N, "SETITEM": _FILL_N,
    "PUT": _PUT, "BINPUT": _PUT, "LONG_BINPUT": _PUT, "MEMOIZE": _MEMOIZE,
    "GET": _GET, "BINGET": _GET, "LONG_BINGET": _GET, "DUP": _DUP, "POP": _POP, "POP_MARK": _POP_MARK,
    "GLOBAL": _REFUSE_GLOBAL, "STACK_GLOBAL": _REFUSE_GLOBAL, "INST": _REFUSE_GLOBAL,
    "EXT1": _REFUSE_GLOBAL, "EXT2": _REFUSE_GLOBAL, "EXT4": _REFUSE_GLOBAL,
    "PERSID": _REFUSE_PERSISTENT, "BINPERSID": _REFUSE_PERSISTENT, "PROTO": _NOTHING, "FRAME": _NOTHING,
    "STOP": _STOP,
}
_ITEMS_OF = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "APPEND": 1, "SETITEM": 2}


def _opcode_table() -> list:
    """Per opcode byte: (kind, argument: n > 0 fixed bytes, 0 none, -1 to a newline, -6 two
    newlines, -2/-3/-4/-5 a 1/4/4/8-byte length first, items, pops, pushes, name)."""
    table: list = [None] * 256
    for op in pickletools.opcodes:
        arg = 0 if op.arg is None else op.arg.n
        if op.name in ("GLOBAL", "INST"):
            arg = -6
        kind = _KIND_BY_NAME.get(op.name, _SCALAR if not op.stack_before and len(op.stack_after) == 1 else _OTHER)
        marked = pickletools.markobject in op.stack_before
        table[ord(op.code)] = (kind, arg, _ITEMS_OF.get(op.name, 0), -1 if marked else len(op.stack_before),
                               len(op.stack_after), op.name, "UNICODE" in op.name)
    return table


_OPCODES = _opcode_table()
_LENGTH_BYTES = {-2: 1, -3: 4, -4: 4, -5: 8}


def _compiled_scan():
    """The compiled scan's ``nesting(data, limit)`` (``_pickle_scan.c``), or None: not built, stale
    (built from other C sources than the tree's; warned), another numbering of the opcode kinds,
    or ``MS_MEMOPT_PURE_PYTHON=1``."""
    if os.environ.get("MS_MEMOPT_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from ms_memopt.io.traces import _pickle_scan
    except ImportError:
        return None
    if _build_hash.check("ms_memopt.io.traces._pickle_scan", getattr(_pickle_scan, "SOURCE_HASH", None),
                         getattr(_pickle_scan, "__file__", None)):
        return None
    if tuple(getattr(_pickle_scan, "KINDS", "").split()) != _KINDS:
        return None
    _pickle_scan.set_opcodes(tuple(_OPCODES))
    return _pickle_scan.nesting


_NESTING = _compiled_scan()


def pickle_nesting(data: bytes, *, limit: int = MAX_NESTING) -> int:
    """The deepest container nesting the pickle ``data`` would build, found from its opcodes
    without building anything; the scan stops once past ``limit``.

    The scan is :func:`nesting_reference` in C when it is built (``_pickle_scan.c``, about 10 ns
    an opcode: a 50 MB snapshot in well under a tenth of its unpickling), the reference itself
    otherwise; both give the same depth, exceptions and messages (``tests/test_pickle_scan.py``).

    Raises:
        ValueError: ``data`` is not a complete pickle (the message says ``truncated`` when it ends early).
        pickle.UnpicklingError: an opcode that loads a global or a persistent id.

    Example:
        >>> pickle_nesting(pickle.dumps({"a": [1, (2, [3])]}, protocol=4))
        4
    """
    if _NESTING is not None:
        return _NESTING(data, limit)
    return nesting_reference(data, limit=limit)


def nesting_reference(data: bytes, *, limit: int = MAX_NESTING) -> int:
    """:func:`pickle_nesting` in pure Python: the readable reference of the compiled scan.

    Why before loading: the C unpickler builds a tuple nested a million deep without recursion
    (one ``TUPLE1`` byte per level), and then hashing it as a dict key recurses in C without any
    check and kills the process (SIGSEGV); printing or comparing it raises ``RecursionError``.
    Each stack item carries its depth in a one-element list shared with the memo, so a list
    filled after it was memoized (``EMPTY_LIST, MEMOIZE, ..., APPENDS``) counts its items. The
    opcodes and their arguments are those :mod:`pickletools` documents, decoded here in one
    loop (``pickletools.genops`` took ~1.7 us an opcode, 4x the unpickling itself).

    Raises:
        ValueError: ``data`` is not a complete pickle (the message says ``truncated`` when it ends early).
        pickle.UnpicklingError: an opcode that loads a global or a persistent id (refused as
            :class:`SafeUnpickler` refuses it, before anything is built).

    Example:
        >>> nesting_reference(pickle.dumps({"a": [1, (2, [3])]}, protocol=4))
        4
    """
    scalar = [0]
    stack: list[list[int]] = []
    marks: list[int] = []
    memo: dict[int, list[int]] = {}
    strings: list[tuple[int, int]] = [(0, 0), (0, 0)]    # the last two string arguments (STACK_GLOBAL's)
    deepest = 0
    pos, end = 0, len(data)
    table, lengths = _OPCODES, _LENGTH_BYTES
    append, from_bytes = stack.append, int.from_bytes
    while pos < end:
        code = data[pos]
        # the opcodes a snapshot is mostly made of, first and without the table: a short string
        # (SHORT_BINUNICODE), a small int (BININT1), MEMOIZE, BINPUT, BINGET, MARK, NONE
        if code == 0x8C:
            if pos + 1 < end:
                start = pos + 2
                pos = start + data[pos + 1]
                strings = [strings[1], (start, pos)]
                append(scalar)
                continue
        elif code == 0x4B or code == 0x4E:
            pos += 2 if code == 0x4B else 1
            append(scalar)
            continue
        elif code == 0x94:
            if stack:
                memo[len(memo)] = stack[-1]
            pos += 1
            continue
        elif code == 0x71 or code == 0x68:
            if pos + 1 < end:
                if code == 0x71:
                    if stack:
                        memo[data[pos + 1]] = stack[-1]
                else:
                    append(memo.get(data[pos + 1], scalar))
                pos += 2
                continue
        elif code == 0x28:
            marks.append(len(stack))
            pos += 1
            continue
        entry = table[code]
        if entry is None:
            raise ValueError(f"malformed: unknown opcode {data[pos]:#x} at byte {pos}")
        kind, arg, items, pops, pushes, name, text = entry
        pos += 1
        start = pos
        if arg > 0:
            pos += arg
        elif arg == -1:
            pos = data.find(b"\n", pos) + 1
            if not pos:
                raise ValueError(f"truncated: no newline after {name}")
        elif arg == -6:
            pos = data.find(b"\n", data.find(b"\n", pos) + 1) + 1
            if not pos:
                raise ValueError(f"truncated: no newline after {name}")
        elif arg:
            width = lengths[arg]
            size = from_bytes(data[pos:pos + width], "little", signed=arg == -3)
            if size < 0:
                raise ValueError(f"malformed: negative length in {name}")
            start = pos + width
            pos = start + size
            if text:
                strings = [strings[1], (start, pos)]
        if pos > end:
            raise ValueError(f"truncated: {name} at byte {start - 1} runs past the end")
        if kind == _SCALAR:
            append(scalar)
        elif kind == _MEMOIZE:
            if stack:
                memo[len(memo)] = stack[-1]
        elif kind == _FILL_MARK or kind == _FILL_N:
            if kind == _FILL_N:
                cut = max(0, len(stack) - items)
            else:
                cut = marks.pop() if marks else 0
            filled = stack[cut:]
            del stack[cut:]
            if stack and filled and stack[-1] is not scalar:
                target = stack[-1]
                depth = 1 + max(item[0] for item in filled)
                if depth > target[0]:
                    target[0] = depth
                    if depth > deepest:
                        deepest = depth
        elif kind == _MARK:
            marks.append(len(stack))
        elif kind == _EMPTY:
            append([1])
            if not deepest:
                deepest = 1
        elif kind == _BUILD_MARK or kind == _BUILD_N:
            if kind == _BUILD_N:
                cut = max(0, len(stack) - items)
            else:
                cut = marks.pop() if marks else 0
            depth = 1 + max((item[0] for item in stack[cut:]), default=0)
            del stack[cut:]
            append([depth])
            if depth > deepest:
                deepest = depth
        elif kind == _PUT or kind == _GET:
            if arg == -1:
                index = int(data[start:pos - 1] or b"-1")
            else:
                index = from_bytes(data[start:pos], "little")
            if kind == _PUT:
                if stack:
                    memo[index] = stack[-1]
            else:
                append(memo.get(index, scalar))
        elif kind == _DUP:
            if stack:
                append(stack[-1])
        elif kind == _POP:
            if stack:
                stack.pop()
        elif kind == _POP_MARK:
            del stack[marks.pop() if marks else 0:]
        elif kind == _REFUSE_GLOBAL:
            if name == "STACK_GLOBAL":
                what = ".".join(data[a:b].decode("utf-8", "replace") for a, b in strings)
            elif arg == -6:
                what = data[start:pos].decode("utf-8", "replace").strip().replace("\n", ".")
            else:
                what = f"extension {from_bytes(data[start:pos], 'little')}"
            raise pickle.UnpicklingError(f"refused to load global {what}: snapshots may only hold builtin "
                                         "containers and scalars")
        elif kind == _REFUSE_PERSISTENT:
            raise pickle.UnpicklingError("refused a persistent id: snapshots may not reference external objects")
        elif kind == _STOP:
            return deepest
        elif kind == _OTHER:   # REDUCE, BUILD, NEWOBJ & co.: nothing they need can exist without a global
            if pops < 0:
                del stack[marks.pop() if marks else 0:]
            else:
                del stack[max(0, len(stack) - pops):]
            stack.extend([scalar] * pushes)
        if deepest > limit:
            return deepest
    raise ValueError("truncated: the pickle ends before its STOP opcode")


def safe_load(path: str | Path):
    """Unpickle ``path`` with :class:`SafeUnpickler`; every failure is an :class:`InputError`.

    The opcodes are scanned first (:func:`pickle_nesting`): nesting deeper than
    :data:`MAX_NESTING` is refused before anything is built.
    """
    source = str(path)
    try:
        size = Path(path).stat().st_size
    except OSError:
        size = 0
    if size > MAX_PICKLE_BYTES:
        raise InputError(f"a {size}-byte pickle; snapshots are read whole and at most {MAX_PICKLE_BYTES} bytes",
                         source=source)
    with open_binary(path, expected="a PyTorch memory snapshot pickle", gunzip=False) as handle:
        chunks, total = [], 0     # in chunks: read(n) would reserve n bytes up front
        while total <= MAX_PICKLE_BYTES and (chunk := handle.read(1 << 20)):
            chunks.append(chunk)
            total += len(chunk)
        data = b"".join(chunks)
        del chunks
    if len(data) > MAX_PICKLE_BYTES:
        raise InputError(f"more than {MAX_PICKLE_BYTES} bytes; snapshots are read whole", source=source)
    if not data:
        raise InputError("empty file; expected a PyTorch memory snapshot pickle", source=source)
    try:
        depth = pickle_nesting(data)
    except pickle.UnpicklingError as exc:
        raise InputError(f"not a safe PyTorch memory snapshot: {exc}", source=source) from None
    except ValueError as exc:
        cut = ("exhausted", "truncated", "remain", "not enough data")
        kind = "truncated" if any(word in str(exc) for word in cut) else "malformed"
        raise InputError(f"{kind} pickle ({exc}); expected a PyTorch memory snapshot", source=source) from None
    if depth > MAX_NESTING:
        raise InputError(f"the pickle nests containers more than {MAX_NESTING} levels deep (a PyTorch memory "
                         "snapshot nests about 7)", source=source)
    try:
        return SafeUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        if str(exc).startswith("refused"):
            raise InputError(f"not a safe PyTorch memory snapshot: {exc}", source=source) from None
        kind = "truncated" if "truncated" in str(exc) else "malformed"
        raise InputError(f"{kind} pickle ({exc}); expected a PyTorch memory snapshot", source=source) from None
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            OverflowError, MemoryError, RecursionError, UnicodeDecodeError) as exc:
        kind = "truncated" if isinstance(exc, EOFError) else "malformed"
        raise InputError(f"{kind} pickle ({type(exc).__name__}: {exc}); expected a PyTorch memory snapshot",
                         source=source) from None


def looks_like_torch_snapshot(head: bytes) -> bool:
    """True when ``head`` (a file's first bytes) starts like a protocol 2+ pickle of a dict.

    Example:
        >>> looks_like_torch_snapshot(pickle.dumps({"segments": []}, protocol=4)[:16])
        True
        >>> looks_like_torch_snapshot(b'{"format": "ms-memopt-events"}')
        False
    """
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def round_request(size: int) -> int:
    """The caching allocator's default rounding: a multiple of 512 bytes, at least 512."""
    return _MIN_BLOCK if size < _MIN_BLOCK else (size + _MIN_BLOCK - 1) // _MIN_BLOCK * _MIN_BLOCK


_TRACE_ACTIONS = ("alloc", "free_completed", "segment_alloc", "free", "segment_free", "segment_map",
                  "segment_unmap")
_2_64 = 1 << 64
#: live recorded starts the reader keeps in a plain sorted list before it moves them to a SortedKeys
_FLAT_STARTS = 4096


def _where(device: int, index: int) -> str:
    """Where a trace entry is, for a message: ``device_traces[D][I]``."""
    return f"device_traces[{device}][{index}]"


def _int(obj: dict, key: str, where: str, source: str) -> int:
    """A device address or size: an integer in [0, 2**64)."""
    value = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise InputError(f"{where}: expected an integer {key!r} from 0 to 2**64 - 1, got {short_repr(value)}",
                         source=source)
    return value


def _check_expansion(segments: list, source: str) -> None:
    """Refuse more blocks than the file has bytes.

    Written out, every block costs the pickle several bytes of its own; only the memo lets
    many segments share one ``blocks`` list, so that a 100 KB file would expand to millions
    of blocks (gigabytes and minutes). No snapshot PyTorch writes shares them.
    """
    try:
        size = Path(source).stat().st_size
    except OSError:
        return
    total = sum(len(seg["blocks"]) for seg in segments
                if isinstance(seg, dict) and isinstance(seg.get("blocks"), list))
    if total > size:
        raise InputError(f"{total} blocks in a {size}-byte file: the pickle shares its block lists among "
                         "segments (memo references), which no PyTorch snapshot does", source=source)


def _time_seconds(t: object, where: str, source: str) -> float | None:
    """``time_us`` in seconds; ``None`` when absent or not a number."""
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return None
    try:
        seconds = t / 1e6
    except OverflowError:    # an integer beyond float range
        seconds = math.inf
    if not math.isfinite(seconds):
        raise InputError(f"{where}: 'time_us' must be a finite number of microseconds, got "
                         f"{t if isinstance(t, float) else 'an integer beyond float range'}", source=source)
    return seconds


def _final_layout(segments: list, device: int, source: str) -> Layout:
    out: list[Segment] = []
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        if not isinstance(seg, dict):
            raise InputError(f"{where}: expected a dict, got {type(seg).__name__}", source=source)
        if seg.get("device", 0) != device:
            continue
        addr = _int(seg, "address", where, source)
        total = _int(seg, "total_size", where, source)
        stream = seg.get("stream", 0)
        if isinstance(stream, bool) or not isinstance(stream, int):
            raise InputError(f"{where}: expected an integer 'stream', got {short_repr(stream)}", source=source)
        kind = seg.get("segment_type", "small" if total == _SMALL_SEGMENT else "large")
        if kind not in ("small", "large"):
            raise InputError(f"{where}: segment_type must be 'small' or 'large', got {short_repr(kind)}", source=source)
        raw_blocks = seg.get("blocks")
        if not isinstance(raw_blocks, list):
            raise InputError(f"{where}: expected a list 'blocks'", source=source)
        blocks = []
        cursor = addr
        for j, raw in enumerate(raw_blocks):
            bwhere = f"{where}.blocks[{j}]"
            size = _int(raw, "size", bwhere, source)
            # older snapshots omit block addresses: blocks tile the segment in order
            baddr = _int(raw, "address", bwhere, source) if "address" in raw else cursor
            state = raw.get("state")
            if not isinstance(state, str) or state not in _ALL_STATES:
                raise InputError(f"{bwhere}: unknown state {short_repr(state)}; expected one of {sorted(_ALL_STATES)}",
                                 source=source)
            if baddr != cursor or size == 0:
                raise InputError(f"{bwhere}: blocks must tile the segment (expected address {cursor:#x})",
                                 source=source)
            blocks.append(Block(baddr, size, state in LIVE_STATES, tag=_our_tag(raw)))
            cursor += size
        if cursor != addr + total:
            raise InputError(f"{where}: blocks cover {cursor - addr} bytes, segment has {total}", source=source)
        out.append(Segment(addr, total, blocks, stream=stream, pool=kind))
    out.sort(key=lambda s: s.addr)
    for before, after in zip(out, out[1:]):
        if after.addr < before.end:
            raise InputError(f"segments at {before.addr:#x} and {after.addr:#x} overlap", source=source)
    return Layout(out)


def reconstruct_initial(events: list[Event], final: Layout, pre_live: dict[int, tuple[int, int]],
                        *, expandable: bool = False) -> Layout:
    """The allocator state when recording began, from the final segments and the trace.

    Args:
        events: the trace (recorded addresses; ``segment_*`` events in order).
        final: the recorded segments at the end.
        pre_live: blocks alive when recording began, ``addr -> (id, size in bytes)``: blocks
            freed in the trace but never allocated in it, and final live blocks never
            allocated in it.

    Segments: the final ones minus those the trace allocated plus those it freed (walking the
    trace backwards). Inside each, ``pre_live`` blocks are live; the rest is free, merged. A
    large-pool block's unsplit tail cannot be told apart from a free hole, except that the
    caching allocator never leaves a large free block of 1 MiB or less: such a gap right
    after a live large-pool block is that block's tail. With ``expandable`` segments every
    remainder of 512 B or more is split off, so there is no such tail; their segments are the
    mapped runs, rebuilt from ``segment_map``/``segment_unmap`` (:func:`_mapped_before`).
    """
    segments = {s.addr: (s.size, s.stream, s.pool) for s in final.segments}
    if any(e.action in ("segment_map", "segment_unmap") for e in events):
        segments = _mapped_before(events, segments)
    for event in reversed(events):
        if event.action == "segment_alloc":
            segments.pop(event.addr, None)
        elif event.action == "segment_free":
            segments[event.addr] = (event.size, event.stream,
                                    "small" if event.size == _SMALL_SEGMENT else "large")
    live = sorted(pre_live.items())
    out = []
    starts = [a for a, _ in live]
    for addr in sorted(segments):
        size, stream, pool = segments[addr]
        end = addr + size
        blocks: list[Block] = []
        cursor = addr
        i = bisect.bisect_left(starts, addr)
        while i < len(live) and live[i][0] < end:
            baddr, (bid, bsize) = live[i]
            i += 1
            if baddr < cursor:
                continue  # overlapping report: keep the first
            if baddr > cursor:
                blocks.append(Block(cursor, baddr - cursor, False))
            bsize = min(bsize, end - baddr)
            blocks.append(Block(baddr, bsize, True, id=bid))
            cursor = baddr + bsize
            nxt = live[i][0] if i < len(live) and live[i][0] < end else end
            if pool == "large" and not expandable and 0 < nxt - cursor <= _SMALL_SIZE:
                blocks[-1].size += nxt - cursor
                cursor = nxt
        if cursor < end:
            blocks.append(Block(cursor, end - cursor, False))
        out.append(Segment(addr, size, blocks, stream=stream, pool=pool))
    return Layout(out, expandable=expandable)


def _mapped_before(events: list[Event], segments: dict[int, tuple[int, int, str]]) -> dict[int, tuple[int, int, str]]:
    """The mapped runs of expandable segments when recording began: the final runs
    (``segments``: addr -> (size, stream, pool)) without what the trace mapped and with what it
    unmapped, walking it backwards; adjacent pieces of one stream and pool joined. A piece the
    trace unmapped takes the pool of a run it touches, else the large pool's when it is whole
    20 MiB pages."""
    runs = [[addr, addr + size, stream, pool] for addr, (size, stream, pool) in sorted(segments.items())]
    for event in reversed(events):
        if event.action not in ("segment_map", "segment_unmap"):
            continue            # the reader's own step events carry no address
        start, end = event.addr, event.addr + event.size
        if event.action == "segment_map":
            kept = []
            for run in runs:
                if run[1] <= start or run[0] >= end:
                    kept.append(run)
                    continue
                if run[0] < start:
                    kept.append([run[0], start, run[2], run[3]])
                if run[1] > end:
                    kept.append([end, run[1], run[2], run[3]])
            runs = kept
        elif event.action == "segment_unmap":
            touching = [r for r in runs if r[2] == event.stream and (r[1] == start or r[0] == end)]
            pool = touching[0][3] if touching else ("large" if event.size % _LARGE_PAGE == 0 else "small")
            runs.append([start, end, event.stream, pool])
        runs.sort()
    joined: list[list] = []
    for run in runs:
        if joined and joined[-1][1] == run[0] and joined[-1][2:] == run[2:]:
            joined[-1][1] = run[1]
        else:
            joined.append(run)
    return {start: (end - start, stream, pool) for start, end, stream, pool in joined}


def _our_tag(entry: dict) -> str | None:
    """The tag ms-memopt's own export wrote as the one frame of a block or event
    (:mod:`ms_memopt.io.traces.memory_viz`); ``None`` for anything else, real stacks included."""
    frames = entry.get("frames")
    if isinstance(frames, list) and len(frames) == 1 and isinstance(frames[0], dict) \
            and frames[0].get("filename") == "ms-memopt" and isinstance(frames[0].get("name"), str):
        name = frames[0]["name"]
        return None if name == "untagged" else name
    return None


_STACK_DEPTH = 4     # innermost frames kept per allocation (what `doctor` shows of a blocker)


def _stack(entry: dict) -> list[str]:
    """The innermost Python frames of a trace entry as ``name (file:line)`` strings: the
    caller's code rather than the allocator's own C++ (``??``, ``CUDACachingAllocator.cpp``),
    and outside the framework's package when such frames exist."""
    frames = entry.get("frames")
    if not isinstance(frames, list):
        return []
    python = [f for f in frames if isinstance(f, dict) and isinstance(f.get("filename"), str)
              and isinstance(f.get("name"), str) and f["filename"].endswith(".py")]
    own = [f for f in python if "/torch/" not in f["filename"] and "/torch_npu/" not in f["filename"]]
    return [f"{f['name']} ({f['filename']}:{f.get('line')})" for f in (own or python)[:_STACK_DEPTH]]


def recorded_by(data: dict, source: str | None = None) -> dict:
    """What ms-memopt's export says made the snapshot (``allocator_settings["ms_memopt"]``,
    :data:`~ms_memopt.io.traces.memory_viz.RECORDED_BY`) as ``Trace.meta`` keys: ``allocator``
    (a model name), ``allocator_options`` (a dict) and ``recorded_by`` (the whole entry); an
    empty dict for PyTorch's own snapshots. Entries of the wrong type are left out, and a model
    name unknown here is checked where it is used (:func:`ms_memopt.replay.replay.recorded_allocator`).

    Option values are checked against the model where it is chosen
    (:func:`ms_memopt.replay.replay.recorded_allocator`): a reader does not know the models.

    Example:
        >>> recorded_by({"allocator_settings": {"ms_memopt": {"allocator": "mindspore"}}})["allocator"]
        'mindspore'
        >>> recorded_by({"allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}})
        {}
    """
    settings = data.get("allocator_settings")
    entry = settings.get(RECORDED_BY) if isinstance(settings, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("allocator"), str):
        return {}
    options = entry.get("allocator_options")
    options = dict(options) if isinstance(options, dict) else {}
    return {"allocator": entry["allocator"], "allocator_options": options, "recorded_by": dict(entry)}


def read_torch_snapshot(path: str | Path, *, device: int = 0) -> Trace:
    """Read a PyTorch / torch_npu ``_dump_snapshot`` pickle as a :class:`Trace` for ``device``.

    The cyclic garbage collector is paused while it reads: unpickling 1.2M entry dicts and building
    800k events set it off over and over (half the unpickling time), and none of them form cycles.

    Raises:
        InputError: unreadable, empty, truncated or hostile pickle, or not a snapshot's shape
            (the message names the file and the offending entry).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _read_torch_snapshot(path, device)
    finally:
        if was_enabled:
            gc.enable()


def _read_torch_snapshot(path: str | Path, device: int) -> Trace:
    source = str(path)
    data = safe_load(path)
    if not isinstance(data, dict) or "segments" not in data or "device_traces" not in data:
        got = sorted(map(str, data))[:6] if isinstance(data, dict) else type(data).__name__
        raise InputError(f"expected a dict with 'segments' and 'device_traces' (a PyTorch memory snapshot), "
                         f"got {got}", source=source)
    segments, traces = data["segments"], data["device_traces"]
    if not isinstance(segments, list) or not isinstance(traces, list):
        raise InputError("'segments' and 'device_traces' must be lists", source=source)
    if not isinstance(device, int) or device < 0:
        raise InputError(f"device must be a non-negative integer, got {short_repr(device)}", key="--device")
    if traces and device >= len(traces):
        raise InputError(f"no trace for device {device}; the snapshot has {len(traces)} device(s)", source=source)
    raw_trace = traces[device] if traces else []
    if not isinstance(raw_trace, list):
        raise InputError(f"device_traces[{device}] must be a list", source=source)
    _check_expansion(segments, source)
    final = _final_layout(segments, device, source)

    events: list[Event] = []
    live_id: dict[int, int] = {}        # addr -> id of the live block allocated there
    live_size: dict[int, int] = {}
    pre_live: dict[int, tuple[int, int]] = {}
    skipped: dict[str, int] = {}
    frames: dict[int, list[str]] = {}     # alloc id -> its innermost frames, where recorded
    # a frame list the pickle shares through its memo (one list object for many entries) is read
    # once and its result shared: a 100k-frame list under 200k allocations was walked per allocation
    stacks: dict[int, tuple] = {}         # id(frame list) -> (our tag, its innermost frames)
    next_id = 1
    last_step = None
    # what cannot have happened (core/consistency.py; "line" is the entry's index): live blocks that
    # overlap, a block freed twice, a segment freed twice; a free (or segment_free) of an address the
    # trace never touched is a block (segment) alive before recording began, not an error
    # the checker's work is folded into this pass (its feed() cost a second on 1.2M entries): ids
    # here are fresh and a free is fed only for an id allocated in the trace, so of its kinds only
    # the overlap of live recorded ranges remains to check (TraceChecker._alloc's rule, kept
    # alike: an overlapping allocation's range is not recorded); double and unknown frees are the
    # addresses' business, below; tests/test_torch_snapshot.py compares the two on drawn traces
    checker = TraceChecker()
    note = checker.found.note
    ends: dict[int, int] = {}           # live recorded start -> end
    # the live starts in order: a plain list while few (bisect and insert at C speed), a
    # SortedKeys past _FLAT_STARTS (a list's insert would move too much at a million)
    flat: list[int] | None = []
    starts = SortedKeys()
    spans: dict[int, int] = {}          # id -> the start of its recorded range
    touched: set[int] = set()           # addresses allocated or freed in the trace
    segments_live: set[int] = set()
    segments_gone: set[int] = set()
    origin = snapshot_origin(data, raw_trace)
    pad = NPU_PAD if origin.framework == "torch_npu" else 0     # torch_npu's round_size pads each request
    # per entry, the checks are inlined for the types an honest snapshot holds (exact ints, no
    # time, no pool or step key), and the full checks of the helpers run on anything else (1.2M
    # entries: each helper call, each f-string of a message made in advance, cost a tenth of a second)
    for i, entry in enumerate(raw_trace):
        if type(entry) is not dict and not isinstance(entry, dict):
            raise InputError(f"{_where(device, i)}: expected a dict, got {type(entry).__name__}", source=source)
        action = entry.get("action")
        if action in _SKIPPED_ACTIONS:
            skipped[action] = skipped.get(action, 0) + 1
            continue
        if action not in _TRACE_ACTIONS:
            raise InputError(f"{_where(device, i)}: unknown action {short_repr(action)}", source=source)
        addr, size = entry.get("addr"), entry.get("size")
        if type(addr) is not int or type(size) is not int or not 0 <= addr < _2_64 or not 0 <= size < _2_64:
            addr = _int(entry, "addr", _where(device, i), source)
            size = _int(entry, "size", _where(device, i), source)
        stream = entry.get("stream", 0)
        if type(stream) is not int:
            if isinstance(stream, bool) or not isinstance(stream, int):
                raise InputError(f"{_where(device, i)}: expected an integer 'stream', got {short_repr(stream)}",
                                 source=source)
        time = entry.get("time_us")
        if time is not None:
            time = _time_seconds(time, _where(device, i), source)
        # ms-memopt's own exports: the pool and the training step (memory_viz.POOL_KEY, STEP_KEY)
        pool = entry.get(POOL_KEY)
        if pool is not None and not isinstance(pool, str):
            pool = None
        step = entry.get(STEP_KEY)
        if step is not None and isinstance(step, int) and not isinstance(step, bool):
            if last_step is not None and step > last_step:
                events.append(Event("step", step=last_step))        # the end of the step before
            last_step = step
        if action == "alloc":
            # the tag and the stack depend on the frame list alone: read once per list object
            raw_frames = entry.get("frames")
            key = id(raw_frames)
            known = stacks.get(key)
            if known is None:
                tag = _our_tag(entry)
                known = stacks[key] = (tag, _stack(entry) if tag is None else [])
            tag, stack = known
            event = Event("alloc", next_id, size, addr, stream, pool, time, tag, None)
            events.append(event)
            if size > 0:
                end = addr + size
                if flat is not None:
                    at = bisect_left(flat, end)
                    before = flat[at - 1] if at else None
                else:
                    before = starts.before(end)      # the live range starting last below our end
                if before is not None and ends[before] > addr:
                    note("overlapping_addresses", i)
                elif addr not in ends:
                    ends[addr] = end
                    spans[next_id] = addr
                    if flat is None:
                        starts.add(addr)
                    else:
                        flat.insert(at, addr)   # no start lies in [addr, end): it goes right after before
                        if len(flat) > _FLAT_STARTS:
                            for start in flat:
                                starts.add(start)
                            flat = None
            touched.add(addr)
            if stack:
                frames[next_id] = stack
            live_id[addr] = next_id
            live_size[addr] = size
            next_id += 1
        elif action in ("free_completed", "free"):
            bid = live_id.pop(addr, None)
            if bid is None and addr in touched:
                checker.found.note("double_free", i)     # dropped: the block was freed already
                continue
            touched.add(addr)
            if bid is None:
                # freed but never allocated in the trace: alive when recording began
                bid = next_id
                next_id += 1
                pre_live[addr] = (bid, round_request(size + pad))
            else:
                del live_size[addr]
            event = Event("free", bid, size, addr, stream, pool, time, None, None)
            events.append(event)
            start = spans.pop(bid, None)
            if start is not None:
                del ends[start]
                if flat is None:
                    starts.remove(start)
                else:
                    del flat[bisect_left(flat, start)]
        else:
            if action == "segment_alloc":
                segments_live.add(addr)
                segments_gone.discard(addr)
            elif action == "segment_free":
                if addr in segments_gone:
                    checker.found.note("unknown_segment_free", i)    # dropped: freed already
                    continue
                segments_live.discard(addr)
                segments_gone.add(addr)
            events.append(Event(action, None, size, addr, stream, None, time, None, None))

    # final live blocks the trace never allocated were alive all along; give them ids too
    for block in final.live_blocks():
        if block.addr in live_id:
            block.id = live_id[block.addr]
        elif block.addr not in pre_live:
            block.id = next_id
            pre_live[block.addr] = (next_id, block.size)
            next_id += 1
    initial = reconstruct_initial(events, final, pre_live, expandable=origin.expandable)
    meta = {"device": device, "skipped_actions": skipped, "frames": frames,
            "allocator_settings": data.get("allocator_settings") if isinstance(data.get("allocator_settings"), dict)
            else None, **origin.to_meta(), **recorded_by(data, source)}
    return Trace(events, source=source, format=FORMAT, initial=initial, final=final, meta=meta,
                 inconsistencies=checker.found.to_meta())

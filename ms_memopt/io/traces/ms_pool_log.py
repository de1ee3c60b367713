"""MindSpore's pool log (``VLOG_v=12906``) -> :class:`~ms_memopt.core.events.Trace`.

With the environment variable ``VLOG_v=12906`` set before ``import mindspore``, MindSpore's
device-memory pool logs every call to stderr while it holds the pool's lock, so the order of
the lines is the pool's own order, across threads. In MindSpore 2.10 (CPU, seen here) the
lines are::

    [V12906] PRE_ACT(PID,TID,python):TIME [.../mem_dynamic_allocator.cc:504] AddMemBlockAndMemBuf] CalMemBlockAllocSize return : 1024, alloc_mem_size : 1073741824
    [V12906] PRE_ACT(PID,TID,python):TIME [.../mem_dynamic_allocator.cc:260] AllocTensorMem] Alloc memory details, name:Unknown, persistent_mem:0, stream id: 0, address:0x7fb667fff010, size:1024B, total allocated mem:1073741824B, peak used mem:1024B, in used mem:1024B, used by event mem:0B, actual peak used mem:1024B, total idle mem:1073740800B.
    [V12906] PRE_ACT(PID,TID,python):TIME [.../mem_dynamic_allocator.cc:811] FreeTensorMemInner] Free memory details, name:Unknown, address:0x7fb667fffc10, total allocated mem:..., in used mem:3072B, ..., total idle mem:...B.

Ascend's default pool (``AbstractDynamicMemPool``) is wrapped by its logging class
``DefaultEnhancedAscendMemoryPool`` whenever the memory VLOG is on
(``AscendMemoryPool::UseEnhancedMemoryPool`` tests the VLOG range for 12906). In MindSpore 2.10
its lines are (``mindspore/ccsrc/plugin/ascend/res_manager/mem_manager/ascend_memory_pool.cc``,
the file name the binary logs; the format strings are those of the 2.10 wheel's
``mindspore/lib/plugin/ascend/libmindspore_ascend_res_manager.so``, found with ``strings``, and
the order of the pieces, the functions, the line numbers and the log levels were read from its
machine code with ``objdump -d``; **never seen on a device**)::

    [V12906] DEVICE(PID,TID,python):TIME [.../ascend_memory_pool.cc:255] AllocTensorMem] Allocate tensor mem, size : 1000, align_size : 1024, need_recycle : 0.
    [V12906] DEVICE(PID,TID,python):TIME [.../ascend_memory_pool.cc:301] AllocTensorMem] Allocate tensor mem, return : {"addr_":0x12c040000000,"size_":1024,"stream_id_":0,"status_":used,"owner_name_":Default/MatMul-op1,"alloc_type_":Kernel}, stat info : {"used_size_":1024,"peak_size_":1024,"alloc_size_":1073741824,"idle_size_":1073740800,"used_by_event_size_":0,"eager_free_size_":0}.
    [V12906] DEVICE(PID,TID,python):TIME [.../ascend_memory_pool.cc:341] FreeTensorMem] Free tensor mem, device addr : 0x12c040000000.
    [V12906] DEVICE(PID,TID,python):TIME [.../ascend_memory_pool.cc:379] DoFreeTensorMem] Do free tensor mem : 0x12c040000000, return : 1.
    [V12906] DEVICE(PID,TID,python):TIME [.../ascend_memory_pool.cc:308] AllocContinuousTensorMem] Alloc continuous tensor mem, stream id : 0.
    [V12906] DEVICE(PID,TID,python):TIME [.../ascend_memory_pool.cc:387] FreePartTensorMems] Free part tensor mems.
    [INFO] DEVICE(PID,TID,python):TIME [.../ascend_memory_pool.cc:260] AllocTensorMem] Allocate tensor mem, return nullptr.

(``DEVICE`` is the submodule number 6 the binary passes; the reader takes any name.) The request
line (size asked, ``align_size``, ``need_recycle``) is written before the pool's lock is taken,
the return line (``MemBuf::ToJson()``, then ``MemStat::ToJson()`` of the pool) inside it: an
allocation is the return line paired with the last request line *of the same thread* (TID in
the prefix); a return line without one (lost) gives the aligned size as the size and is counted
(``unpaired_allocations``). A return line without its ``stat info`` part is read too (no
counters, so no block growth is seen). The request line has no persistent flag and no stream:
the stream is the MemBuf's, ``pool`` stays unset. ``FreeTensorMem`` writes its line before the
lock and calls ``DoFreeTensorMem``, which writes the free inside it; ``WaitEvent`` and
``SyncAllEvents`` call ``DoFreeTensorMem`` alone. So the free is the ``Do free tensor mem`` line
with ``return : 1``; ``return : 0`` (a buffer still used by a stream event, freed later with
its own line, or an address the pool does not know) is no free (``frees_returned_0``), and the
``Free tensor mem, device addr`` line is only recognised.

A failed allocation (``return nullptr``, an ``INFO`` line) drops its thread's request
(``failed_allocations``).

``AllocContinuousTensorMem`` (e.g. communication fusion's contiguous inputs) logs the
stream id only, no sizes and no addresses, and ``FreePartTensorMems`` logs nothing but its name:
**their memory is not in the event stream**. The reader counts them (``continuous_allocations``,
``partial_frees``), never invents an address, and, as the pool's ``used_size_`` then holds
memory no event holds, takes the difference at the next counters as ``untracked_in_use``
instead of a counter mismatch; a block growth seen first after a continuous allocation may be
that allocation's block, so it is not made a ``segment_alloc`` (``unattributed_growths``).
The frees of continuous pieces are frees of unknown addresses (``unmatched_frees``). Such a
recording has ``meta["pool"] == "AbstractDynamicMemPool"`` and replays through ``mindspore``;
with ``MS_ALLOC_CONF=older_pool:True`` Ascend's ``BestFitAscendMemoryPool`` is a
``DynamicMemPoolBestFit`` and writes the CPU lines above, replayed through
``mindspore-bestfit`` (from the source; the CPU lines' format strings are those of the same
wheel's ``mindspore/lib/libmindspore_memory_pool.so``). That a block growth's allocation takes
the new block's low end is, for Ascend, read in the source (``MemBufAllocator``), not seen.

Facts the reader relies on (checked on MindSpore 2.10.0 CPU):

* ``size`` is the size *requested* (before rounding up to 512 B); a free names only the
  address, so frees are paired with the live allocation at that address.
* ``total allocated mem`` is the pool's reserved total: when it grows, the allocation on that
  line opened a new block and took its low end, so its address is the block's base (on CPU a
  plain ``malloc`` of 1 GiB, not 2 MiB aligned). That gives the ``segment_alloc`` event.

A raw stderr capture may hold anything else (warnings, prints, progress bars): only lines
carrying one of the pool messages count. A line that carries a pool message but does not
parse in full (torn by a crash, interleaved with another writer) is **skipped and counted**,
never guessed at; so is a free of an address with no live allocation (its allocation was on a
skipped line). An allocation at an address still live in the log means its free was on a
skipped line: the reader then frees the old one first (the pool must have) and counts it.
``trace.meta["pool_log"]`` holds the counts, the pool counters last logged, and the line
numbers of the first skipped lines. Lines of several processes are told apart by the PID in
the prefix; the process with the most pool lines is read (``meta["pool_log"]["pids"]``).

A line ``ms-memopt step N`` (written by :class:`ms_memopt.mindspore.LayoutScanCallback`
under ``ms-memopt record``) becomes a ``step`` event; ``ms-memopt step N seq=32 batch=4``
(:func:`ms_memopt.mindspore.mark_step`) one whose ``tag`` is ``dims:seq=32,batch=4``; ``ms-memopt mark TAG`` a ``mark`` event
(``CompactionCallback`` writes ``compaction_begin`` / ``compaction_end``).

Example:
    >>> parser = PoolLogParser()
    >>> line = ("[V12906] PRE_ACT(7,7f,python):T [a.cc:260] AllocTensorMem] Alloc memory details, "
    ...         "name:Unknown, persistent_mem:0, stream id: 0, address:0x1000, size:100B, total "
    ...         "allocated mem:1073741824B, peak used mem:512B, in used mem:512B, used by event "
    ...         "mem:0B, actual peak used mem:512B, total idle mem:1073741312B.")
    >>> [(e.action, e.addr, e.size) for e in parser.feed(line)]
    [('segment_alloc', 4096, 1073741824), ('alloc', 4096, 100)]
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import MAX_EVENTS_IN_MEMORY, Event, Trace, too_many_events
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.core.lines import is_regular_file, iter_lines
from ms_memopt.core.lines import read_head as lines_read_head

__all__ = ["stream_pool_log", "PoolLogEvents", "FORMAT", "LOG_NAME", "POOL_NAME", "ASCEND_POOL_NAME", "PoolLogParser", "looks_like_pool_log", "read_pool_log", "read_head",
           "recorded_final_layout", "STEP_LINE"]

FORMAT = "mindspore-pool-log"
#: the pool log's file in a run's output directory (``ms-memopt run`` writes it, the report reads it)
LOG_NAME = "pool.log"
#: ``trace.meta["pool"]`` of a CPU recording: replay picks the ``mindspore-bestfit`` model
POOL_NAME = "DynamicMemPoolBestFit"
#: ``trace.meta["pool"]`` of a recording of Ascend's default pool: replay picks ``mindspore``
ASCEND_POOL_NAME = "AbstractDynamicMemPool"
#: what LayoutScanCallback prints at a step end while recorded (``ms-memopt step 12``); marks
#: (``ms-memopt mark compaction_begin``) come from :func:`ms_memopt.analysis.scan.record_mark`
STEP_LINE = "ms-memopt step"
_MARK_LINE = "ms-memopt mark"
_ALIGN = 512

# the message markers: a line holding one of these is a pool line and must parse in full
_ALLOC_MARK = "Alloc memory details"          # DynamicMemPoolBestFit (CPU; Ascend older_pool)
_ALLOC_FUNCTION = "AllocTensorMem] "           # a line torn inside the message still names its function
_FREE_MARK = "Free memory details"
# Ascend's enhanced pool (DefaultEnhancedAscendMemoryPool over AbstractDynamicMemPool), 2.10
_ASCEND_REQUEST_MARK = "Allocate tensor mem, size :"
_ASCEND_RETURN_MARK = "Allocate tensor mem, return :"
_ASCEND_FAILED_MARK = "Allocate tensor mem, return nullptr"
_ASCEND_FREE_MARK = "Do free tensor mem :"
_ASCEND_FREE_REQUEST_MARK = "Free tensor mem, device addr :"
_ASCEND_CONTINUOUS_MARK = "Alloc continuous tensor mem"
_ASCEND_PART_MARK = "Free part tensor mems"
_PREFIX = r"\[(?:V12906|DEBUG)\] [A-Z_]+\((?P<pid>\d{1,20}),(?P<tid>[0-9a-fA-F]+),[^)]*\):\S+ \[[^\]]*\] \w+\] "
_COUNTERS = (r"total allocated mem:(?P<total>\d{1,20})B, peak used mem:(?P<peak>\d{1,20})B, in used mem:(?P<in_use>\d{1,20})B, "
             r"(?:used by event mem:(?P<by_event>\d{1,20})B, )?(?:actual peak used mem:\d+B, )?"
             r"total idle mem:(?P<idle>\d{1,20})B\.")
# 2.10 writes persistent_mem and stream id; older releases (MS_LOG(DEBUG), GLOG_v=0) neither
_ALLOC = re.compile(_PREFIX + r"Alloc memory details, name:(?P<name>[^,]*), (?:persistent_mem:(?P<persistent>[01]), )?"
                    r"(?:stream id: (?P<stream>\d{1,20}), )?address:(?P<addr>0x[0-9a-fA-F]+), size:(?P<size>\d{1,20})B, "
                    + _COUNTERS)
_FREE = re.compile(_PREFIX + r"Free memory details, name:(?P<name>[^,]*), address:(?P<addr>0x[0-9a-fA-F]+), "
                   + _COUNTERS)
# DefaultEnhancedAscendMemoryPool (ascend_memory_pool.cc), the pool Ascend uses whenever the
# memory VLOG is on. The pieces are the format strings of MindSpore 2.10's
# libmindspore_ascend_res_manager.so, in the order its machine code streams them; size_t values
# print as decimals, bools as 0/1, pointers as 0x... (0 for null), JSON values unquoted.
# AllocTensorMem, before the lock: size asked, size rounded up, need_recycle
_ASCEND_REQUEST = re.compile(_PREFIX + r"Allocate tensor mem, size : (?P<size>\d{1,20}), "
                             r"align_size : (?P<align>\d{1,20}), need_recycle : [01]\.")
# AllocTensorMem, inside the lock: MemBuf::ToJson(), then MemStat::ToJson() (taken as optional)
_ASCEND_RETURN = re.compile(_PREFIX + r'Allocate tensor mem, return : \{"addr_":(?P<addr>0x[0-9a-fA-F]+),'
                            r'"size_":(?P<aligned>\d{1,20}),"stream_id_":(?P<stream>\d{1,20}),"status_":[^,]*,'
                            r'"owner_name_":(?P<owner>.*),"alloc_type_":[^,{}]*\}'
                            r'(?:, stat info : \{"used_size_":(?P<in_use>\d{1,20}),"peak_size_":(?P<peak>\d{1,20}),'
                            r'"alloc_size_":(?P<total>\d{1,20}),"idle_size_":(?P<idle>\d{1,20}),'
                            r'"used_by_event_size_":(?P<by_event>\d{1,20}),"eager_free_size_":\d{1,20}\})?\.\s*$')
_PREFIX_INFO = _PREFIX.replace("V12906|DEBUG", "V12906|DEBUG|INFO")
_ASCEND_FAILED = re.compile(_PREFIX_INFO + r"Allocate tensor mem, return nullptr\.")      # MS_LOG(INFO)
# FreeTensorMem, before the lock; then DoFreeTensorMem, inside it (also called alone by WaitEvent)
_ASCEND_FREE_REQUEST = re.compile(_PREFIX + r"Free tensor mem, device addr : (?:0x[0-9a-fA-F]+|0)\.")
_ASCEND_FREE = re.compile(_PREFIX + r"Do free tensor mem : (?P<addr>0x[0-9a-fA-F]+|0), return : (?P<ok>[01])\.")
# AllocContinuousTensorMem, before the pool call: no sizes, no addresses; FreePartTensorMems: nothing
_ASCEND_CONTINUOUS = re.compile(_PREFIX + r"Alloc continuous tensor mem, stream id : \d{1,20}\.")
_ASCEND_PART = re.compile(_PREFIX + r"Free part tensor mems\.")
# searched at the end of a line: another writer's text without a newline may come first
_STEP = re.compile(r"ms-memopt step (?P<step>\d{1,20})(?P<dims>(?: [A-Za-z_][A-Za-z0-9_]{0,63}=-?\d{1,20}){0,32})\s*$")
_MARK = re.compile(r"ms-memopt mark (?P<tag>[\w.:-]+)\s*$")
# or a marker glued to the front of a pool log line (the marker's newline written after it)
_GLUED = re.compile(r"(?P<marker>ms-memopt (?:step \d{1,20}(?: [A-Za-z_][A-Za-z0-9_]{0,63}=-?\d{1,20}){0,32}|mark [\w.:-]+))(?P<rest>\[(?:V12906|DEBUG)\] .*)$", re.S)
_MAX_NOTED = 20             # line numbers of skipped lines kept for the report
_MAX_PIDS = 1024            # other processes counted one by one (a hostile log could name millions)
_EXPECTED = "a stderr capture of a run with VLOG_v=12906"
_SNIFF_LINES = 2000


def _dims_tag(text: str) -> str | None:
    """``" seq=32 batch=4"`` (the dims of an ``ms-memopt step N seq=32 batch=4`` line) ->
    ``"dims:seq=32,batch=4"``, the step event's tag; ``None`` without dims."""
    parts = text.split()
    return "dims:" + ",".join(parts) if parts else None


def looks_like_pool_log(text: str) -> bool:
    """True when ``text`` (the head of a file) holds a complete pool detail line."""
    for line in text.splitlines()[:_SNIFF_LINES]:
        if ((_ALLOC_MARK in line and _ALLOC.search(line)) or (_FREE_MARK in line and _FREE.search(line))
                or (_ASCEND_RETURN_MARK in line and _ASCEND_RETURN.search(line))):
            return True
    return False


def _align(size: int) -> int:
    return max(_ALIGN, (size + _ALIGN - 1) & ~(_ALIGN - 1))


@dataclass
class _Live:
    id: int
    size: int               # aligned, bytes


@dataclass
class _Counts:
    """What the reader skipped or inferred; every number is a count of lines or events."""

    pool_lines: int = 0
    skipped_lines: int = 0
    unmatched_frees: int = 0
    inferred_frees: int = 0
    counter_mismatches: int = 0
    other_pid_lines: int = 0
    # Ascend's enhanced pool only
    unpaired_allocations: int = 0      # a return line without its thread's request line
    failed_allocations: int = 0        # "return nullptr"
    frees_returned_0: int = 0          # "Do free tensor mem : X, return : 0": no free
    continuous_allocations: int = 0    # AllocContinuousTensorMem calls (no sizes, no addresses logged)
    partial_frees: int = 0             # FreePartTensorMems calls (nothing logged)
    unattributed_growths: int = 0      # block growths after a continuous allocation: no segment_alloc
    skipped_at: list[int] = field(default_factory=list)


class PoolLogParser:
    """Turns pool log lines into events, one line at a time (files, pipes, a live capture).

    ``feed(line)`` returns the events the line means (often none). The parser keeps the live
    allocations by address, the blocks, and the pool counters, so :meth:`layout` gives the
    real pool's layout at the current moment (scans of the real pool).

    Args:
        pid: read only this process's lines (``None``: the first process seen).
        source: file name for messages.
    """

    def __init__(self, *, pid: int | None = None, source: str = "") -> None:
        self.pid = pid
        self.source = source
        self.counts = _Counts()
        self.counters: dict[str, int] = {}
        self.segments: dict[int, tuple[int, str]] = {}        # base -> (size, pool)
        self.live: dict[int, _Live] = {}                        # address -> allocation
        self.allocated = 0
        self._next_id = 0
        self._reserved = 0
        self._line = 0
        self._other_pids: dict[int, int] = {}
        self._requests: dict[str, tuple[int, int]] = {}        # thread -> (size, align_size) asked
        self._untracked = 0         # bytes the pool counts in use that no event holds (continuous memory)
        self._resync = False        # _untracked changed by an unknown amount: take it from the next counters
        self._continuous_pending = False   # a continuous allocation since the last counters
        self.pool = POOL_NAME

    # --- lines ---------------------------------------------------------------------------
    def feed(self, line: str) -> list[Event]:
        """The events ``line`` means; unrelated lines give none."""
        self._line += 1
        if (STEP_LINE in line or _MARK_LINE in line) and (glued := _GLUED.search(line)):
            # both halves are whole: the marker's event first (it was written first), then the line's
            self._line -= 1
            events = self.feed(glued.group("marker"))
            self._line -= 1
            return events + self.feed(glued.group("rest"))
        if _ALLOC_MARK in line or _ALLOC_FUNCTION in line:
            if _ASCEND_REQUEST_MARK in line:
                return self._ascend_request(_ASCEND_REQUEST.search(line))
            if _ASCEND_RETURN_MARK in line:
                match = _ASCEND_RETURN.search(line)
                return self._ascend_alloc(match) if match and self._ours(match) else self._torn(match)
            if _ASCEND_FAILED_MARK in line:
                match = _ASCEND_FAILED.search(line)
                if match and self._ours(match):
                    self.counts.failed_allocations += 1
                    self._requests.pop(match.group("tid"), None)
                    return []
                return self._torn(match)
            match = _ALLOC.search(line)
            if match and self._ours(match):
                self.pool = POOL_NAME
                persistent = match.group("persistent") == "1"
                return self._alloc(match, int(match.group("size")), int(match.group("stream") or 0), persistent,
                                   match.group("name"))
            return self._torn(match)
        if _FREE_MARK in line:
            match = _FREE.search(line)
            if match and self._ours(match):
                return self._free(int(match.group("addr"), 16), match)
            return self._torn(match)
        if _ASCEND_FREE_MARK in line:
            match = _ASCEND_FREE.search(line)
            if match and self._ours(match):
                if match.group("ok") == "1":
                    return self._free(int(match.group("addr"), 16), None)
                # still used by a stream event (its real free logs again with 1), or unknown to the pool
                self.counts.frees_returned_0 += 1
                return []
            return self._torn(match)
        if _ASCEND_FREE_REQUEST_MARK in line:      # the free itself is DoFreeTensorMem's line
            return self._ascend_note(_ASCEND_FREE_REQUEST.search(line), None)
        if _ASCEND_CONTINUOUS_MARK in line:
            return self._ascend_note(_ASCEND_CONTINUOUS.search(line), "continuous_allocations")
        if _ASCEND_PART_MARK in line:
            return self._ascend_note(_ASCEND_PART.search(line), "partial_frees")
        if STEP_LINE in line:
            step = _STEP.search(line)
            if step:
                return [Event("step", step=int(step.group("step")), tag=_dims_tag(step.group("dims")))]
        elif _MARK_LINE in line:
            mark = _MARK.search(line)
            if mark:
                return [Event("mark", tag=mark.group("tag"))]
        return []

    def feed_all(self, lines: Iterable[str]) -> Iterator[Event]:
        for line in lines:
            yield from self.feed(line)

    def _ours(self, match: re.Match) -> bool:
        pid = int(match.group("pid"))
        if self.pid is None:
            self.pid = pid
        if pid != self.pid:
            if pid in self._other_pids or len(self._other_pids) < _MAX_PIDS:
                self._other_pids[pid] = self._other_pids.get(pid, 0) + 1
            self.counts.other_pid_lines += 1
            return False
        self.counts.pool_lines += 1
        return True

    def _torn(self, match: re.Match | None) -> list[Event]:
        if match is None:   # a marker without its whole line: never guessed at
            self.counts.skipped_lines += 1
            if len(self.counts.skipped_at) < _MAX_NOTED:
                self.counts.skipped_at.append(self._line)
        return []

    def _note_counters(self, match: re.Match) -> None:
        self.counters = {"reserved": int(match.group("total")), "in_use": int(match.group("in_use")),
                         "peak_used": int(match.group("peak")), "used_by_event": int(match.group("by_event") or 0),
                         "idle": int(match.group("idle"))}
        self._continuous_pending = False
        untracked = self.counters["in_use"] - self.allocated
        if self._resync:        # continuous memory came or went: the pool's count says how much is held
            self._resync = False
            if untracked < 0:
                self.counts.counter_mismatches += 1
            self._untracked = max(untracked, 0)
        elif untracked != self._untracked:   # always 0 on the CPU pool
            self.counts.counter_mismatches += 1

    def _ascend_note(self, match: re.Match | None, count: str | None) -> list[Event]:
        """A line of the enhanced pool that makes no event (counted under ``count``)."""
        if match is None:
            return self._torn(None)
        if self._ours(match) and count is not None:
            setattr(self.counts, count, getattr(self.counts, count) + 1)
            self._resync = True
            self._continuous_pending = self._continuous_pending or count == "continuous_allocations"
        return []

    def _ascend_request(self, match: re.Match | None) -> list[Event]:
        if match is None:
            return self._torn(None)
        if self._ours(match):   # the requested size, paired with the return line of the same thread
            self._requests[match.group("tid")] = (int(match.group("size")), int(match.group("align")))
        return []

    def _ascend_alloc(self, match: re.Match) -> list[Event]:
        self.pool = ASCEND_POOL_NAME
        aligned = int(match.group("aligned"))          # the MemBuf's size: what the pool holds
        request = self._requests.pop(match.group("tid"), None)
        if request is None or request[1] > aligned:    # lost, or another call's: keep what is sure
            self.counts.unpaired_allocations += 1
            size = aligned
        else:
            size = request[0]
        return self._alloc(match, size, int(match.group("stream")), False, match.group("owner") or "Unknown",
                           aligned=aligned)

    def _alloc(self, match: re.Match, size: int, stream: int, persistent: bool, name: str,
               aligned: int | None = None) -> list[Event]:
        events: list[Event] = []
        addr = int(match.group("addr"), 16)
        pool = "persistent" if persistent else None
        counters = match.group("total") is not None     # an Ascend return line may lack them
        if counters:
            reserved = int(match.group("total"))
            if reserved > self._reserved:
                if self._continuous_pending:   # the new block may be the continuous allocation's
                    self.counts.unattributed_growths += 1
                else:
                    # the pool grew for this request: it took the low end of the new block
                    block = reserved - self._reserved
                    self.segments[addr] = (block, pool or "common")
                    events.append(Event("segment_alloc", size=block, addr=addr, stream=stream, pool=pool))
            self._reserved = reserved
        old = self.live.pop(addr, None)
        if old is not None:     # its free was on a skipped line; the pool freed it before reuse
            self.counts.inferred_frees += 1
            self.allocated -= old.size
            events.append(Event("free", id=old.id))
        self._next_id += 1
        if aligned is None:
            aligned = _align(size)
        self.live[addr] = _Live(self._next_id, aligned)
        self.allocated += aligned
        events.append(Event("alloc", id=self._next_id, size=size, addr=addr, stream=stream, pool=pool,
                            tag=None if name == "Unknown" else name))
        if counters:
            self._note_counters(match)
        return events

    def _free(self, addr: int, match: re.Match | None) -> list[Event]:
        live = self.live.pop(addr, None)
        if match is not None:
            self._reserved = int(match.group("total"))
        if live is None:
            self.counts.unmatched_frees += 1
            if self._untracked:     # perhaps a piece of continuous memory: its size is not logged
                self._resync = True
        else:
            self.allocated -= live.size
        if match is not None:
            self._note_counters(match)
        return [] if live is None else [Event("free", id=live.id)]

    # --- state ---------------------------------------------------------------------------
    def layout(self) -> Layout:
        """The real pool now: each block tiled by its live buffers and the idle ranges between
        them (the pool merges idle neighbours, so the gaps are its idle buffers)."""
        return _tile(self.segments, ((addr, live.size, live.id) for addr, live in self.live.items()))

    def meta(self) -> dict:
        """What the parse skipped or inferred, and the last pool counters (bytes)."""
        counts = self.counts
        pids = {} if self.pid is None else {self.pid: counts.pool_lines}
        pids.update(self._other_pids)
        return {"pool_lines": counts.pool_lines, "skipped_lines": counts.skipped_lines,
                "skipped_at_lines": list(counts.skipped_at), "unmatched_frees": counts.unmatched_frees,
                "inferred_frees": counts.inferred_frees, "counter_mismatches": counts.counter_mismatches,
                "unpaired_allocations": counts.unpaired_allocations, "failed_allocations": counts.failed_allocations,
                "frees_returned_0": counts.frees_returned_0, "continuous_allocations": counts.continuous_allocations,
                "partial_frees": counts.partial_frees, "unattributed_growths": counts.unattributed_growths,
                "untracked_in_use": self._untracked,
                "pid": self.pid, "pids": {str(k): v for k, v in pids.items()}, "counters": dict(self.counters)}


def _tile(segments: dict[int, tuple[int, str]], live: Iterable[tuple[int, int, int | None]]) -> Layout:
    by_segment: dict[int, list[tuple[int, int, int | None]]] = {base: [] for base in segments}
    bases = sorted(segments)
    for addr, size, ident in live:     # the block holding addr: the last base at or below it
        at = bisect.bisect_right(bases, addr) - 1
        if at >= 0 and addr < bases[at] + segments[bases[at]][0]:
            by_segment[bases[at]].append((addr, size, ident))
    out = []
    for base in bases:
        seg_size, pool = segments[base]
        blocks: list[Block] = []
        cursor = base
        for addr, size, ident in sorted(by_segment[base]):
            if addr > cursor:
                blocks.append(Block(cursor, addr - cursor, False))
            blocks.append(Block(addr, size, True, id=ident))
            cursor = addr + size
        if cursor < base + seg_size:
            blocks.append(Block(cursor, base + seg_size - cursor, False))
        out.append(Segment(base, seg_size, blocks, pool=pool))
    return Layout(out)


def recorded_final_layout(events: Iterable[Event]) -> Layout | None:
    """The layout a recording ends in, rebuilt from its events: blocks from ``segment_alloc``
    and live allocations at their recorded addresses (aligned to 512 B). ``None`` when an
    allocation has no recorded address (nothing to compare a replay with).

    Example:
        >>> ev = [Event("segment_alloc", addr=0, size=4096), Event("alloc", id=1, size=10, addr=512)]
        >>> [(b.addr, b.size, b.live) for b in recorded_final_layout(ev).segments[0].blocks]
        [(0, 512, False), (512, 512, True), (1024, 3072, False)]
    """
    segments: dict[int, tuple[int, str]] = {}
    live: dict[int, tuple[int, int, int | None]] = {}
    for event in events:
        if event.action == "alloc":
            if event.addr is None:
                return None
            live[event.id] = (event.addr, _align(event.size), event.id)
        elif event.action == "free":
            live.pop(event.id, None)
        elif event.action == "segment_alloc":
            segments[event.addr] = (event.size, event.pool or "common")
        elif event.action == "segment_free":
            segments.pop(event.addr, None)
    return _tile(segments, live.values())


def read_pool_log(path: str | Path, *, pid: int | None = None) -> Trace:
    """Read a stderr capture holding MindSpore's ``VLOG_v=12906`` pool lines.

    The file is read as a stream (gzip too), line by line with each line bounded
    (:func:`ms_memopt.core.lines.iter_lines`), so memory holds the events and the parser's state,
    never the file's text: lines of other output cost nothing.

    Args:
        path: the capture (any other lines in it are ignored); a pipe or ``/dev/stdin`` is read once.
        pid: the process to read; default: the one with the most pool lines. A regular file is
            read again in the rare case that a process other than the first one seen is busier; a
            pipe keeps the first process (``meta["pool_log"]["pids"]`` shows the others).

    Raises:
        InputError: unreadable, a line over 1 MiB, or no complete pool line in it (names the file).
    """
    source = str(path)
    parser, events = _parse(path, pid)
    if pid is None and parser._other_pids and is_regular_file(path):
        busiest = max(parser._other_pids, key=parser._other_pids.get)
        if parser._other_pids[busiest] > parser.counts.pool_lines:
            parser, events = _parse(path, busiest)
    if not any(e.action == "alloc" for e in events):
        raise InputError("no complete MindSpore pool line (\"Alloc memory details, ...\" or \"Allocate tensor "
                         "mem, return : ...\"); expected a stderr capture of a run with VLOG_v=12906", source=source)
    meta = {"pool": parser.pool, "pool_log": parser.meta()}
    return Trace(events, source=source, format=FORMAT, final=parser.layout(), meta=meta)


class PoolLogEvents:
    """The events of a pool log, parsed from the file each time they are iterated (a pipe: once).

    Memory holds the parser's state (live allocations, blocks), never the file or its events.
    ``on_end(parser)`` is called when an iteration has read the whole file.
    """

    def __init__(self, path: str | Path, pid: int | None, on_end=None) -> None:
        self.path = path
        self.pid = pid
        self.on_end = on_end

    def __iter__(self) -> Iterator[Event]:
        parser = PoolLogParser(pid=self.pid, source=str(self.path))
        feed = parser.feed
        for _, line in iter_lines(self.path, expected=_EXPECTED):
            found = feed(line)
            if found:
                yield from found
        if not parser._next_id:
            raise InputError("no complete MindSpore pool line (\"Alloc memory details, ...\" or \"Allocate tensor "
                             "mem, return : ...\"); expected a stderr capture of a run with VLOG_v=12906",
                             source=str(self.path))
        if self.on_end is not None:
            self.on_end(parser)


def stream_pool_log(path: str | Path, *, pid: int | None = None) -> Trace:
    """:func:`read_pool_log` as a stream: ``trace.events`` is a :class:`PoolLogEvents`.

    The process read is the busiest in the file's first MiB (``pid`` to choose); ``trace.meta["pool"]``
    is known from that head; ``trace.final`` and ``trace.meta["pool_log"]`` are set when an iteration
    of the events ends. For replaying logs of gigabytes in memory bounded by the pool's state.

    Raises:
        InputError: unreadable, a line over 1 MiB, or (when iterated) no complete pool line.
    """
    source = str(path)
    head = read_head(path, 1 << 20).splitlines()[:-1]       # whole lines only
    if pid is None:
        counts: dict[int, int] = {}
        for line in head:
            if _ALLOC_MARK in line or _ASCEND_RETURN_MARK in line:
                match = _ALLOC.search(line) or _ASCEND_RETURN.search(line)
                if match:
                    counts[int(match.group("pid"))] = counts.get(int(match.group("pid")), 0) + 1
        pid = max(counts, key=counts.get) if counts else None
    probe = PoolLogParser(pid=pid, source=source)
    for line in head:
        probe.feed(line)
    trace = Trace([], source=source, format=FORMAT, meta={"pool": probe.pool, "streamed": True})

    def on_end(parser: PoolLogParser) -> None:
        trace.final = parser.layout()
        trace.meta.update(pool=parser.pool, pool_log=parser.meta())

    trace.events = PoolLogEvents(path, probe.pid if pid is None else pid, on_end)
    return trace


def _parse(path: str | Path, pid: int | None) -> tuple["PoolLogParser", list[Event]]:
    parser = PoolLogParser(pid=pid, source=str(path))
    events: list[Event] = []
    feed, extend = parser.feed, events.extend
    for _, line in iter_lines(path, expected=_EXPECTED):
        found = feed(line)
        if found:
            extend(found)
            if len(events) > MAX_EVENTS_IN_MEMORY:
                raise too_many_events(str(path))
    return parser, events


def read_head(path: str | Path, size: int) -> str:
    """The first ``size`` bytes of the (possibly gzipped) file as text, for format detection
    (a pipe's head is kept for the reader: :func:`ms_memopt.core.lines.read_head`)."""
    return lines_read_head(path, size, expected=_EXPECTED, gunzip=True).decode("utf-8", errors="replace")

"""The Ascend profiler's memory output -> :class:`~ms_memopt.core.events.Trace`.

``torch_npu.profiler`` and MindSpore's profiler, run with ``profile_memory=True``, write under a
rank's folder (``*_ascend_pt`` for torch_npu, ``*_ascend_ms`` for MindSpore) the folder
``ASCEND_PROFILER_OUTPUT/`` with (text export) ``operator_memory.csv``, ``memory_record.csv`` and
``npu_module_mem.csv``, or (db export) the SQLite file ``ascend_pytorch_profiler_N.db`` whose
tables ``OP_MEMORY``, ``MEMORY_RECORD``, ``NPU_MODULE_MEM`` and ``NPU_OP_MEM`` hold the same data.
:func:`read_ascend_profiler` takes the rank's folder, ``ASCEND_PROFILER_OUTPUT/``, any one of
the CSV files, the ``.db``, or a job's folder of ranks' folders (the lowest rank is read);
:func:`stream_ascend_profiler` makes the events as they are iterated. Facts from the writers'
sources (docs/traces.md):

* ``operator_memory.csv``: one row per tensor: ``Size(KB)`` (block bytes / 1024), allocation and
  release time (us), and the pool's total allocated / reserved / active (MB = bytes / 2**20)
  just after the allocation and at the release. torch_npu (``MemoryPrepareParser``) writes every
  time as ns with the decimal point moved, plus a literal TAB (``"1736408883694624.810\\t"``),
  so it is read as integer ns, never as a float. Rows whose name starts with ``cann::`` are the
  graph engine's (GE) memory, copied from CANN's own file: a separate pool with its own
  reserved figure, and its release totals are taken *before* the release (torch_npu's after).
  MindSpore 2.10 (``ascend_op_memory_viewer.py``) writes float microseconds with no TAB and
  ``N/A`` for an empty field.
* A tensor allocated before the capture and released in it has no row in either writer (the
  release alone is dropped); it shows only as a fall of the recorded totals. The reader finds
  each such fall between two rows and makes it the release of a tensor of the initial state. A
  row with an empty allocation time is also a tensor of the initial state; one with an empty
  release time is live at the end. What the first row's totals say was allocated before it,
  and no release accounts for, is one more initial tensor held all through.
* Rows are not sorted by release time (nor, in some files, by allocation time). Allocations and
  releases are merged by time as a stream (memory bounded by the live tensors), the whole
  component sorted only when a row comes out of order. Equal times are ordered by the recorded
  totals (each event starts where the total stands; the fewest unseen releases; ending where
  the next event starts), else releases first.
* torch_npu's workspace allocator reports through the same records with reserved 0: those rows
  are the ``WORKSPACE`` component.
* ``memory_record.csv``: the totals over time per component (torch_npu: ``PTA``, ``GE``,
  ``PTA+GE``, ``APP``; db also ``WORKSPACE``; MindSpore: ``MindSpore``, ``GE``,
  ``MindSpore+GE``, ``APP``). MindSpore's "MB" there is KB / 1000 (``MemoryRecordBean``).
  Beside ``operator_memory.csv`` it is not read (the rows carry the same series); on its own it
  gives the recorded curves and events made from the allocated deltas.
* ``npu_module_mem.csv``: reserved memory per CANN module over time (figures only).
* The db: bytes and ns as integers; names are ``STRING_IDS`` ids. ``NPU_OP_MEM`` holds GE's
  allocate/release records with device addresses: used for the GE component (``addr``).

Each component is one event stream; the Trace holds the framework's (``PTA`` or ``MindSpore``;
``component=`` picks another) and ``meta["components"]`` the recorded figures of all:
``peak_allocated``, ``peak_reserved``, ``allocated_max_diff`` (the largest difference between
the recorded allocated total and the events' own at any row: 0 when the reader is right), and
how the initial state was made. For torch_npu's ``PTA`` the initial state is ``Trace.initial``:
the pre-capture tensors laid out in the recorded reserved total (placement guessed; no
addresses are recorded); elsewhere allocations before the first event.
``meta["allocator_candidates"]`` lists the models that fit, best first (replay takes the first
one registered), ``meta["framework"]`` names the writer.

Example:
    >>> trace = read_ascend_profiler("rank0_ascend_pt")                    # doctest: +SKIP
    >>> trace.meta["recorded"]["allocated_max_diff"]                        # doctest: +SKIP
    0
"""
from __future__ import annotations

import csv
import heapq
import re
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from operator import itemgetter
from pathlib import Path
from sys import intern

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event, Trace
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.core.lines import iter_lines
from ms_memopt.io.traces.fields import parse_int

__all__ = [
    "FORMAT",
    "MEMORY_RECORD",
    "NPU_MODULE_MEM",
    "OPERATOR_MEMORY",
    "OUTPUT_DIR",
    "is_profiler_dir",
    "is_sqlite",
    "profiler_file_kind",
    "profiler_size",
    "read_ascend_profiler",
    "stream_ascend_profiler",
]

FORMAT = "ascend-profiler"
OUTPUT_DIR = "ASCEND_PROFILER_OUTPUT"
OPERATOR_MEMORY = "operator_memory.csv"
MEMORY_RECORD = "memory_record.csv"
NPU_MODULE_MEM = "npu_module_mem.csv"
_DB_NAME = re.compile(r"^ascend_(pytorch|mindspore)_profiler(_\d+)?\.db$")
_SQLITE_MAGIC = b"SQLite format 3\x00"

_OPERATOR_COLUMNS = ("Name", "Size(KB)", "Allocation Time(us)", "Release Time(us)",
                     "Allocation Total Allocated(MB)", "Allocation Total Reserved(MB)",
                     "Release Total Allocated(MB)", "Release Total Reserved(MB)")
_RECORD_COLUMNS = ("Component", "Timestamp(us)", "Total Allocated(MB)", "Total Reserved(MB)")
_MODULE_COLUMNS = ("Component", "Timestamp(us)", "Total Reserved(MB)")

TORCH_NPU, MINDSPORE = "torch_npu", "mindspore"
GE = "GE"
WORKSPACE = "WORKSPACE"
_FRAMEWORK = {TORCH_NPU: "PTA", MINDSPORE: "MindSpore"}
_GE_PREFIX = "cann::"
_KB, _MB = 1024, 1 << 20
# torch_npu's NPUCachingAllocator::round_size adds 32 bytes before rounding up to 512: a block of
# S bytes is what a request of S - 32 becomes (and PyTorch's own rule rounds S - 32 up to S too)
_NPU_PAD = 32
_MIN_BLOCK = 512
_SYNTHETIC_ID = 1 << 40     # ids of initial tensors no row names (rows use their line number)
_MAX_TIE_SEARCH = 64        # equal-time groups larger than this keep the default order
# PyTorch's (and torch_npu's) small pool: blocks of at most 1 MiB in 2 MiB segments
_SMALL_SIZE, _SMALL_SEGMENT = 1 << 20, 2 << 20
_LAYOUT_BASE = 0x12C000000000   # where the initial state is placed (an Ascend device address range)


# --------------------------------------------------------------------------- detection

def profiler_file_kind(first_line: str) -> str | None:
    """Which profiler file a CSV header line is: ``operator_memory``, ``memory_record``,
    ``npu_module_mem``, or ``None``.

    Example:
        >>> profiler_file_kind("Component,Timestamp(us),Total Reserved(MB),Device")
        'npu_module_mem'
    """
    columns = [c.strip() for c in first_line.lstrip("\ufeff").strip().split(",")]
    if all(c in columns for c in _OPERATOR_COLUMNS):
        return "operator_memory"
    if all(c in columns for c in _RECORD_COLUMNS):
        return "memory_record"
    if all(c in columns for c in _MODULE_COLUMNS):
        return "npu_module_mem"
    return None


def is_sqlite(head: bytes) -> bool:
    """True when ``head`` (a file's first bytes) starts an SQLite database."""
    return head.startswith(_SQLITE_MAGIC)


def is_profiler_dir(path: str | Path) -> bool:
    """True when ``path`` is ``ASCEND_PROFILER_OUTPUT/``, a rank's folder holding it, or a folder
    of ranks' folders (the lowest rank is read)."""
    path = Path(path)
    return path.is_dir() and (_output_dir(path) is not None or bool(_rank_dirs(path)))


def profiler_size(path: str | Path) -> int:
    """Bytes of the file a read of ``path`` goes through (``operator_memory.csv`` of a folder, the
    file itself otherwise; 0 when there is none): how large a replay's stream would be."""
    path = Path(path)
    try:
        if path.is_dir():
            inputs = _locate(path)
            target = inputs.operator_memory or inputs.db or inputs.memory_record
            return target.stat().st_size if target is not None else 0
        return path.stat().st_size
    except (OSError, InputError):
        return 0


def _rank_dirs(path: Path) -> list[Path]:
    """The ranks' folders directly inside ``path``, lowest rank first (``profiler_info_N.json``,
    else the first number in the folder's name, else the name)."""
    ranks = [p for p in _list(path) if p.is_dir() and (p / OUTPUT_DIR).is_dir()]

    def rank_of(folder: Path) -> tuple:
        for item in _list(folder):
            match = re.fullmatch(r"profiler_info_(\d+)\.json", item.name)
            if match:
                return (int(match.group(1)), folder.name)
        match = re.search(r"\d+", folder.name)
        return (int(match.group()) if match else 1 << 30, folder.name)
    return sorted(ranks, key=rank_of)


def _output_dir(path: Path) -> Path | None:
    if (path / OUTPUT_DIR).is_dir():
        return path / OUTPUT_DIR
    if path.name == OUTPUT_DIR or any((path / name).is_file() for name in (OPERATOR_MEMORY, MEMORY_RECORD)) \
            or any(_DB_NAME.match(p.name) for p in _list(path)):
        return path
    return None


def _list(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except OSError:
        return []


# --------------------------------------------------------------------------- fields

def _empty(text: str | None) -> bool:
    return text is None or text.strip() in ("", "N/A", "None", "NULL")


def _ns(text: str | None, what: str, source: str, line: int) -> int | None:
    """A microseconds field (``"1736408883694624.810\\t"``, ``1.7364e15``) as integer ns; None when empty."""
    if text is None:
        return None
    text = text.strip()
    # torch_npu's form, exactly three decimals: the digits are the ns
    if text[-4:-3] == "." and text[:1].isdigit():
        try:
            return int(text[:-4] + text[-3:])
        except ValueError:
            pass
    if _empty(text):
        return None
    whole, _, frac = text.partition(".")
    if whole.lstrip("-").isdigit() and (not frac or frac.isdigit()):
        value = int(whole) * 1000
        digits = (frac + "000")[:3]
        if digits:
            value += (-1 if whole.startswith("-") else 1) * int(digits)
        return value
    try:
        value = Decimal(text) * 1000
    except InvalidOperation:
        raise InputError(f"{what}: expected a time in microseconds, got {text[:40]!r}", source=source, line=line) from None
    if not value.is_finite():
        raise InputError(f"{what}: expected a finite time, got {text[:40]!r}", source=source, line=line)
    return int(value.to_integral_value())


def _bytes(text: str | None, unit: int, what: str, source: str, line: int) -> int | None:
    """A size in ``unit`` bytes (KB, MB; floats as Python prints them) as an integer byte count."""
    value = _number(text, what, source, line)
    return None if value is None else round(value * unit)


def _number(text: str | None, what: str, source: str, line: int) -> float | None:
    """A non-negative finite number field; None when empty."""
    try:
        value = float(text)         # surrounding whitespace (a TAB) is allowed by float()
    except (ValueError, TypeError):
        if _empty(text):
            return None
        raise InputError(f"{what}: expected a number, got {text.strip()[:40]!r}", source=source, line=line) from None
    if value < 0:
        raise InputError(f"{what}: expected a non-negative size, got {text.strip()[:40]!r}", source=source, line=line)
    if not value <= 1e18:          # inf and nan too
        raise InputError(f"{what}: expected a finite number, got {text.strip()[:40]!r}", source=source, line=line)
    return value


# --------------------------------------------------------------------------- one component's timeline

@dataclass(slots=True)
class _Figures:
    """What the recording says of one component, and how the events matched it (bytes)."""

    rows: int = 0
    events: int = 0
    checked: int = 0                  # events with a recorded total to compare against
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    reserved_first: int | None = None
    reserved_last: int | None = None
    allocated_first: int | None = None    # before the first event: the initial state
    allocated_last: int | None = None
    allocated_max_diff: int = 0
    first_diff_line: int | None = None
    unseen_releases: int = 0
    unseen_release_bytes: int = 0
    initial_rows: int = 0             # rows with no allocation time
    held_initial_bytes: int = 0       # allocated before the capture and never released in it
    live_at_end: int = 0
    unsorted: bool = False
    release_totals: str = "after"     # the recorded total of a release: "after" it or "before"
    ties_ordered_by_totals: int = 0
    events_peak_allocated: int = 0    # the events' own curve's peak (equal to peak_allocated when it matches)
    initial_unexplained: int = 0      # rows and falls before the capture exceed what the first totals say
    reserved_small_growths: int = 0   # rises of the recorded reserved total by less than 1 GiB

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


class _Timeline:
    """One component's time-sorted events -> :class:`Event` list, checked against the totals.

    Events come in as tuples ``(time, kind, id, size, total_alloc, total_reserved, line, name,
    addr, stream)``, ``kind`` 0 = release, 1 = allocation, sorted by time; equal times are held
    as a group and ordered by the recorded totals.
    """

    def __init__(self, name: str, *, release_after: bool, size_pad: int, emit: bool = True) -> None:
        self.name = name
        self.release_after = release_after
        self.size_pad = size_pad
        self.first_time: int | None = None      # of the first event
        #: without ``emit`` no Event is kept (a first pass that only learns the figures and the
        #: initial state: memory is the live tensors)
        self.emit = emit
        self.fig = _Figures(release_totals="after" if release_after else "before")
        self.events: list[Event] = []
        self.initial: list[tuple[int, int, str | None]] = []   # (id, size, name) allocated before the capture
        self.running: int | None = None
        self._group: list[tuple] = []
        self._group_time: int | None = None
        self._synthetic = _SYNTHETIC_ID
        self._sizes: dict[int, int] = {}      # live id -> recorded size

    # -- input
    def add_initial(self, ident: int, size: int, name: str | None) -> None:
        """A tensor allocated before the capture (a row without an allocation time)."""
        self.initial.append((ident, size, name))
        self._sizes[ident] = size
        self.fig.initial_rows += 1

    def feed(self, item: tuple) -> None:
        time, group_time = item[0], self._group_time
        if time != group_time and group_time is not None:
            if time < group_time:
                raise _OutOfOrder()
            group = self._group
            if len(group) == 1:          # the common case: no other event at that time
                self._apply(group.pop())
            else:
                self._flush(self._before(item))
        self._group_time = time
        self._group.append(item)

    def finish(self) -> None:
        self._flush()
        fig = self.fig
        if self.running is not None:
            fig.allocated_last = self.running
        first = fig.allocated_first
        explicit = sum(size for _, size, _ in self.initial)
        if first is not None:
            # what the first totals say was allocated, less what rows and falls account for
            held = first - explicit
            if held > 0:
                ident = self._next_id()
                self.initial.insert(0, (ident, held, "before capture"))
                fig.held_initial_bytes = held
            elif held < 0:
                fig.initial_unexplained = -held
        fig.live_at_end = len(self._sizes)

    # -- ordering
    def _before(self, item: tuple) -> int | None:
        total = item[4]
        if total is None:
            return None
        if item[1] == 1:
            return total - item[3]
        return total + item[3] if self.release_after else total

    def _flush(self, next_before: int | None = None) -> None:
        group, self._group = self._group, []
        if not group:
            return
        if len(group) == 1:
            self._apply(group[0])
            return
        group.sort(key=lambda it: (it[1], it[6]))    # releases first, then file order
        allocating = {it[2] for it in group if it[1] == 1}
        if len(group) > _MAX_TIE_SEARCH:
            # too many to search: releases of tensors live before, allocations, then the rest
            early = [it for it in group if it[1] == 0 and it[2] not in allocating]
            late = [it for it in group if it[1] == 0 and it[2] in allocating]
            for item in early + [it for it in group if it[1] == 1] + late:
                self._apply(item)
            return
        order = self._search(group, next_before)
        if order is not None:
            if order != group:
                self.fig.ties_ordered_by_totals += 1
            for item in order:
                self._apply(item)
            return
        while group:
            eligible = [i for i, it in enumerate(group) if it[1] == 1 or it[2] not in allocating] or [0]
            pick = eligible[0]
            if self.running is not None:
                match = next((i for i in eligible if self._before(group[i]) == self.running), None)
                if match is None:
                    match = self._best_start(group, eligible)
                if match is not None and match != pick:
                    self.fig.ties_ordered_by_totals += 1
                    pick = match
            item = group.pop(pick)
            if item[1] == 1:
                allocating.discard(item[2])
            self._apply(item)

    def _search(self, group: list[tuple], next_before: int | None) -> list[tuple] | None:
        """An order of an equal-time group in which every event starts at the running total,
        allowing the fewest unseen releases (falls with no row) between them; None when the
        group has no totals or the search runs past its budget. Releases never precede their
        own allocation. An order that ends where the next event starts (``next_before``) wins
        over one with fewer falls that does not; then the one releasing the fewest bytes unseen,
        then the default order (releases first, file order)."""
        befores = [self._before(it) for it in group]
        if any(b is None for b in befores):
            return None
        n = len(group)
        alloc_at = {it[2]: i for i, it in enumerate(group) if it[1] == 1}
        budget = [4000]
        used = [False] * n
        order: list[int] = []
        found: list[tuple] = []          # (score, order)

        def score(end: int, fallen: int) -> tuple:
            if next_before is None or end == next_before:
                return (0, fallen)
            return (1 if end > next_before else 2, fallen)

        def dfs(running: int, gaps: int, fallen: int) -> bool:
            """True to stop: a perfect order found (or the budget spent, raising)."""
            if len(order) == n:
                found.append((score(running, fallen), list(order)))
                return found[-1][0][0] == 0 and (found[-1][0][1] == 0 or level[0] == 0)
            budget[0] -= 1
            if budget[0] < 0:
                raise _Budget()
            for exact in (True, False):
                if not exact and not gaps:
                    break
                for i in range(n):
                    if used[i] or (group[i][1] == 0 and group[i][2] in alloc_at and not used[alloc_at[group[i][2]]]):
                        continue
                    before = befores[i]
                    if (before == running) if exact else (before < running):
                        used[i] = True
                        order.append(i)
                        stop = dfs(self._after(group[i], before), gaps if exact else gaps - 1,
                                   fallen if exact else fallen + running - before)
                        used[i] = False
                        order.pop()
                        if stop:
                            return True
            return False

        # the first group of a component starts from an unknown total: each event may open it, the
        # lowest first (of two orders the totals allow, the one with less memory released unseen)
        starts = [self.running] if self.running is not None else sorted(set(befores))
        level = [0]
        try:
            for gaps in range(n + 1):
                level[0] = gaps
                for start in starts:
                    dfs(start, gaps, 0)
                    if found:
                        break
                # the fewest falls whose order ends where the next event starts; more falls only
                # when none of that many does
                if any(f[0][0] == 0 for f in found):
                    break
        except _Budget:
            pass
        if not found:
            return None
        best = min(found, key=lambda f: f[0])[1]
        return [group[i] for i in best]

    def _after(self, item: tuple, before: int) -> int:
        return before + item[3] if item[1] == 1 else before - item[3]

    def _best_start(self, group: list[tuple], eligible: list[int]) -> int | None:
        """No event of an equal-time group starts at the running total: a pre-capture tensor was
        released unseen just before. The event to go first is the one after which the others
        chain exactly on the recorded totals (most of them; the first such on a tie)."""
        best, best_score = None, -1
        for index in eligible:
            before = self._before(group[index])
            if before is None or before > self.running:
                continue
            running = self._after(group[index], before)
            rest = group[:index] + group[index + 1:]
            score = 0
            while rest:
                nxt = next((j for j, it in enumerate(rest) if self._before(it) == running), None)
                if nxt is None:
                    break
                item = rest.pop(nxt)
                running = self._after(item, running)
                score += 1
            if score > best_score:
                best, best_score = index, score
        return best

    def _next_id(self) -> int:
        self._synthetic += 1
        return self._synthetic

    def _apply(self, item: tuple) -> None:
        time, kind, ident, size, total, reserved, _line, name, addr, stream = item
        fig = self.fig
        running = self.running
        # (comparisons, not max(): this runs for every event)
        if (total is None or running is None or reserved is None or fig.reserved_last is None
                or (total - size if kind == 1 else (total + size if self.release_after else total)) != running):
            self._apply_checked(item)       # the first event, a missing total, a fall or a rise
            return
        # the common event: it starts where the recorded total stands
        fig.events += 1
        fig.checked += 1
        if total > fig.peak_allocated:  # noqa: PLR1730
            fig.peak_allocated = total
        if reserved != fig.reserved_last:
            if 0 < reserved - fig.reserved_last < (1 << 30):
                fig.reserved_small_growths += 1
            fig.reserved_last = reserved
            if reserved > fig.peak_reserved:  # noqa: PLR1730
                fig.peak_reserved = reserved
        if kind == 1:
            running += size
            self._sizes[ident] = size
            if self.emit:
                self.events.append(Event("alloc", ident, size - self.size_pad if size >= _MIN_BLOCK else size, addr,
                                         stream, None, time, name))
            if running > fig.events_peak_allocated:  # noqa: PLR1730
                fig.events_peak_allocated = running
        elif self._sizes.pop(ident, None) is not None:
            running -= size
            if self.emit:
                self.events.append(Event("free", ident, 0, addr, stream, None, time, name))
        self.running = running

    def _apply_checked(self, item: tuple) -> None:
        """:meth:`_apply` for an event that does not start where the recorded total stands."""
        time, kind, ident, size, total, reserved, line, name, addr, stream = item
        fig = self.fig
        fig.events += 1
        if self.first_time is None:
            self.first_time = time
        running = self.running
        if total is not None:
            before = total - size if kind == 1 else (total + size if self.release_after else total)
            if running is None:
                running = fig.allocated_first = before
            elif before != running:
                if before < running:
                    # the totals fell with no row: a tensor allocated before the capture was released
                    gap = running - before
                    unseen = self._next_id()
                    self.initial.append((unseen, gap, "before capture (released unseen)"))
                    if self.emit:
                        self.events.append(Event("free", unseen, 0, None, 0, None, time))
                    fig.unseen_releases += 1
                    fig.unseen_release_bytes += gap
                    running = before
                elif before - running > fig.allocated_max_diff:
                    fig.allocated_max_diff = before - running
                    fig.first_diff_line = line
            fig.checked += 1
            if fig.peak_allocated is None or total > fig.peak_allocated:
                fig.peak_allocated = total       # (a release's "before" total is the previous event's)
        elif running is None:
            running = fig.allocated_first = sum(s for _, s, _ in self.initial)
        if reserved is not None:
            if fig.reserved_first is None:
                fig.reserved_first = reserved
            elif 0 < reserved - fig.reserved_last < (1 << 30):
                fig.reserved_small_growths += 1
            fig.reserved_last = reserved
            if fig.peak_reserved is None or reserved > fig.peak_reserved:
                fig.peak_reserved = reserved
        if kind == 1:
            running += size
            self._sizes[ident] = size
            if self.emit:
                self.events.append(Event("alloc", ident, size - self.size_pad if size >= _MIN_BLOCK else size, addr,
                                         stream, None, time, name))
            fig.events_peak_allocated = max(fig.events_peak_allocated, running)
        elif self._sizes.pop(ident, None) is not None:
            running -= size
            if self.emit:
                self.events.append(Event("free", ident, 0, addr, stream, None, time, name))
        self.running = running

    def initial_events(self, time: int | None) -> list[Event]:
        """The initial state as allocations before the first event (the profiler records no addresses of it)."""
        return [Event("alloc", id=ident, size=size - self.size_pad if size >= _MIN_BLOCK else size, time=time,
                      tag=name) for ident, size, name in self.initial]

    def initial_layout(self, torch: bool) -> Layout | None:
        """The initial state laid out in the recorded reserved total: for PyTorch's caching
        allocator (``torch``) tensors of at most 1 MiB in 2 MiB small-pool segments and the others
        back to back in one large-pool segment, for MindSpore's pool all in one common segment;
        a free tail makes up the recorded reserved memory. The profiler records neither addresses
        nor segments, so the placement is this guess; the reserved figure and the blocks' sizes
        are the recording's. None when the first reserved total is unknown."""
        reserved = self.fig.reserved_first
        if reserved is None or not self.initial:
            return None
        small = [(i, s, n) for i, s, n in self.initial if torch and s <= _SMALL_SIZE]
        large = [(i, s, n) for i, s, n in self.initial if not torch or s > _SMALL_SIZE]
        segments: list[Segment] = []
        addr = _LAYOUT_BASE
        blocks: list[Block] = []
        used = 0
        for ident, size, name in small:
            if used + size > _SMALL_SEGMENT:
                segments.append(_segment(addr, _SMALL_SEGMENT, blocks, "small"))
                addr, blocks, used = addr + _SMALL_SEGMENT, [], 0
            blocks.append(Block(addr + used, size, True, id=ident, tag=name))
            used += size
        if blocks:
            segments.append(_segment(addr, _SMALL_SEGMENT, blocks, "small"))
            addr += _SMALL_SEGMENT
        held = sum(s for _, s, _ in large)
        room = reserved - (addr - _LAYOUT_BASE)
        if large or room > 0:
            size = max(held, room)
            cursor, blocks = addr, []
            for ident, block, name in large:
                blocks.append(Block(cursor, block, True, id=ident, tag=name))
                cursor += block
            segments.append(_segment(addr, size, blocks, "large" if torch else "common"))
        return Layout(segments)


def _segment(addr: int, size: int, blocks: list[Block], pool: str) -> Segment:
    end = blocks[-1].end if blocks else addr
    if end < addr + size:
        blocks = blocks + [Block(end, addr + size - end, False)]
    return Segment(addr, size, blocks, pool=pool)


class _Budget(Exception):
    """An equal-time group's search went on too long: the greedy order is taken."""


class _OutOfOrder(Exception):
    """A row's time lies before what was already emitted: the component is read again, sorted."""


class _RowMerge:
    """Rows (tensor with allocation and release) -> time-sorted events, merging releases from a heap.

    Rows must come sorted by allocation time; memory is the live tensors' releases.
    """

    def __init__(self, timeline: _Timeline, source: str) -> None:
        self.timeline = timeline
        self.source = source
        self.heap: list[tuple] = []
        self.last_alloc: int | None = None

    def push(self, row: tuple) -> None:
        # row: (alloc_ns, release_ns, size, a_total, a_reserved, r_total, r_reserved, line, name, addr, stream)
        alloc_ns, release_ns, size, a_total, a_res, r_total, r_res, line, name, addr, stream = row
        timeline = self.timeline
        timeline.fig.rows += 1
        if alloc_ns is None:
            if release_ns is None:
                timeline.add_initial(line, size, name)
                return
            if timeline._group_time is not None and release_ns < timeline._group_time:
                raise _OutOfOrder()
            timeline.add_initial(line, size, name)
            heapq.heappush(self.heap, (release_ns, 0, line, size, r_total, r_res, line, name, addr, stream))
            return
        if self.last_alloc is not None and alloc_ns < self.last_alloc:
            raise _OutOfOrder()
        self.last_alloc = alloc_ns
        heap = self.heap
        while heap and heap[0][0] <= alloc_ns:
            timeline.feed(heapq.heappop(heap))     # (time, 0, line, ...): ordered by time, then line
        timeline.feed((alloc_ns, 1, line, size, a_total, a_res, line, name, addr, stream))
        if release_ns is not None:
            if release_ns < alloc_ns:
                raise InputError(f"release time before allocation time ({release_ns / 1000:.3f} < "
                                 f"{alloc_ns / 1000:.3f} us)", source=self.source, line=line)
            heapq.heappush(heap, (release_ns, 0, line, size, r_total, r_res, line, name, addr, stream))

    def finish(self) -> None:
        heap = self.heap
        while heap:
            self.timeline.feed(heapq.heappop(heap))
        self.timeline.finish()


# --------------------------------------------------------------------------- inputs

@dataclass
class _Inputs:
    """The files of one rank's profiler output."""

    operator_memory: Path | None = None
    memory_record: Path | None = None
    npu_module_mem: Path | None = None
    db: Path | None = None
    rank_dir: Path | None = None
    notes: list[str] = field(default_factory=list)


def _locate(path: Path) -> _Inputs:
    source = str(path)
    if path.is_dir():
        out_dir = _output_dir(path)
        ranks = _rank_dirs(path) if out_dir is None else []
        if ranks:
            # a job's folder: the lowest rank is read, as other readers read the lowest device
            found = _locate(ranks[0])
            found.notes.append(f"{len(ranks)} ranks' folders here ({', '.join(p.name for p in ranks[:8])}"
                               f"{' ...' if len(ranks) > 8 else ''}): {ranks[0].name} read")
            return found
        if out_dir is None:
            raise InputError(f"is a directory without {OUTPUT_DIR}/, {OPERATOR_MEMORY}, {MEMORY_RECORD} or an "
                             f"ascend_*_profiler_N.db; expected the Ascend profiler's output of one rank",
                             source=source)
        found = _Inputs(rank_dir=out_dir.parent if out_dir.name == OUTPUT_DIR else path)
        for name, attr in ((OPERATOR_MEMORY, "operator_memory"), (MEMORY_RECORD, "memory_record"),
                           (NPU_MODULE_MEM, "npu_module_mem")):
            if (out_dir / name).is_file():
                setattr(found, attr, out_dir / name)
        dbs = [p for p in _list(out_dir) if _DB_NAME.match(p.name)]
        if dbs:
            found.db = dbs[0]
        if found.operator_memory is None and found.memory_record is None and found.db is None:
            raise InputError(f"{out_dir.name}/ holds no memory files ({OPERATOR_MEMORY}, {MEMORY_RECORD} or "
                             f"ascend_*_profiler_N.db); the profiler writes them with profile_memory=True",
                             source=source)
        if found.operator_memory is not None or found.memory_record is not None:
            found.db = None         # the text export is the one read; the db holds the same data
        if found.operator_memory is not None and found.memory_record is not None:
            # the rows carry the same PTA/GE totals at every event; memory_record.csv (2-4 lines a
            # tensor) is read only on its own
            found.notes.append(f"{MEMORY_RECORD} not read: {OPERATOR_MEMORY}'s totals are the same series")
            found.memory_record = None
        return found
    head = _head(path)
    found = _Inputs(rank_dir=path.parent.parent if path.parent.name == OUTPUT_DIR else None)
    if is_sqlite(head):
        found.db = path
        return found
    kind = profiler_file_kind(head.decode("utf-8", errors="replace").split("\n", 1)[0])
    if kind is None:
        raise InputError("not an Ascend profiler memory file; expected operator_memory.csv, memory_record.csv, "
                         "npu_module_mem.csv or ascend_*_profiler_N.db", source=source, line=1)
    setattr(found, kind, path)
    return found


def _head(path: Path, size: int = 4096) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(size)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", source=str(path)) from None


def _csv_reader(path: Path, expected: str):
    """``csv.reader`` over the file's bounded lines (core.lines: CRLF or LF, a line over 1 MiB an
    error); its ``line_num`` is the file's line number (no field spans lines in these files)."""
    return csv.reader(map(itemgetter(1), iter_lines(path, expected=expected)))


def _csv_rows(path: Path, expected: str) -> Iterator[tuple[int, list[str]]]:
    """``(line, cells)`` of a CSV file (see :func:`_csv_reader`)."""
    reader = _csv_reader(path, expected)
    try:
        for cells in reader:
            yield reader.line_num, cells
    except csv.Error as exc:
        raise InputError(f"malformed CSV: {exc}", source=str(path), line=reader.line_num + 1) from None


def _columns(header: list[str], needed: Iterable[str], source: str) -> dict[str, int]:
    names = [c.strip().lstrip("\ufeff") for c in header]
    index = {name: i for i, name in enumerate(names)}
    missing = [c for c in needed if c not in index]
    if missing:
        raise InputError(f"missing column(s) {', '.join(missing)}; header is {','.join(names)[:200]!r}",
                         source=source, line=1)
    return index


# --------------------------------------------------------------------------- writer and model

def _profiler_info(rank_dir: Path | None) -> tuple[dict, dict]:
    """``profiler_info_N.json`` and ``profiler_metadata.json`` of the rank (empty when absent or bad)."""
    info: dict = {}
    metadata: dict = {}
    if rank_dir is None:
        return info, metadata
    for candidate in _list(rank_dir):
        if candidate.name.startswith("profiler_info") and candidate.suffix == ".json":
            info = _json(candidate)
            break
    if (rank_dir / "profiler_metadata.json").is_file():
        metadata = _json(rank_dir / "profiler_metadata.json")
    return info, metadata


def _json(path: Path) -> dict:
    from ms_memopt.core.jsontext import parse_json
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
        value = parse_json(text, source=str(path))
    except (OSError, InputError):
        return {}
    return value if isinstance(value, dict) else {}


def _writer(inputs: _Inputs, info: dict, hints: dict[str, str]) -> tuple[str, str]:
    """Which profiler wrote the files (``torch_npu`` or ``mindspore``) and what said so."""
    if inputs.db is not None:
        match = _DB_NAME.match(inputs.db.name)
        if match:
            return (TORCH_NPU if match.group(1) == "pytorch" else MINDSPORE), f"the db's name {inputs.db.name}"
    if inputs.rank_dir is not None:
        if inputs.rank_dir.name.endswith("_ascend_pt"):
            return TORCH_NPU, f"the folder's name {inputs.rank_dir.name} (*_ascend_pt)"
        if inputs.rank_dir.name.endswith("_ascend_ms"):
            return MINDSPORE, f"the folder's name {inputs.rank_dir.name} (*_ascend_ms)"
    if "ms_version" in info or "ms_profiler_info" in info:
        return MINDSPORE, "profiler_info_N.json (ms_version)"
    if isinstance(info.get("config"), dict) and "common_config" in info["config"]:
        return TORCH_NPU, "profiler_info_N.json (torch_npu's config)"
    if hints:
        writer, why = next(iter(hints.items()))
        return writer, why
    return TORCH_NPU, "nothing in the files (torch_npu assumed)"


def _allocator(writer: str, metadata: dict, info: dict, small_growths: int) -> tuple[list[str], str]:
    """The models that fit, best first (replay takes the first one registered), and why."""
    if writer == TORCH_NPU:
        env = metadata.get("ENV_VARIABLES") if isinstance(metadata.get("ENV_VARIABLES"), dict) else {}
        conf = str(env.get("PYTORCH_NPU_ALLOC_CONF") or "")
        if re.search(r"expandable_segments\s*:\s*true", conf, re.IGNORECASE):
            return (["torch-npu-expandable", "torch-expandable"],
                    f"torch_npu's profiler; PYTORCH_NPU_ALLOC_CONF={conf!r} in profiler_metadata.json")
        said = f"PYTORCH_NPU_ALLOC_CONF={conf!r}" if conf else "PYTORCH_NPU_ALLOC_CONF unset"
        return ["torch-npu", "torch"], f"torch_npu's profiler; {said} in profiler_metadata.json" if metadata else \
            "torch_npu's profiler (no profiler_metadata.json: default settings assumed)"
    # MindSpore's pool grows by increase_size blocks (1 GiB default); VMM maps 2 MiB chunks
    if small_growths:
        return ["mindspore-vmm", "mindspore"], (f"MindSpore's profiler; its reserved total grew by less than 1 GiB "
                                                f"({small_growths} times): VMM's 2 MiB chunks, not the pool's blocks")
    return ["mindspore", "mindspore-vmm"], "MindSpore's profiler; reserved grew in blocks of 1 GiB or more"


# --------------------------------------------------------------------------- readers

def _operator_rows(path: Path, writer_hints: dict) -> Iterator[tuple[str | None, tuple]]:
    """``(component, row)`` for each row of ``operator_memory.csv`` (component None: the framework's);
    the stream pointers numbered 0, 1, ... in the order they appear."""
    source = str(path)
    reader = _csv_reader(path, "the Ascend profiler's operator_memory.csv")
    try:
        header = next(reader)
    except StopIteration:
        raise InputError("empty file; expected operator_memory.csv's header", source=source) from None
    except csv.Error as exc:
        raise InputError(f"malformed CSV: {exc}", source=source, line=1) from None
    col = _columns(header, _OPERATOR_COLUMNS, source)
    stream_col = col.get("Stream Ptr")
    i_name, i_size, i_at, i_rt = col["Name"], col["Size(KB)"], col["Allocation Time(us)"], col["Release Time(us)"]
    i_aa, i_ar = col["Allocation Total Allocated(MB)"], col["Allocation Total Reserved(MB)"]
    i_ra, i_rr = col["Release Total Allocated(MB)"], col["Release Total Reserved(MB)"]
    width = len(header)
    streams: dict[str, int] = {}
    try:
        for cells in reader:
            line = reader.line_num
            if len(cells) < width:
                if not cells or (len(cells) == 1 and not cells[0].strip()):
                    continue
                raise InputError(f"{len(cells)} fields; expected {width} (the header's columns)", source=source,
                                 line=line)
            if not writer_hints:
                if "N/A" in cells:
                    writer_hints[MINDSPORE] = "operator_memory.csv's N/A fields (MindSpore's writer)"
                elif cells[i_at].endswith("\t"):
                    writer_hints[TORCH_NPU] = "operator_memory.csv's times ending in a TAB (torch_npu's writer)"
            name = intern(cells[i_name])          # one string per operator name, not per row
            ge = name.startswith(_GE_PREFIX)
            stream = streams.setdefault(cells[stream_col].strip() if stream_col is not None else "", len(streams))
            try:
                # the common row, every field present: float() takes the TAB, the ns are the digits
                at, rt = cells[i_at].strip(), cells[i_rt].strip()
                size = float(cells[i_size])
                a_total, a_res = float(cells[i_aa]), float(cells[i_ar])
                r_total, r_res = float(cells[i_ra]), float(cells[i_rr])
                if at[-4:-3] != "." or rt[-4:-3] != "." or not (
                        0 <= size < 1e15 and 0 <= a_total < 1e12 and 0 <= a_res < 1e12 and 0 <= r_total < 1e12
                        and 0 <= r_res < 1e12):
                    raise ValueError
                row = (int(at.replace(".", "", 1)), int(rt.replace(".", "", 1)), round(size * _KB), round(a_total * _MB),
                       round(a_res * _MB), round(r_total * _MB), round(r_res * _MB), line,
                       intern(name[len(_GE_PREFIX):]) if ge else name, None, stream)
            except ValueError:
                row = _operator_row(cells, (i_size, i_at, i_rt, i_aa, i_ar, i_ra, i_rr), source, line,
                                    intern(name[len(_GE_PREFIX):]) if ge else name, stream)
            yield (GE if ge else None), row
    except csv.Error as exc:
        raise InputError(f"malformed CSV: {exc}", source=source, line=reader.line_num + 1) from None


def _operator_row(cells: list[str], index: tuple, source: str, line: int, name: str, stream: str) -> tuple:
    """One row with empty fields, or a bad one: each field checked, the error naming it."""
    i_size, i_at, i_rt, i_aa, i_ar, i_ra, i_rr = index
    size = _bytes(cells[i_size], _KB, "Size(KB)", source, line)
    if size is None:
        raise InputError("Size(KB): empty; expected the block size in KB", source=source, line=line)
    row = (_ns(cells[i_at], "Allocation Time(us)", source, line), _ns(cells[i_rt], "Release Time(us)", source, line),
           size, _bytes(cells[i_aa], _MB, "Allocation Total Allocated(MB)", source, line),
           _bytes(cells[i_ar], _MB, "Allocation Total Reserved(MB)", source, line),
           _bytes(cells[i_ra], _MB, "Release Total Allocated(MB)", source, line),
           _bytes(cells[i_rr], _MB, "Release Total Reserved(MB)", source, line), line, name, None, stream)
    if row[0] is None and row[1] is None and row[3] is None:
        raise InputError("neither an allocation nor a release time nor totals; expected a tensor's row",
                         source=source, line=line)
    return row


def _record_series(path: Path, writer_hints: dict, *, keep_points: bool = True) -> dict[str, dict]:
    """Per component of ``memory_record.csv``: rows, peak allocated and reserved (bytes) and, with
    ``keep_points``, every ``(time, allocated, reserved, line)``."""
    source = str(path)
    rows = _csv_rows(path, "the Ascend profiler's memory_record.csv")
    try:
        _, header = next(rows)
    except StopIteration:
        raise InputError("empty file; expected memory_record.csv's header", source=source) from None
    col = _columns(header, _RECORD_COLUMNS, source)
    i_comp, i_time = col["Component"], col["Timestamp(us)"]
    i_alloc, i_res = col["Total Allocated(MB)"], col["Total Reserved(MB)"]
    width = len(header)
    series: dict[str, dict] = {}
    for line, cells in rows:
        if len(cells) < width:
            if not cells or (len(cells) == 1 and not cells[0].strip()):
                continue
            raise InputError(f"{len(cells)} fields; expected {width}", source=source, line=line)
        component = cells[i_comp].strip()
        entry = series.get(component)
        if entry is None:
            entry = series[component] = {"rows": 0, "peak_allocated": None, "peak_reserved": None, "points": []}
            if component.startswith("MindSpore"):
                writer_hints.setdefault(MINDSPORE, "memory_record.csv's MindSpore component")
            elif component.startswith("PTA"):
                writer_hints.setdefault(TORCH_NPU, "memory_record.csv's PTA component")
        entry["rows"] += 1
        try:
            a, r = float(cells[i_alloc]), float(cells[i_res])
            if not (0 <= a < 1e12 and 0 <= r < 1e12):
                raise ValueError
        except ValueError:
            a = _number(cells[i_alloc], "Total Allocated(MB)", source, line)
            r = _number(cells[i_res], "Total Reserved(MB)", source, line)
        time = _ns(cells[i_time], "Timestamp(us)", source, line) if keep_points else None
        if a is not None and (entry["peak_allocated"] is None or a > entry["peak_allocated"]):
            entry["peak_allocated"] = a
        if r is not None and (entry["peak_reserved"] is None or r > entry["peak_reserved"]):
            entry["peak_reserved"] = r
        if keep_points:
            entry["points"].append((time, a, r, line))
    # MindSpore's MemoryRecordBean divides KB by 1000 and calls it MB
    unit = 1000 * _KB if any(name.startswith("MindSpore") for name in series) else _MB
    for entry in series.values():
        for key in ("peak_allocated", "peak_reserved"):
            if entry[key] is not None:
                entry[key] = round(entry[key] * unit)
        entry["points"] = [(t, None if a is None else round(a * unit), None if r is None else round(r * unit), n)
                           for t, a, r, n in entry["points"]]
    return series


def _module_series(path: Path) -> dict[str, int]:
    """Peak reserved bytes per CANN module of ``npu_module_mem.csv`` (modules that held any)."""
    source = str(path)
    rows = _csv_rows(path, "the Ascend profiler's npu_module_mem.csv")
    try:
        _, header = next(rows)
    except StopIteration:
        raise InputError("empty file; expected npu_module_mem.csv's header", source=source) from None
    col = _columns(header, _MODULE_COLUMNS, source)
    peaks: dict[str, int] = {}
    for line, cells in rows:
        if not cells or (len(cells) == 1 and not cells[0].strip()):
            continue
        if len(cells) < len(header):
            raise InputError(f"{len(cells)} fields; expected {len(header)}", source=source, line=line)
        _ns(cells[col["Timestamp(us)"]], "Timestamp(us)", source, line)
        value = _bytes(cells[col["Total Reserved(MB)"]], _MB, "Total Reserved(MB)", source, line) or 0
        module = cells[col["Component"]].strip()
        peaks[module] = max(peaks.get(module, 0), value)
    return {m: v for m, v in sorted(peaks.items()) if v > 0}


class _Strings:
    """``STRING_IDS`` of a profiler db, looked up once per id."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.cache: dict[int, str] = {}
        self.has = _has_table(db, "STRING_IDS")

    def __call__(self, ident) -> str | None:
        if ident is None or not isinstance(ident, int):
            return None if ident is None else str(ident)
        if ident not in self.cache:
            value = None
            if self.has:
                got = self.db.execute("SELECT value FROM STRING_IDS WHERE id = ?", (ident,)).fetchone()
                value = got[0] if got else None
            self.cache[ident] = value if value is not None else str(ident)
        return self.cache[ident]


def _has_table(db: sqlite3.Connection, name: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None


def _open_db(path: Path) -> sqlite3.Connection:
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.Error as exc:
        raise InputError(f"not a readable SQLite database ({exc})", source=str(path)) from None
    return db


def _db_int(value, what: str, source: str, line: int) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        return parse_int(value, what, source=source, line=line)
    if not isinstance(value, int):
        raise InputError(f"{what}: expected an integer, got {value!r}", source=source, line=line)
    return value


# --------------------------------------------------------------------------- the reader

def read_ascend_profiler(path: str | Path, *, component: str | None = None, _emit: bool = True) -> Trace:
    """Read the Ascend profiler's memory output of one rank (see the module docstring).

    Args:
        path: the rank's folder (``*_ascend_pt``, ``*_ascend_ms``), ``ASCEND_PROFILER_OUTPUT/``,
            ``operator_memory.csv``, ``memory_record.csv``, ``npu_module_mem.csv`` or the ``.db``.
        component: the component whose events the Trace holds (``"PTA"``, ``"MindSpore"``,
            ``"GE"``); default the framework's, else the first with events.

    Returns:
        A :class:`Trace` of format ``ascend-profiler``; sizes in bytes, ``time`` in ns.
        ``meta["recorded"]`` holds the chosen component's recorded figures (peak allocated and
        reserved, ``allocated_max_diff``), ``meta["components"]`` every component's,
        ``meta["allocator_candidates"]`` the models that fit, best first.

    Raises:
        InputError: an unreadable or malformed file, naming the file and line (or table and row).
    """
    path = Path(path)
    source = str(path)
    inputs = _locate(path)
    info, metadata = _profiler_info(inputs.rank_dir)
    hints: dict[str, str] = {}
    record = _record_series(inputs.memory_record, hints) if inputs.memory_record is not None else {}
    modules = _module_series(inputs.npu_module_mem) if inputs.npu_module_mem is not None else {}
    timelines: dict[str, _Timeline] = {}
    files: list[str] = []
    if inputs.db is not None:
        writer, why = _writer(inputs, info, hints)
        timelines = _read_db(inputs.db, writer, record)
        files.append(inputs.db.name)
    elif inputs.operator_memory is not None:
        timelines, writer, why = _read_operator_memory(inputs, info, hints, emit=_emit)
        files.append(OPERATOR_MEMORY)
    else:
        writer, why = _writer(inputs, info, hints)
        if record:
            timelines = _from_record(record, writer)
    if inputs.memory_record is not None:
        files.append(MEMORY_RECORD)
    if inputs.npu_module_mem is not None:
        files.append(NPU_MODULE_MEM)

    framework = _FRAMEWORK[writer]
    if component is None:
        component = framework if framework in timelines else next(iter(timelines), framework)
    elif component not in timelines and timelines:
        raise InputError(f"no component {component!r} in the recording; it has {', '.join(timelines)}",
                         source=source, key="component")
    chosen = timelines.get(component)
    events: list[Event] = []
    initial = None
    if chosen is not None:
        start = chosen.first_time
        if component == framework:
            initial = chosen.initial_layout(torch=writer == TORCH_NPU)
        events = chosen.events if initial is not None else chosen.initial_events(start) + chosen.events

    components = {}
    for name, timeline in timelines.items():
        figures = timeline.fig.to_dict()
        figures["initial_tensors"] = len(timeline.initial)
        components[name] = figures
    for name, entry in record.items():
        figures = components.setdefault(name, {})
        figures["memory_record_rows"] = entry["rows"]
        for key in ("peak_allocated", "peak_reserved"):
            value = entry[key]
            if value is not None and (figures.get(key) is None or value > figures[key]):
                figures[key] = value
    small = components.get(framework, {}).get("reserved_small_growths", 0)
    allocator, allocator_why = _allocator(writer, metadata, info, small)
    if component != framework:
        allocator, allocator_why = (["mindspore", "torch"],
                                    f"the {component} component: no model of its own allocator (closest given)")
    recorded = dict(components.get(component, {}))
    recorded["component"] = component
    meta = {
        "writer": writer, "writer_evidence": why, "files": files,
        "component": component, "components": components,
        "recorded": recorded, "allocator_candidates": allocator, "allocator_evidence": allocator_why,
        "framework": writer,
        "time_unit": "ns",
    }
    if modules:
        meta["modules_peak_reserved"] = modules
    if inputs.notes:
        meta["notes"] = inputs.notes
    if writer == TORCH_NPU and component == framework:
        meta["size_rule"] = (f"events ask for the recorded block size - {_NPU_PAD} B: torch_npu's round_size adds "
                             f"{_NPU_PAD} B and rounds up to 512 B, so the model's block is the recorded one")
    if initial is not None:
        meta["initial_state"] = (f"{len(chosen.initial)} tensors allocated before the capture in "
                                 f"{len(initial.segments)} segments of the recorded reserved total at the first row; "
                                 f"their placement is a guess")
    trace = Trace(events, source=source, format=FORMAT, initial=initial, meta=meta)
    if not _emit and chosen is not None:
        trace.meta["_stream"] = (inputs.operator_memory, writer, component, chosen.release_after, chosen.fig.unsorted,
                                 [] if initial is not None else events)
    return trace


def stream_ascend_profiler(path: str | Path, *, component: str | None = None) -> Trace:
    """:func:`read_ascend_profiler` as a stream (``load_trace(..., stream=True)``): the events of
    ``operator_memory.csv`` are produced as ``trace.events`` is iterated, from a second read of
    the file, so memory is the live tensors', not the file's events.

    A first read learns what the events need before they start (the initial state, the rule of
    the release totals) and every figure; a file whose rows are out of time order, the db and a
    lone ``memory_record.csv`` are read whole, as :func:`read_ascend_profiler` does.
    """
    trace = read_ascend_profiler(path, component=component, _emit=False)
    plan = trace.meta.pop("_stream", None)
    if plan is None or plan[0] is None or plan[4]:
        return read_ascend_profiler(path, component=component)
    trace.events = _ProfilerEvents(*plan[:4], initial_events=plan[5])
    trace.meta["streamed"] = True
    return trace


class _ProfilerEvents:
    """One component's events of an ``operator_memory.csv``, made from the file each time they are
    iterated (after the initial state's allocations, when it is not a layout)."""

    def __init__(self, path: Path, writer: str, component: str, release_after: bool, *,
                 initial_events: list[Event]) -> None:
        self.path, self.writer, self.component = path, writer, component
        self.release_after = release_after
        self.initial_events = initial_events

    def __iter__(self) -> Iterator[Event]:
        yield from self.initial_events
        framework = _FRAMEWORK[self.writer]
        timeline = _new_timeline(self.component, self.writer, self.release_after)
        merge = _RowMerge(timeline, str(self.path))
        events = timeline.events
        for comp, row in _operator_rows(self.path, {}):
            if comp is None:
                comp = WORKSPACE if self.writer == TORCH_NPU and row[4] == 0 and (row[3] or 0) > 0 else framework
            if comp != self.component:
                continue
            merge.push(row)
            if events:
                yield from events
                events.clear()
        merge.finish()
        yield from events
        events.clear()


def _new_timeline(component: str, writer: str, release_after: bool | None = None, emit: bool = True) -> _Timeline:
    if release_after is None:
        release_after = component != GE       # CANN reports GE's release with the total before it
    pad = _NPU_PAD if (writer == TORCH_NPU and component == _FRAMEWORK[TORCH_NPU]) else 0
    return _Timeline(component, release_after=release_after, size_pad=pad, emit=emit)


def _read_operator_memory(inputs: _Inputs, info: dict, hints: dict, *,
                          emit: bool = True) -> tuple[dict[str, _Timeline], str, str]:
    """Stream ``operator_memory.csv`` into one timeline per component; read again where needed."""
    path = inputs.operator_memory
    # the writer decides the framework component's name; the file's first rows may say who wrote it
    local_hints: dict[str, str] = {}
    first = _operator_rows(path, local_hints)
    next(first, None)
    first.close()
    for key, value in local_hints.items():
        hints.setdefault(key, value)
    writer, why = _writer(inputs, info, hints)
    framework = _FRAMEWORK[writer]

    def run(only: str | None, sort: bool, release_after: dict[str, bool]) -> dict[str, _Timeline]:
        timelines: dict[str, _Timeline] = {}
        merges: dict[str, _RowMerge] = {}
        rows = _operator_rows(path, {})
        if sort:
            rows = sorted((r for r in rows if only is None or (r[0] or _framework_or_workspace(r[1])) == only),
                          key=lambda r: (-1 if r[1][0] is None else r[1][0], r[1][7]))
        for comp, row in rows:
            if comp is None:
                # torch_npu's NPUWorkspaceAllocator reports its own allocated total with reserved 0
                # ("reserved_bytes not used"); no caching-allocator total has reserved < allocated
                comp = WORKSPACE if writer == TORCH_NPU and row[4] == 0 and (row[3] or 0) > 0 else framework
            if only is not None and comp != only:
                continue
            merge = merges.get(comp)
            if merge is None:
                timelines[comp] = _new_timeline(comp, writer, release_after.get(comp), emit)
                merge = merges[comp] = _RowMerge(timelines[comp], str(path))
            merge.push(row)
        for comp, merge in merges.items():
            merge.finish()
            timelines[comp].fig.unsorted = sort
        return timelines

    def _framework_or_workspace(row: tuple) -> str:
        return WORKSPACE if writer == TORCH_NPU and row[4] == 0 and (row[3] or 0) > 0 else framework

    try:
        timelines = run(None, False, {})
    except _OutOfOrder:
        timelines = {}
        names = {(comp or _framework_or_workspace(row)) for comp, row in _operator_rows(path, {})}
        for name in sorted(names):
            try:
                timelines.update(run(name, False, {}))
            except _OutOfOrder:
                timelines.update(run(name, True, {}))
    for name in list(timelines):
        if timelines[name].fig.allocated_max_diff:
            # the release totals may be the other way round (taken before the release, as CANN's)
            flipped = not timelines[name].release_after
            again = run(name, timelines[name].fig.unsorted, {name: flipped})[name]
            if _better(again.fig, timelines[name].fig):
                timelines[name] = again
    order = [framework] + sorted(n for n in timelines if n != framework)
    return {n: timelines[n] for n in order if n in timelines}, writer, why


def _better(new: _Figures, old: _Figures) -> bool:
    return (new.allocated_max_diff, new.unseen_release_bytes) < (old.allocated_max_diff, old.unseen_release_bytes)


def _read_db(path: Path, writer: str, record: dict) -> dict[str, _Timeline]:
    """``OP_MEMORY`` (the framework's tensors) and ``NPU_OP_MEM`` (GE's records with addresses)."""
    db = _open_db(path)
    source = str(path)
    strings = _Strings(db)
    framework = _FRAMEWORK[writer]
    timelines: dict[str, _Timeline] = {}
    try:
        if not _has_table(db, "OP_MEMORY") and not _has_table(db, "NPU_OP_MEM"):
            tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
            raise InputError(f"no OP_MEMORY or NPU_OP_MEM table (tables: {', '.join(tables[:12]) or 'none'}); "
                             f"the profiler writes them with profile_memory=True", source=source)
        ge_from_op_mem = _has_table(db, "NPU_OP_MEM")
        if _has_table(db, "OP_MEMORY"):
            for sort in (False, True):
                try:
                    timelines = _db_op_memory(db, strings, writer, sort, skip_ge=ge_from_op_mem, source=source)
                    break
                except _OutOfOrder:
                    continue
            if any(t.fig.allocated_max_diff for t in timelines.values()):
                for name, timeline in list(timelines.items()):
                    if timeline.fig.allocated_max_diff:
                        again = _db_op_memory(db, strings, writer, True, skip_ge=ge_from_op_mem, source=source,
                                              only=name, release_after={name: not timeline.release_after})[name]
                        if _better(again.fig, timeline.fig):
                            timelines[name] = again
        if ge_from_op_mem:
            timeline = _db_npu_op_mem(db, strings, writer, source)
            if timeline is not None:
                timelines[GE] = timeline
        record.update(_db_memory_record(db, strings, source))
    except sqlite3.Error as exc:
        raise InputError(f"SQLite error reading the memory tables: {exc}", source=source) from None
    finally:
        db.close()
    order = [framework] + sorted(n for n in timelines if n != framework)
    return {n: timelines[n] for n in order if n in timelines}


_OP_MEMORY_SQL = ("SELECT rowid, name, size, allocationTime, releaseTime, allocationTotalAllocated, "
                  "allocationTotalReserved, releaseTotalAllocated, releaseTotalReserved, streamPtr, "
                  "allocationTotalActive FROM OP_MEMORY")


def _db_op_memory(db, strings, writer, sort, *, skip_ge, source, only=None, release_after=None):
    framework = _FRAMEWORK[writer]
    sql = _OP_MEMORY_SQL + (" ORDER BY allocationTime IS NOT NULL, allocationTime, rowid" if sort else " ORDER BY rowid")
    timelines: dict[str, _Timeline] = {}
    merges: dict[str, _RowMerge] = {}
    streams: dict[str, dict] = {}
    for rowid, name, size, at, rt, aa, ar, ra, rr, stream, active in db.execute(sql):
        where = f"OP_MEMORY row {rowid}"
        # GE's rows carry no active totals and no stream (torch_npu's MemoryDbParser)
        comp = GE if (active is None and stream is None and aa is not None) else framework
        if comp == framework and writer == TORCH_NPU and ar == 0 and (aa or 0) > 0:
            comp = WORKSPACE        # the workspace allocator's rows (reserved not reported), as in the text export
        if comp == GE and skip_ge:
            continue
        if only is not None and comp != only:
            continue
        size = _db_int(size, "size", where, rowid)
        if size is None or size < 0:
            raise InputError(f"size: expected a non-negative integer, got {size!r}", source=source, key=where)
        row = (_db_int(at, "allocationTime", where, rowid), _db_int(rt, "releaseTime", where, rowid), size,
               _db_int(aa, "allocationTotalAllocated", where, rowid), _db_int(ar, "allocationTotalReserved", where, rowid),
               _db_int(ra, "releaseTotalAllocated", where, rowid), _db_int(rr, "releaseTotalReserved", where, rowid),
               rowid, strings(name), None)
        merge = merges.get(comp)
        if merge is None:
            timelines[comp] = _new_timeline(comp, writer, (release_after or {}).get(comp))
            merge = merges[comp] = _RowMerge(timelines[comp], source)
            streams[comp] = {}
        ids = streams[comp]
        merge.push(row + (ids.setdefault(stream, len(ids)),))
    for comp, merge in merges.items():
        merge.finish()
        timelines[comp].fig.unsorted = sort
    return timelines


def _db_npu_op_mem(db, strings, writer, source) -> _Timeline | None:
    """GE's allocate/release records (``NPU_OP_MEM``, time-sorted) with their device addresses."""
    timeline = _new_timeline(GE, writer)
    open_ids: dict[tuple, int] = {}
    sizes: dict[int, int] = {}
    any_rows = False
    pending: list[tuple] = []
    for rowid, name, addr, kind, size, time, total, reserved in db.execute(
            "SELECT rowid, operatorName, addr, type, size, timestampNs, totalAllocate, totalReserve FROM NPU_OP_MEM "
            "ORDER BY timestampNs, rowid"):
        any_rows = True
        where = f"NPU_OP_MEM row {rowid}"
        kind_name = strings(kind)
        size = _db_int(size, "size", where, rowid)
        time = _db_int(time, "timestampNs", where, rowid)
        addr = _db_int(addr, "addr", where, rowid)
        if size is None or time is None:
            raise InputError("size and timestampNs must be integers", source=source, key=where)
        size = abs(size)
        total = _db_int(total, "totalAllocate", where, rowid)
        reserved = _db_int(reserved, "totalReserve", where, rowid)
        op = strings(name)
        key = (op, addr)
        if kind_name == "allocate":
            timeline.fig.rows += 1
            open_ids[key] = rowid
            sizes[rowid] = size
            pending.append((time, 1, rowid, size, total, reserved, rowid, op, addr, 0))
        elif kind_name == "release":
            ident = open_ids.pop(key, None)
            if ident is None:
                # released in the capture, allocated before it: a tensor of the initial state
                ident = rowid
                timeline.add_initial(ident, size, op)
                timeline.fig.rows += 1
            pending.append((time, 0, ident, size, total, reserved, rowid, op, addr, 0))
        else:
            raise InputError(f"type {kind_name!r}: expected allocate or release", source=source, key=where)
    if not any_rows:
        return None
    for item in pending:
        timeline.feed(item)
    timeline.finish()
    return timeline


def _db_memory_record(db, strings, source) -> dict[str, dict]:
    if not _has_table(db, "MEMORY_RECORD"):
        return {}
    series: dict[str, dict] = {}
    for rowid, component, time, allocated, reserved in db.execute(
            "SELECT rowid, component, timestamp, totalAllocated, totalReserved FROM MEMORY_RECORD ORDER BY rowid"):
        where = f"MEMORY_RECORD row {rowid}"
        name = strings(component) or "?"
        entry = series.setdefault(name, {"rows": 0, "peak_allocated": None, "peak_reserved": None, "points": []})
        entry["rows"] += 1
        a = _db_int(allocated, "totalAllocated", where, rowid)
        r = _db_int(reserved, "totalReserved", where, rowid)
        if a is not None and (entry["peak_allocated"] is None or a > entry["peak_allocated"]):
            entry["peak_allocated"] = a
        if r is not None and (entry["peak_reserved"] is None or r > entry["peak_reserved"]):
            entry["peak_reserved"] = r
        entry["points"].append((_db_int(time, "timestamp", where, rowid), a, r, rowid))
    return series


def _from_record(record: dict[str, dict], writer: str) -> dict[str, _Timeline]:
    """``memory_record.csv`` alone: each change of a component's allocated total is one event.

    A rise is an allocation of its size; a fall frees the newest live tensor of that size, else
    it is a tensor of the initial state released (the file names no tensor, so the pairing is a
    guess; the curve is the recorded one by construction).
    """
    timelines: dict[str, _Timeline] = {}
    for component, entry in record.items():
        if "+" in component or component in ("APP", "WORKSPACE"):
            continue        # sums of the others, and the whole process: not one pool's events
        timeline = _new_timeline(component, writer, True)
        live_by_size: dict[int, list[int]] = {}
        points = sorted((p for p in entry["points"] if p[0] is not None and p[1] is not None),
                        key=lambda p: (p[0], p[3]))
        last = None
        for time, allocated, reserved, line in points:
            if last is None:
                timeline.running = timeline.fig.allocated_first = last = allocated
                continue
            delta = allocated - last
            if delta > 0:
                live_by_size.setdefault(delta, []).append(line)
                timeline.feed((time, 1, line, delta, allocated, reserved, line, None, None, 0))
            elif delta < 0:
                ids = live_by_size.get(-delta)
                if ids:
                    timeline.feed((time, 0, ids.pop(), -delta, allocated, reserved, line, None, None, 0))
                else:
                    # an unseen release: the timeline makes it one of the initial state
                    timeline.feed((time, 0, -1, 0, allocated, reserved, line, None, None, 0))
            last = allocated
        timeline.finish()
        timeline.fig.rows = len(points)
        timelines[component] = timeline
    return timelines

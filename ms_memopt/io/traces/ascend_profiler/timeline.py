"""One component of the Ascend profiler's memory output: its rows as time-sorted events.

:class:`RowMerge` takes a component's rows (a tensor each: allocation and release time, size,
the recorded totals), sorted by allocation time, and hands :class:`Timeline` the allocations and
releases merged by time, with a heap of the live tensors' releases (memory: the live tensors).
:class:`Timeline` orders equal times by the recorded totals, makes each fall of the totals that
no row explains the release of a tensor of the initial state, compares the recorded total with
the events' own at every row (:class:`Figures`), and turns the initial state into a
:class:`~ms_memopt.core.layout.Layout` sized to the recorded reserved total. The reader is
:mod:`ms_memopt.io.traces.ascend_profiler`; docs/traces.md says why each rule is what it is.

Example:
    >>> timeline = new_timeline("PTA", TORCH_NPU)
    >>> merge = RowMerge(timeline, "operator_memory.csv")
    >>> # (alloc ns, release ns, size, alloc total, reserved, release total, reserved, line, name, addr, stream)
    >>> merge.push((1000, 3000, 4096, 1052672, 2097152, 1048576, 2097152, 2, "aten::mm", None, 0))
    >>> merge.finish()
    >>> [e.action for e in timeline.events], timeline.fig.allocated_first, timeline.fig.allocated_max_diff
    (['alloc', 'free'], 1048576, 0)
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from ms_memopt.core import events as _events
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event
from ms_memopt.core.layout import Block, Layout, Segment

__all__ = [
    "FRAMEWORK",
    "GE",
    "MINDSPORE",
    "NPU_PAD",
    "TORCH_NPU",
    "WORKSPACE",
    "Figures",
    "OutOfOrder",
    "RowMerge",
    "Timeline",
    "better_figures",
    "check_held",
    "new_timeline",
]

TORCH_NPU, MINDSPORE = "torch_npu", "mindspore"
GE = "GE"
WORKSPACE = "WORKSPACE"
#: the writer -> the name of its framework's component
FRAMEWORK = {TORCH_NPU: "PTA", MINDSPORE: "MindSpore"}
# torch_npu's NPUCachingAllocator::round_size adds 32 bytes before rounding up to 512: a block of
# S bytes is what a request of S - 32 becomes (and PyTorch's own rule rounds S - 32 up to S too)
NPU_PAD = 32
_MIN_BLOCK = 512
_SYNTHETIC_ID = 1 << 40     # ids of initial tensors no row names (rows use their line number)
_MAX_TIE_SEARCH = 64        # equal-time groups larger than this keep the default order
# PyTorch's (and torch_npu's) small pool: blocks of at most 1 MiB in 2 MiB segments
_SMALL_SIZE, _SMALL_SEGMENT = 1 << 20, 2 << 20
_LAYOUT_BASE = 0x12C000000000   # where the initial state is placed (an Ascend device address range)


@dataclass(slots=True)
class Figures:
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


class Timeline:
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
        self.fig = Figures(release_totals="after" if release_after else "before")
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
                raise OutOfOrder()
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
        self.running = self._held(kind, ident, size, addr, stream, time, name, running)

    def _held(self, kind: int, ident, size: int, addr, stream, time, name, running: int) -> int:
        """The bytes held after an allocation (``kind`` 1) or a release of a tensor the capture
        saw allocated (others are not counted twice), the event emitted; the events' peak noted."""
        if kind == 1:
            running += size
            self._sizes[ident] = size
            if self.emit:
                self.events.append(Event("alloc", ident, size - self.size_pad if size >= _MIN_BLOCK else size, addr,
                                         stream, None, time, name))
            if running > self.fig.events_peak_allocated:  # noqa: PLR1730
                self.fig.events_peak_allocated = running
        elif self._sizes.pop(ident, None) is not None:
            running -= size
            if self.emit:
                self.events.append(Event("free", ident, 0, addr, stream, None, time, name))
        return running

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
        self.running = self._held(kind, ident, size, addr, stream, time, name, running)

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


class OutOfOrder(Exception):
    """A row's time lies before what was already emitted: the component is read again, sorted."""


def check_held(count: int, source: str) -> None:
    """Refuse to hold more than :data:`~ms_memopt.core.events.MAX_EVENTS_IN_MEMORY` events or rows
    (the cap of every whole-trace reader; ``replay`` reads a long recording as a stream)."""
    if count > _events.MAX_EVENTS_IN_MEMORY:
        raise _events.too_many_events(source)


class RowMerge:
    """Rows (tensor with allocation and release) -> time-sorted events, merging releases from a heap.

    Rows must come sorted by allocation time; memory is the live tensors' releases.
    """

    def __init__(self, timeline: Timeline, source: str) -> None:
        self.timeline = timeline
        self.source = source
        self.heap: list[tuple] = []
        self.last_alloc: int | None = None

    def push(self, row: tuple) -> None:
        # row: (alloc_ns, release_ns, size, a_total, a_reserved, r_total, r_reserved, line, name, addr, stream)
        alloc_ns, release_ns, size, a_total, a_res, r_total, r_res, line, name, addr, stream = row
        timeline = self.timeline
        timeline.fig.rows += 1
        if len(timeline.events) > _events.MAX_EVENTS_IN_MEMORY:
            raise _events.too_many_events(self.source)
        if alloc_ns is None:
            if release_ns is None:
                timeline.add_initial(line, size, name)
                return
            if timeline._group_time is not None and release_ns < timeline._group_time:
                raise OutOfOrder()
            timeline.add_initial(line, size, name)
            heapq.heappush(self.heap, (release_ns, 0, line, size, r_total, r_res, line, name, addr, stream))
            return
        if self.last_alloc is not None and alloc_ns < self.last_alloc:
            raise OutOfOrder()
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


def new_timeline(component: str, writer: str, release_after: bool | None = None, emit: bool = True) -> Timeline:
    if release_after is None:
        release_after = component != GE       # CANN reports GE's release with the total before it
    pad = NPU_PAD if (writer == TORCH_NPU and component == FRAMEWORK[TORCH_NPU]) else 0
    return Timeline(component, release_after=release_after, size_pad=pad, emit=emit)


def better_figures(new: Figures, old: Figures) -> bool:
    return (new.allocated_max_diff, new.unseen_release_bytes) < (old.allocated_max_diff, old.unseen_release_bytes)

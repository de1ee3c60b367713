"""Placed events exported as a memory snapshot, with the segments the model took and gave back.

A model's placed events (the simulator's :class:`~ms_memopt.simulation.simulate.PlacedRun`,
:func:`~ms_memopt.replay.replay.placed_events` of a recording) say where each block went, not
when the model took a segment from the device or gave one back. A reader that rebuilds the pool
from the trace (MindStudio Insight's converter replays it backwards from the final segments)
needs both: an allocation inside a segment the model freed before the end has no segment to
sit in. :class:`SegmentShadow` feeds the same events to a second model of the same allocator
and reads its segment changes; :class:`SnapshotSink` puts them in the trace where the model made
them (before the allocation that grew or released them, after the free that returned them),
and streams the whole to a :class:`~ms_memopt.io.traces.memory_viz.SnapshotWriter`.

Segments of torch's caching allocators are ``segment_alloc`` / ``segment_free``; those of the
expandable models (torch's expandable segments, MindSpore's VMM: 2 MiB chunks mapped into a
reserved range) are ``segment_map`` / ``segment_unmap`` of the ranges that changed.

Example:
    >>> import os, tempfile
    >>> from ms_memopt.core.events import Event
    >>> from ms_memopt.allocators import create
    >>> from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot
    >>> model = create("torch-npu"); a = model.malloc(3 << 20); model.free(a); model.empty_cache()
    >>> path = os.path.join(tempfile.mkdtemp(), "s.pickle")
    >>> sink = SnapshotSink(path, "torch-npu")
    >>> sink.append(Event("alloc", id=1, size=3 << 20, addr=a)); sink.append(Event("free", id=1, size=3 << 20, addr=a))
    >>> sink.close(model.layout(), empty_cache=True)
    >>> [e.action for e in read_torch_snapshot(path).events]
    ['segment_alloc', 'alloc', 'free', 'segment_free']
"""
from __future__ import annotations

import sys
from pathlib import Path

from ms_memopt.core.events import Event
from ms_memopt.core.layout import Layout
from ms_memopt.io.traces.memory_viz import EXPANDABLE_MODELS, SnapshotWriter

__all__ = ["SegmentShadow", "SnapshotSink", "export_replay", "segment_changes"]

_MOVED = "compaction"


def _spans(layout: Layout) -> dict[tuple[int, int], tuple[int, str]]:
    """``(addr, size) -> (stream, pool)`` of every segment of ``layout``."""
    return {(seg.addr, seg.size): (seg.stream, seg.pool) for seg in layout.segments}


def _subtract(spans: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The address ranges ``[addr, addr + size)`` of ``spans`` not covered by ``minus``."""
    out = []
    for addr, size in sorted(spans):
        pieces = [(addr, addr + size)]
        for m_addr, m_size in minus:
            m_end = m_addr + m_size
            pieces = [part for lo, hi in pieces
                      for part in ((lo, min(hi, m_addr)), (max(lo, m_end), hi)) if part[0] < part[1]]
        out += [(lo, hi - lo) for lo, hi in pieces]
    return out


def segment_changes(before: dict, after: dict, *, expandable: bool) -> list[Event]:
    """The segment events that turn segments ``before`` into ``after`` (``(addr, size) -> (stream,
    pool)``, :func:`_spans`): frees first, then allocations; ranges unmapped and mapped when
    ``expandable``.

    Example:
        >>> segment_changes({(0, 4096): (0, "large")}, {(0, 8192): (0, "large")}, expandable=True)
        [Event(action='segment_map', id=None, size=4096, addr=4096, stream=0, pool='large', time=None, tag=None, step=None)]
    """
    gone = [span for span in before if span not in after]
    new = [span for span in after if span not in before]
    if not expandable:
        return ([Event("segment_free", size=size, addr=addr, stream=before[(addr, size)][0],
                       pool=before[(addr, size)][1]) for addr, size in sorted(gone)]
                + [Event("segment_alloc", size=size, addr=addr, stream=after[(addr, size)][0],
                         pool=after[(addr, size)][1]) for addr, size in sorted(new)])

    def owner(spans: dict, addr: int) -> tuple[int, str]:
        return next((v for (a, s), v in spans.items() if a <= addr < a + s), (0, "large"))

    return ([Event("segment_unmap", size=size, addr=addr, stream=owner(before, addr)[0], pool=owner(before, addr)[1])
             for addr, size in _subtract(gone, list(after))]
            + [Event("segment_map", size=size, addr=addr, stream=owner(after, addr)[0], pool=owner(after, addr)[1])
               for addr, size in _subtract(new, list(before))])


class SegmentShadow:
    """A second model of ``allocator`` fed the placed events, to learn when segments change.

    Each alloc is served by the shadow too (its address must be the recorded one); each free,
    and a compaction's moves (the first moved block's free compacts the shadow as the simulator
    compacted the model), keep it in step. When an address differs (a model the shadow cannot
    follow), :attr:`lost` names the event and no segment event comes after it.
    """

    def __init__(self, allocator: str, capacity: int | None = None, options: dict | None = None,
                 initial: Layout | None = None, *, model=None, follow: bool = True, feed: bool = True) -> None:
        from ms_memopt.allocators import create

        options = dict(options or {})
        self._fresh = lambda: create(allocator, capacity, **{k: v for k, v in options.items()
                                                             if k not in ("pregrow", "init_size")})
        self.model = model if model is not None else create(allocator, capacity, **options)
        self.feed = feed
        self.initial = initial
        if initial is not None and feed:
            self.model.restore(initial)
        self.expandable = allocator in EXPANDABLE_MODELS
        self.spans = _spans(initial) if initial is not None else {}
        self._state = None
        self.addr_of: dict[int, int] = {}
        self.lost: str | None = None if follow else "first event"
        self.follows = follow
        self._compacting = False

    def _changes(self) -> list[Event]:
        model = self.model
        state = (model.reserved, model.segment_allocs, getattr(model, "segment_frees", 0))
        if state == self._state:
            return []
        self._state = state
        now = _spans(model.layout())
        out = segment_changes(self.spans, now, expandable=self.expandable)
        self.spans = now
        return out

    def start(self) -> list[Event]:
        """The segments the model holds before the first event (pre-grown; a restored ``initial``
        layout's were there before the trace began)."""
        if not self.feed and self.initial is not None:
            return []           # the model being watched is restored by its own replay
        before, self.spans = self.spans, {}
        out = self._changes()
        return [e for e in out if (e.addr, e.size) not in before]

    def alloc(self, event: Event) -> list[Event]:
        """Serve ``event`` (an alloc with the recorded address); the segment events just before it."""
        if self.lost is not None:
            return []
        if not self.feed:
            return self._changes()
        if event.tag == _MOVED:
            return []
        self._compacting = False
        addr = self.model.malloc(event.size, stream=event.stream, pool=event.pool, tag=event.tag)
        if addr != event.addr:
            self.lost = f"alloc of id {event.id} (step {event.step})"
            return []
        self.addr_of[event.id] = addr
        return self._changes()

    def free(self, event: Event) -> list[Event]:
        """Free ``event``'s block in the shadow; the segment events just after it."""
        if self.lost is not None:
            return []
        if not self.feed:
            return self._changes()
        if event.tag == _MOVED:
            if not self._compacting:        # the simulator's compaction, done the same way
                from ms_memopt.analysis.compaction.model import compact_model

                self.model = compact_model(self.model, self.addr_of, self._fresh)[0]
                self._compacting = True
            return []
        self._compacting = False
        addr = self.addr_of.pop(event.id, event.addr)
        if addr != event.addr:
            self.lost = f"free of id {event.id} (step {event.step})"
            return []
        self.model.free(addr)
        return self._changes()

    def finish(self, final: Layout) -> list[Event]:
        """What the run did after its last recorded event (an OOM's release of cached segments):
        the changes from the shadow's segments to the run's ``final`` layout."""
        return segment_changes(self.spans, _spans(final), expandable=self.expandable)


class SnapshotSink:
    """A list-like sink of placed events (``append``) that writes them as a memory snapshot with
    the model's segment events (:class:`SegmentShadow`), as a stream.

    Args:
        path: the ``.pickle`` to write.
        allocator: the model that placed the events; ``capacity``, ``options``: its settings.
        initial: the layout the events start from (a recording that began mid-run).
        model: a fresh model like the one that placed the events, when ``create(allocator)`` is not
            one (pool mode's regions); ``follow=False`` when its placements cannot be followed from
            the events alone (pool mode's rings follow the step's marks): the segments it holds
            at the start are written first, the rest from the final layout at the end.
            ``feed=False``: ``model`` is the one placing the events (a replay's, watched from its
            hooks), read after each event, never fed.
        max_entries, device, blockers: :class:`~ms_memopt.io.traces.memory_viz.SnapshotWriter`'s.
    """

    def __init__(self, path: str | Path, allocator: str, *, capacity: int | None = None, options: dict | None = None,
                 initial: Layout | None = None, model=None, follow: bool = True, feed: bool = True,
                 max_entries: int | None = None, device: int = 0, blockers=()) -> None:
        self.writer = SnapshotWriter(path, allocator=allocator, device=device, blockers=blockers,
                                     max_entries=max_entries)
        self.shadow = SegmentShadow(allocator, capacity, options, initial, model=model, follow=follow, feed=feed)
        self.events = 0
        for event in self.shadow.start():
            self.writer.add(event)

    def append(self, event: Event) -> None:
        """One placed event (what :class:`~ms_memopt.simulation.simulate.PlacedRun` records)."""
        self.events += 1
        if event.action == "alloc":
            for change in self.shadow.alloc(event):
                self.writer.add(change)
            self.writer.add(event, self.events - 1)
        elif event.action == "free":
            self.writer.add(event, self.events - 1)
            for change in self.shadow.free(event):
                self.writer.add(change)

    def close(self, final: Layout, recorded_by: dict | None = None, *, empty_cache: bool = False) -> None:
        """Finish the file with the run's ``final`` layout. ``empty_cache``: the run called it at
        its end (its segment frees are written before the final state)."""
        if empty_cache and self.shadow.lost is None and self.shadow.feed:
            self.shadow.model.empty_cache()
            for change in self.shadow._changes():
                self.writer.add(change)
        for change in self.shadow.finish(final):
            self.writer.add(change)
        if self.shadow.lost is not None and self.shadow.follows:
            print(f"memory viz: the segments after the {self.shadow.lost} are the final layout's "
                  "(the model's placements could not be followed there)", file=sys.stderr)
        self.writer.close(final, recorded_by)

    def abort(self) -> None:
        """Remove the unfinished file."""
        self.writer.abort()


def export_replay(trace, model, path: str | Path, *, allocator: str, recorded_by: dict | None = None,
                  max_entries: int | None = None):
    """Replay ``trace`` through ``model`` (a fresh model named ``allocator``) and write what it
    placed as a memory snapshot: every recording ``replay`` reads, a profiler capture without
    addresses included (the model places each block, then it is exported). Returns the
    :class:`~ms_memopt.replay.replay.ReplayResult`.

    Example:
        >>> import os, tempfile
        >>> from ms_memopt.allocators import create
        >>> from ms_memopt.core.events import Trace
        >>> path = os.path.join(tempfile.mkdtemp(), "r.pickle")
        >>> trace = Trace([Event("alloc", id=1, size=4096), Event("free", id=1)])
        >>> export_replay(trace, create("torch-npu"), path, allocator="torch-npu").address_match is None
        True
    """
    from ms_memopt.replay.replay import replay

    sink = SnapshotSink(path, allocator, model=model, feed=False, initial=trace.initial, max_entries=max_entries)

    def on_alloc(index: int, event: Event, addr: int | None) -> None:
        if addr is not None:
            sink.append(Event("alloc", id=event.id, size=event.size, addr=addr, stream=event.stream,
                              pool=event.pool, time=event.time, tag=event.tag, step=event.step))

    def on_free(index: int, event: Event, addr: int) -> None:
        sink.append(Event("free", id=event.id, size=event.size, addr=addr, stream=event.stream,
                          time=event.time, tag=event.tag, step=event.step))

    try:
        result = replay(trace, model, on_alloc=on_alloc, on_free=on_free)
    except BaseException:
        sink.abort()
        raise
    sink.close(result.final_layout, recorded_by)
    return result

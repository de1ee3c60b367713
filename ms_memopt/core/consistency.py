"""What a recorded trace says that cannot have happened: counted per kind, with the first line of each.

A trace written by a crashed, filtered or hand-edited tool can free an id it never allocated, free
one twice, allocate an id that is still live, place two live allocations on overlapping recorded
addresses, or give back a segment it never took. Replay goes on through all of these (a free of
an unknown id does nothing, an id allocated again replaces the first, which then leaks), so they
must not pass in silence: readers feed their events to a :class:`TraceChecker` and put
:meth:`Inconsistencies.to_meta` in ``trace.meta["inconsistencies"]``; ``ms-memopt replay`` prints
it, and ``--strict`` makes any of them exit 2.

Memory is bounded by the trace's live state: the live ids, the live recorded address ranges (a
sorted structure, so each check costs a logarithm, not the live count), and at most
:data:`RECENT_FREES` recently freed ids (to tell a double free from a free of an id never seen).

Example:
    >>> from ms_memopt.core.events import Event
    >>> checker = TraceChecker()
    >>> for line, event in enumerate([Event("alloc", id=1, size=512, addr=0), Event("free", id=1),
    ...                               Event("free", id=1), Event("free", id=9)], start=2):
    ...     checker.feed(event, line)
    >>> checker.found.to_meta()
    {'unknown_free': {'count': 1, 'first_line': 5}, 'double_free': {'count': 1, 'first_line': 4}}
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ms_memopt.core.sortedkeys import SortedKeys

__all__ = ["KINDS", "RECENT_FREES", "Inconsistencies", "TraceChecker"]

#: the kinds, in the order reports list them, with what each means
KINDS: dict[str, str] = {
    "unknown_free": "a free of an id that is not live and was not freed recently (never allocated?)",
    "double_free": "a free of an id already freed",
    "free_before_malloc": "a free that comes before its allocation",
    "duplicate_live_id": "an allocation of an id that is still live (the first one leaks in replay)",
    "overlapping_addresses": "an allocation whose recorded address range overlaps a live allocation's",
    "unknown_segment_free": "a segment_free of an address where no segment was allocated",
}
#: freed ids remembered to tell a double free from an unknown one
RECENT_FREES = 1 << 20


@dataclass
class Inconsistencies:
    """Counts per kind (:data:`KINDS`) and the line (or event index) where each was first seen."""

    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, int | None] = field(default_factory=dict)

    def note(self, kind: str, line: int | None) -> None:
        if kind not in self.counts:
            self.counts[kind] = 0
            self.first[kind] = line
        self.counts[kind] += 1

    def __bool__(self) -> bool:
        return bool(self.counts)

    def to_meta(self) -> dict:
        """``{kind: {"count": n, "first_line": line}}`` in :data:`KINDS` order."""
        return {kind: {"count": self.counts[kind], "first_line": self.first[kind]}
                for kind in KINDS if kind in self.counts}

    def summary(self) -> str:
        """One line: ``2 unknown_free (first at line 5), 1 double_free (first at line 4)``."""
        return ", ".join(f"{self.counts[kind]:,} {kind} (first at line {self.first[kind]})"
                         for kind in KINDS if kind in self.counts)


class TraceChecker:
    """Feed every event of a trace with its line (:meth:`feed`); :attr:`found` holds what was wrong."""

    def __init__(self) -> None:
        self.found = Inconsistencies()
        self._live: dict[int, tuple[int, int] | None] = {}    # id -> recorded (addr, end) or None
        self._ends: dict[int, int] = {}                         # live recorded start -> end
        self._starts = SortedKeys()
        self._freed: OrderedDict[int, None] = OrderedDict()
        self._segments: set[int] = set()

    def feed(self, event, line: int | None) -> None:
        action = event.action
        if action == "alloc":
            self._alloc(event.id, event.addr, event.size, line)
        elif action == "free":
            self._free(event.id, line)
        elif action == "segment_alloc":
            self._segments.add(event.addr)
        elif action == "segment_free":
            if event.addr in self._segments:
                self._segments.discard(event.addr)
            else:
                self.found.note("unknown_segment_free", line)

    def _alloc(self, ident: int, addr: int | None, size: int, line: int | None) -> None:
        if ident in self._live:
            self.found.note("duplicate_live_id", line)
            self._forget(ident)
        span = None
        if addr is not None and size > 0:
            end = addr + size
            before = self._starts.before(end)        # the live range starting last below our end
            if before is not None and self._ends[before] > addr:
                self.found.note("overlapping_addresses", line)
            elif addr not in self._ends:
                span = (addr, end)
                self._ends[addr] = end
                self._starts.add(addr)
        self._live[ident] = span
        self._freed.pop(ident, None)

    def _free(self, ident: int, line: int | None) -> None:
        if ident in self._live:
            self._forget(ident)
            self._freed[ident] = None
            if len(self._freed) > RECENT_FREES:
                self._freed.popitem(last=False)
        elif ident in self._freed:
            self.found.note("double_free", line)
        else:
            self.found.note("unknown_free", line)

    def _forget(self, ident: int) -> None:
        span = self._live.pop(ident)
        if span is not None and self._ends.get(span[0]) == span[1]:
            del self._ends[span[0]]
            self._starts.remove(span[0])

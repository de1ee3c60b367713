"""Drive an allocator model with a trace's events and measure what happens.

The engine maps each trace tensor id to the address *the model* chose, so a model that
diverges from the recording still frees the right blocks. When the trace recorded addresses,
``address_match`` is the fraction of allocations the model placed at the recorded address,
making every choice itself; only new segments' addresses are taken from the recording
(``segment_alloc`` events, passed to :meth:`AllocatorModel.note_segment_alloc`).

Sizes and addresses are checked once, before the models see them: every event and every
segment of the recorded initial state must end below :data:`DEVICE_ADDRESS_LIMIT` (2**48
bytes, 256 TiB: the virtual address width of x86-64, AArch64 and the accelerators' MMUs; no
device has a PiB). Readers accept any integer, and a model asked for 2**64 bytes or a segment
past 2**64 breaks (its free lists pack ``size << 64 | addr``), so such a trace is an
:class:`~ms_memopt.core.errors.InputError` naming the event.

Example:
    >>> from ms_memopt.core.events import Event, Trace
    >>> from ms_memopt.allocators import create
    >>> trace = Trace([Event("alloc", id=1, size=4096), Event("free", id=1)])
    >>> replay(trace, create("mindspore")).allocs                  # doctest: +SKIP
    1
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

from ms_memopt.allocators import MODELS
from ms_memopt.allocators.base import AllocatorModel, OOMRecord
from ms_memopt.allocators.options import OPTION_TYPES
from ms_memopt.core.errors import InputError
from ms_memopt.core.units import short_repr
from ms_memopt.core.events import Event, Trace
from ms_memopt.core.layout import DEVICE_ADDRESS_LIMIT, Layout
from ms_memopt.core.metrics import LayoutMetrics, frag_ratio, measure
from ms_memopt.replay.loop import drive, drive_chunks

__all__ = ["ReplayResult", "replay", "sample_metrics", "placed_events", "same_layout", "check_bounds", "default_allocator", "recorded_allocator", "RecordedAllocator", "DEVICE_ADDRESS_LIMIT"]

#: every size and address of a replayed trace ends below this (bytes)


@dataclass
class ReplayResult:
    """What a replay measured; sizes in bytes (the ``--json`` object of ``ms-memopt replay``)."""

    allocator: str
    events: int
    allocs: int
    peak_allocated: int
    peak_reserved: int
    final_reserved: int
    final_allocated: int
    segment_allocs: int
    ooms: list[OOMRecord]
    free_total_end: int
    largest_free_end: int
    frag_ratio_end: float | None
    frag_ratio_max: float | None
    address_match: float | None
    events_per_s: float
    samples: int
    #: events per second of this process's CPU time in the model (what a busy machine does not skew)
    cpu_events_per_s: float = 0.0
    final_layout: Layout = field(repr=False, default_factory=Layout)
    #: True when the model ends with the recorded blocks and live buffers, address for address
    #: (``None``: the trace recorded no final state)
    final_layout_match: bool | None = None
    #: what a what-if policy did (:mod:`ms_memopt.replay.whatif`): its name and figures
    policy: dict | None = None
    #: the model's address of every tensor still live at the end -> its trace id
    live_ids: dict[int, int] = field(repr=False, default_factory=dict)
    #: requests that took the model's slow path (:attr:`AllocatorModel.slow_path_events`)
    slow_path_events: int = 0
    #: failed requests: ``ooms`` and those past the model's ``full_oom_records``, only counted
    oom_count: int = 0

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("final_layout", "live_ids")}
        out["ooms"] = [o.to_dict() for o in self.ooms]
        return out


@dataclass(frozen=True)
class RecordedAllocator:
    """The allocator model that recorded a trace, its options, and what decided it (``why``:
    a phrase for the user, e.g. "the recording names it (ms-memopt simulate)")."""

    name: str
    options: dict = field(default_factory=dict)
    why: str = ""
    #: the card's memory the recording ran with (bytes), when it says
    capacity: int | None = None

    def options_for(self, capacity: int | None) -> dict:
        """The recorded options for a replay at ``capacity``: a pool pre-grown to the card
        (``pregrow``) replayed without a capacity keeps the card it recorded
        (``init_size`` = the recorded capacity)."""
        options = dict(self.options)
        if options.get("pregrow") and capacity is None and self.capacity:
            options.pop("pregrow")
            options["init_size"] = self.capacity
        return options


def recorded_allocator(trace: Trace) -> RecordedAllocator:
    """The model of the allocator that recorded ``trace``, with its options and the reason.

    In this order: the model the recording names (our exports write it: a memory-viz snapshot's
    ``allocator_settings``, a JSONL header's ``meta``, read into ``trace.meta["allocator"]``);
    PyTorch's for its snapshots (and torch_npu's msMemScope files); ``DynamicMemPoolBestFit``
    for MindSpore's CPU pool logs and ``ms-memopt record`` files of them; else MindSpore's
    default pool. A named model that does not exist, or options it does not take, are not
    used, and ``why`` says so.

    Example:
        >>> recorded_allocator(Trace([], meta={"allocator": "mindspore"})).name
        'mindspore'
        >>> recorded_allocator(Trace([], format="torch-snapshot")).why
        'a PyTorch snapshot'
    """
    named, note = trace.meta.get("allocator"), ""
    if isinstance(named, str):
        options = trace.meta.get("allocator_options")
        options = dict(options) if isinstance(options, dict) else {}
        by = trace.meta.get("recorded_by")
        by = by if isinstance(by, dict) else trace.meta     # a JSONL header's meta says it itself
        writer = by.get("source") or trace.meta.get("source") or "its writer"
        capacity = by.get("capacity") if isinstance(by.get("capacity"), int) and by["capacity"] > 0 else None
        if named in MODELS and named != "pool":
            types = OPTION_TYPES.get(named, {})
            unknown = sorted(set(options) - set(types))
            for key, value in options.items():
                kind = types.get(key) if isinstance(key, str) else None
                if kind is not None and not kind.accepts(value):
                    # a string where the model compares numbers: bad input, not a model to fall back from
                    raise InputError(f"allocator_settings.ms_memopt.allocator_options.{key}: expected "
                                     f"{kind.describe()} for the {named} model, got {short_repr(value)}",
                                     source=trace.source)
            if not unknown:
                return RecordedAllocator(named, options, f"the recording names it ({writer})", capacity)
            note = f"; it names {named} with an option the model does not take ({unknown[0]})"
        else:
            note = f"; it names {named!r}, which is no model to replay through"
    if trace.format == "torch-snapshot":
        return _snapshot_allocator(trace.meta, note)
    if trace.format == "msmemscope":
        return RecordedAllocator("torch", {}, "a torch_npu msMemScope file" + note)
    if trace.format == "ascend-profiler":
        return _profiler_allocator(trace.meta, note)
    if trace.meta.get("pool") == "DynamicMemPoolBestFit":
        return RecordedAllocator("mindspore-bestfit", {}, "MindSpore's CPU pool (DynamicMemPoolBestFit) wrote it" + note)
    return RecordedAllocator("mindspore", {}, "the recording names no allocator: MindSpore's default pool" + note)


def _snapshot_allocator(meta: dict, note: str) -> RecordedAllocator:
    """A PyTorch-format snapshot's model from what the reader found in it
    (:mod:`~ms_memopt.io.traces.torch_origin`): torch_npu's or PyTorch's, with or without
    expandable segments, and the evidence as the reason."""
    npu = meta.get("framework") == "torch_npu"
    expandable = meta.get("expandable_segments") is True
    name = ("torch-npu" if npu else "torch") + ("-expandable" if expandable else "")
    evidence = [meta.get("framework_evidence") if npu else None, meta.get("expandable_evidence") if expandable else None]
    why = ("a torch_npu snapshot" if npu else "a PyTorch snapshot") + (
        ": " + "; ".join(e for e in evidence if e) if any(evidence) else "")
    return RecordedAllocator(name, {}, why + note)


def _profiler_allocator(meta: dict, note: str) -> RecordedAllocator:
    """The Ascend profiler's recording (:mod:`~ms_memopt.io.traces.ascend_profiler`): the first
    model the reader found to fit that is registered here (torch_npu's, else PyTorch's, for
    torch_npu's profiler; MindSpore's pool for MindSpore's), with the reader's evidence."""
    candidates = [c for c in meta.get("allocator_candidates") or () if isinstance(c, str)]
    why = str(meta.get("allocator_evidence") or "the Ascend profiler's output")
    for rank, name in enumerate(candidates):
        if name in MODELS and name != "pool":
            if rank:
                why += f" ({', '.join(candidates[:rank])}: no such model here, so {name})"
            return RecordedAllocator(name, {}, why + note)
    return RecordedAllocator("mindspore", {}, why + "; no fitting model here: MindSpore's default pool" + note)


def default_allocator(trace: Trace) -> str:
    """The name of the model of the allocator that recorded ``trace`` (:func:`recorded_allocator`)."""
    return recorded_allocator(trace).name


# streams are C int64 in the compiled models
_STREAM_MIN, _STREAM_MAX = -2**63, 2**63 - 1


def check_bounds(trace: Trace) -> None:
    """Refuse sizes and addresses no device has (see :data:`DEVICE_ADDRESS_LIMIT`).

    Raises:
        InputError: names the event (0-based index, action, id) or the initial segment.

    Example:
        >>> from ms_memopt.core.events import Event
        >>> check_bounds(Trace([Event("alloc", id=1, size=2**50)], source="t.jsonl"))
        Traceback (most recent call last):
        ...
        ms_memopt.core.errors.InputError: t.jsonl: event 0 (alloc, id 1): size 1125899906842624 ...
    """
    key = id(trace)
    checked = _CHECKED.get(key)
    if checked is not None and checked[0]() is trace and checked[1:] == (trace.events, len(trace.events),
                                                                          trace.initial):
        return
    limit = DEVICE_ADDRESS_LIMIT
    bound = "is beyond any device (sizes and addresses end below 2**48 bytes, 256 TiB)"
    if trace.initial is not None:
        for number, seg in enumerate(trace.initial.segments):
            if seg.addr + seg.size > limit:
                raise InputError(f"recorded initial state, segment {number}: address {seg.addr:#x} + size "
                                 f"{seg.size} {bound}", source=trace.source)
            if not _STREAM_MIN <= seg.stream <= _STREAM_MAX:
                raise InputError(f"recorded initial state, segment {number}: stream {seg.stream} is not a 64-bit "
                                 f"signed integer", source=trace.source)
    if isinstance(trace.events, list):      # a stream is checked chunk by chunk as it is read
        check_events(trace.events, 0, trace.source)
        _CHECKED[key] = (weakref.ref(trace, lambda _, key=key: _CHECKED.pop(key, None)), trace.events,
                         len(trace.events), trace.initial)


#: id(trace) -> (a weak reference to it, its events, their count, its initial state) of the traces
#: :func:`check_bounds` passed: doctor replays one trace under twenty settings, and a million
#: events cost a quarter second to check each time
_CHECKED: dict[int, tuple] = {}


def check_events(events: list, offset: int, source: str) -> None:
    """:func:`check_bounds` of ``events``, the stream's events from index ``offset`` on."""
    limit = DEVICE_ADDRESS_LIMIT
    bound = "is beyond any device (sizes and addresses end below 2**48 bytes, 256 TiB)"
    for index, event in enumerate(events, start=offset):
        size, addr = event.size or 0, event.addr or 0
        if size >= limit or addr + size > limit or not _STREAM_MIN <= (event.stream or 0) <= _STREAM_MAX:
            ident = "" if event.id is None else f", id {event.id}"
            if size >= limit or addr + size > limit:
                what = f"size {size}" if size >= limit else f"address {addr:#x} + size {size}"
                raise InputError(f"event {index} ({event.action}{ident}): {what} {bound}", source=source)
            raise InputError(f"event {index} ({event.action}{ident}): stream {event.stream} is not a 64-bit "
                             f"signed integer (device streams are small numbers)", source=source)


def replay(trace: Trace, model: AllocatorModel, *, sample_every: int | None = None,
           on_sample: Callable[[int, LayoutMetrics], None] | None = None,
           on_step: Callable[[int, AllocatorModel, dict[int, int]], AllocatorModel] | None = None,
           stop: int | None = None, on_alloc: Callable[[int, Event, int | None], None] | None = None,
           on_free: Callable[[int, Event, int], None] | None = None,
           on_oom: Callable[[int, Event, AllocatorModel, dict[int, int]], AllocatorModel | None] | None = None
           ) -> ReplayResult:
    """Replay ``trace`` through ``model``.

    Args:
        trace: the events (and, when known, the state recording started from).
        model: a fresh allocator model.
        sample_every: measure the layout every this many events (and at every ``step``
            event) for ``frag_ratio_max``; ``None`` picks about 200 samples, ``0`` disables
            sampling (pure event throughput, for benchmarks).
        on_sample: called with ``(event_index, metrics)`` at each sample.
        on_step: called at each ``step`` event with ``(step, model, addresses)`` (trace id ->
            the model's address; the hook may update it) and returns the model to go on with:
            a policy such as compaction at step ends (:mod:`ms_memopt.replay.whatif`).
        stop: replay only the first ``stop`` events (the state just before event ``stop``).
        on_alloc, on_free: called after each alloc as ``(index, event, address or None)`` and
            each free of a placed block as ``(index, event, address)``, the model's addresses
            (:func:`~ms_memopt.replay.loop.drive`'s hooks).
        on_oom: called at a failed allocation with ``(index, event, model, addresses)``; a model
            returned (a last-resort compaction) is asked once more (:func:`~ms_memopt.replay.loop.drive`).

    Returns:
        A :class:`ReplayResult`. ``events_per_s`` counts only the time spent in the model.

    Raises:
        InputError: a size or address beyond any device (:func:`check_bounds`).
    """
    return _replay(trace, model, sample_every=sample_every, on_sample=on_sample, on_step=on_step, stop=stop,
                   on_alloc=on_alloc, on_free=on_free, on_oom=on_oom)


#: samples of a streamed trace (its length is not known before it ends): every this many events
#: (and at every step event, as always)
STREAM_SAMPLE_EVERY = 1 << 12

#: models whose ``largest_free()`` is not the largest hole of their layout (the VMM model's is its
#: largest free virtual range, mapped or not): their samples measure the layout
_LAYOUT_SAMPLED = frozenset({"mindspore-vmm"})


def sample_metrics(model: AllocatorModel) -> LayoutMetrics:
    """The model's metrics at a replay sample, from its counters and ``largest_free()``.

    ``model.metrics()`` builds the whole layout, every live block, so sampling 200 times a replay
    whose live count grows to millions cost 200 x millions of block objects: a 2M-allocation
    trace that frees nothing did not finish in 120 s while the model itself ran at a million events
    a second. ``reserved``, ``allocated`` and ``largest_free`` are what the layout gives (checked on
    every model and recorded trace); the holes are not counted here (``holes`` 0, an empty
    histogram).

    Example:
        >>> from ms_memopt.allocators import create
        >>> model = create("torch")
        >>> _ = model.malloc(4096)
        >>> sample_metrics(model).allocated == model.metrics().allocated
        True
    """
    if model.name in _LAYOUT_SAMPLED:
        return model.metrics()
    reserved, allocated = model.reserved, model.allocated
    largest = model.largest_free()
    free_total = reserved - allocated
    return LayoutMetrics(reserved=reserved, allocated=allocated, free_total=free_total, largest_free=largest,
                         frag_ratio=frag_ratio(free_total, largest),
                         utilization=(allocated / reserved) if reserved else None,
                         device_free=None if model.capacity is None else max(model.capacity - reserved, 0))


def _replay(trace: Trace, model: AllocatorModel, *, sample_every: int | None = None,
            on_sample: Callable[[int, LayoutMetrics], None] | None = None,
            on_step: Callable[[int, AllocatorModel, dict[int, int]], AllocatorModel] | None = None,
            stop: int | None = None, on_alloc: Callable | None = None,
            on_free: Callable | None = None, on_oom: Callable | None = None) -> ReplayResult:
    """:func:`replay`, with the loop's ``on_alloc``/``on_free`` hooks (:func:`~ms_memopt.replay.loop.drive`)."""
    check_bounds(trace)
    events = trace.events
    # a trace read as a stream (an iterable, not a list: replay of a pool log of gigabytes) runs
    # chunk by chunk, so memory holds one chunk of events and the model, never the whole trace
    streamed = not isinstance(events, list)
    if sample_every is None:
        if streamed:        # samples are cheap (sample_metrics) but for the models that measure the layout
            sample_every = STREAM_SAMPLE_EVERY * (16 if model.name in _LAYOUT_SAMPLED else 1)
        else:
            sample_every = max(1, len(events) // 200)
    address_of: dict[int, int] = {}
    if trace.initial is not None:
        model.restore(trace.initial)
        address_of.update({b.id: b.addr for b in trace.initial.live_blocks() if b.id is not None})
    frag_max: float | None = None

    def sample(index: int, current: AllocatorModel) -> None:
        nonlocal frag_max
        m = sample_metrics(current)
        if m.frag_ratio is not None and (frag_max is None or m.frag_ratio > frag_max):
            frag_max = m.frag_ratio
        if on_sample is not None:
            on_sample(index, m)

    policy = None
    if on_step is not None:
        def policy(index: int, event: Event, current: AllocatorModel) -> AllocatorModel:
            return on_step(event.step or 0, current, address_of)

    last_resort = None
    if on_oom is not None:
        def last_resort(index: int, event: Event, current: AllocatorModel) -> AllocatorModel | None:
            return on_oom(index, event, current, address_of)

    if streamed:
        run = drive_chunks(events, model, stop=stop, addr_of=address_of, on_step=policy, on_alloc=on_alloc,
                           on_free=on_free, sample_every=sample_every, on_sample=sample, on_oom=last_resort,
                           check=lambda part, offset: check_events(part, offset, trace.source))
        total = run.stopped_at
    else:
        run = drive(events, model, stop=stop, addr_of=address_of, on_step=policy, on_alloc=on_alloc,
                    on_free=on_free, sample_every=sample_every, on_sample=sample, on_oom=last_resort)
        total = len(events)
    model, count = run.model, run.stopped_at
    model_seconds, cpu_seconds = run.seconds, run.cpu_seconds
    allocs, samples = run.allocs, run.samples

    final_layout = model.layout()
    end = measure(final_layout)
    if end.frag_ratio is not None and (frag_max is None or end.frag_ratio > frag_max):
        frag_max = end.frag_ratio
    return ReplayResult(
        allocator=model.name,
        events=total,
        allocs=allocs,
        peak_allocated=model.peak_allocated,
        peak_reserved=model.peak_reserved,
        final_reserved=end.reserved,
        final_allocated=end.allocated,
        segment_allocs=model.segment_allocs,
        ooms=list(model.ooms),
        free_total_end=end.free_total,
        largest_free_end=end.largest_free,
        frag_ratio_end=end.frag_ratio,
        frag_ratio_max=frag_max,
        address_match=run.address_match,
        events_per_s=total / model_seconds if model_seconds > 0 else float("inf"),
        samples=samples,
        cpu_events_per_s=total / cpu_seconds if cpu_seconds > 0 else float("inf"),
        final_layout=final_layout,
        final_layout_match=None if trace.final is None or count < total else same_layout(final_layout, trace.final),
        live_ids={addr: ident for ident, addr in address_of.items()},
        slow_path_events=model.slow_path_events,
        oom_count=model.oom_count,
    )


def same_layout(replayed: Layout, recorded: Layout) -> bool:
    """True when both have the same segments (address, size) and the same live blocks
    (address, size); free ranges follow from those, since pools merge idle neighbours.

    Example:
        >>> from ms_memopt.core.layout import Block, Segment
        >>> a = Layout([Segment(0, 1024, [Block(0, 512, True), Block(512, 512, False)])])
        >>> same_layout(a, a), same_layout(a, Layout([Segment(0, 1024, [Block(0, 1024, False)])]))
        (True, False)
    """
    def shape(layout: Layout) -> tuple[list, list]:
        return (sorted((s.addr, s.size) for s in layout.segments),
                sorted((b.addr, b.size) for b in layout.live_blocks()))
    return shape(replayed) == shape(recorded)


def placed_events(trace: Trace, model: AllocatorModel, *, segments: bool = False,
                  sample_every: int | None = 0) -> tuple[list[Event], ReplayResult]:
    """Replay ``trace`` through ``model`` and return its events with the model's addresses.

    Allocations the model could not serve (OOM) and their frees are left out. The result's
    ``final_layout`` is the layout to export with them. With ``segments``, the stream is whole:
    each block the model takes from the device is a ``segment_alloc`` event just before the
    allocation that made it, and every other event (steps, marks) is kept where it was (what
    ``simulate TEMPLATE --export-events`` writes). ``sample_every`` is replay's.

    Example:
        >>> from ms_memopt.allocators import create
        >>> events, result = placed_events(Trace([Event("alloc", id=1, size=4096)]), create("torch"))
        >>> events[0].addr == result.final_layout.segments[0].addr
        True
    """
    placed: list[int | None] = []
    grown: list[list] = []                      # per allocation: the blocks it made the model take
    state = {"count": model.segment_allocs, "reserved": model.reserved,
             "seen": {seg.addr for seg in model.layout().segments} if segments else set()}

    def returned(current: AllocatorModel) -> None:
        """Blocks went back to the device: a later block at one of their addresses is new."""
        if current.reserved < state["reserved"]:
            state["seen"] = {seg.addr for seg in current.layout().segments}
        state["reserved"] = current.reserved

    def on_alloc(index: int, event: Event, addr: int | None) -> None:
        current = model
        placed.append(addr)
        new = []
        if segments and current.segment_allocs != state["count"]:
            state["count"] = current.segment_allocs
            now = sorted(current.layout().segments, key=lambda seg: seg.addr)
            new = [seg for seg in now if seg.addr not in state["seen"]]
            state["seen"] = {seg.addr for seg in now}
        grown.append(new)
        state["reserved"] = current.reserved

    def on_free(index: int, event: Event, addr: int) -> None:
        if segments:
            returned(model)

    result = _replay(trace, model, sample_every=sample_every, on_alloc=on_alloc, on_free=on_free)
    out: list[Event] = []
    addr_of: dict[int, int] = {}
    if trace.initial is not None:
        addr_of.update({b.id: b.addr for b in trace.initial.live_blocks() if b.id is not None})
    allocs = iter(zip(placed, grown))
    for event in trace.events:
        if event.action == "alloc":
            addr, new = next(allocs)
            out += [Event("segment_alloc", size=seg.size, addr=seg.addr, stream=seg.stream,
                          pool="persistent" if seg.pool == "persistent" else None) for seg in new]
            if addr is None:
                continue
            addr_of[event.id] = addr
            out.append(Event("alloc", id=event.id, size=event.size, addr=addr, stream=event.stream,
                             pool=event.pool if segments else None, time=event.time, tag=event.tag))
        elif event.action == "free":
            addr = addr_of.pop(event.id, None)
            if addr is not None:
                out.append(Event("free", id=event.id, size=event.size, addr=addr, stream=event.stream,
                                 time=event.time, tag=event.tag))
        elif segments and event.action not in ("segment_alloc", "segment_free"):
            out.append(event)
    return out, result

"""``ms-memopt doctor``: from one recording to a verdict, the blocks in the way, and the setting
that would have saved the run, each measured by replaying the recording.

The allocator models are exact on real recordings (PyTorch snapshots and MindSpore's CPU pool:
every address), so one recording answers three questions:

1. **Verdict.** Replayed through the model of the allocator that recorded it (at ``capacity``
   when given), did a request fail, and was it *fragmentation* (the free memory would have
   covered it in one piece: :func:`~ms_memopt.allocators.base.oom_kind`) or *capacity*? With
   no failure the worst moment is the growth of the pool that free memory would have covered
   (no hole held the request, though ``free_total >= request``): where a smaller card dies.
2. **Blockers.** At that moment, the live blocks whose moving (or absence) would have opened a
   hole for the request, whichever moves fewer bytes: the cheapest window of one segment whose
   holes add up to the request (:func:`~ms_memopt.analysis.compaction.planner.cheapest_window`, the
   compaction planner's rule), or, at a capacity, the blocks that pin whole segments (emptied,
   they go back to the device and a new segment of the request's size fits). So every listed
   block is one that matters. Long-lived blocks between transient ones are flagged.
3. **Remedies** (:mod:`~ms_memopt.doctor.remedies`). The same recording replayed under each
   setting of its allocator family, in that family's terms (PyTorch: ``PYTORCH_CUDA_ALLOC_CONF``;
   torch_npu: ``PYTORCH_NPU_ALLOC_CONF``; MindSpore: ``MS_ALLOC_CONF`` VMM, ``increase_size``, a
   pre-grown ``init_size``, ``empty_cache`` at the step ends, and the project's compaction and
   pool mode), ranked by survival at ``capacity``, then peak reserved without a capacity, then
   the worst frag ratio; each with the line to set, the slow-path events it went through, and
   whether its model is address-verified. :attr:`Diagnosis.summary` says plainly which setting
   saves the run, or that none does and what would. Under verdict ``none`` nothing is replayed:
   nothing needs saving.

The model is the one that recorded the trace (:func:`~ms_memopt.replay.replay.recorded_allocator`:
the model our exports name, PyTorch's for its snapshots, MindSpore's pools for theirs), with the
options it recorded; ``allocator_why`` says what decided it.

:func:`compare` puts two recordings side by side (``ms-memopt doctor A B``).

Example: one 90 MiB segment cut in three, the middle tensor kept, then a 40 MiB request:
    >>> from ms_memopt.core.events import Event, Trace
    >>> MiB = 2**20
    >>> t = Trace([Event("alloc", id=9, size=90 * MiB), Event("free", id=9)]
    ...           + [Event("alloc", id=i, size=30 * MiB) for i in (1, 2, 3)]
    ...           + [Event("free", id=1), Event("free", id=3), Event("alloc", id=4, size=40 * MiB)],
    ...           format="torch-snapshot")
    >>> d = diagnose(t, capacity=100 * MiB)
    >>> d.verdict.kind, d.verdict.failed, [b.size // MiB for b in d.blockers]
    ('fragmentation', True, [30])
    >>> d.remedies[0].setting, d.remedies[0].survives
    ('expandable_segments:True', True)
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable


from ms_memopt.allocators import create
from ms_memopt.allocators.base import AllocatorModel
from ms_memopt.analysis.compaction.planner import cheapest_opening
from ms_memopt.analysis.estimate import estimate
from ms_memopt.config.recipe import load_recipe
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Trace
from ms_memopt.core.layout import Layout
from ms_memopt.core.metrics import frag_ratio
from ms_memopt.core.units import aligned, format_size
from ms_memopt.doctor.remedies import Remedy, SkippedSetting, family_of_model, measure_remedies, remedy_settings, summary
from ms_memopt.replay.replay import ReplayResult, recorded_allocator, replay

__all__ = ["Verdict", "Blocker", "Diagnosis", "Comparison", "diagnose", "compare"]

#: a blocker lives this many times longer than the median allocation: long-lived
LONG_LIVED_FACTOR = 10


@dataclass
class Verdict:
    """What limited the recording; sizes in bytes.

    ``kind``: ``"fragmentation"`` (the free memory would have covered the request in one
    piece), ``"capacity"`` (it would not), ``"none"`` (no request failed and the pool never
    grew while free memory covered the request). ``failed``: a request ran out of memory at the
    capacity; else the moment is the pool's worst growth. ``event``: index of the request.
    """

    kind: str
    failed: bool
    request: int | None = None
    free_total: int | None = None
    largest_free: int | None = None
    frag_ratio: float | None = None
    event: int | None = None
    reserved: int | None = None
    allocated: int | None = None
    text: str = ""
    #: the pool that serves the request (``"small"``/``"large"``, a pool-mode region; ``None``:
    #: any); ``largest_free`` is that pool's largest piece
    pool: str | None = None
    #: the kind of the failed request itself (``kind`` is ``"capacity"`` whenever the run's own
    #: live bytes exceed the card, even when its first failure was fragmentation); the blockers
    #: are that failure's
    first_kind: str | None = None


@dataclass
class Blocker:
    """A live block in the cheapest window that would hold the request; ``id`` is its tensor's
    id in the recording's events."""

    addr: int
    size: int
    tag: str | None
    allocated_at: int | None          # event index (None: alive when recording began)
    freed_at: int | None              # event index (None: never freed in the recording)
    lifetime_events: int | None
    long_lived: bool
    between_transients: bool
    frames: list[str] = field(default_factory=list)
    id: int | None = None


@dataclass
class Diagnosis:
    """Everything ``ms-memopt doctor`` reports about one recording."""

    trace: str
    format: str
    family: str
    allocator: str
    capacity: int | None
    events: int
    verdict: Verdict
    blockers: list[Blocker]
    remedies: list[Remedy]
    peak_allocated: int
    peak_reserved: int
    window_bytes: int | None = None          # bytes the cheapest window would move
    layout: Layout | None = field(default=None, repr=False)
    #: what decided ``allocator`` (the recording names it, a PyTorch snapshot, ``--allocator``, ...)
    allocator_why: str = ""
    #: the recorded allocator's options the replays start from
    allocator_options: dict = field(default_factory=dict)
    #: settings of the family not tried on this recording, and why
    skipped: list[SkippedSetting] = field(default_factory=list)
    #: one plain sentence: which setting saves the run, or that none does and what would
    summary: str = ""
    #: what decided ``capacity`` (set by the command: ``--capacity``, the recording's card, ...)
    capacity_why: str = ""

    def to_dict(self) -> dict:
        return {"trace": self.trace, "format": self.format, "family": self.family, "allocator": self.allocator,
                "allocator_why": self.allocator_why, "allocator_options": self.allocator_options,
                "capacity": self.capacity, "capacity_why": self.capacity_why, "events": self.events, "peak_allocated": self.peak_allocated,
                "peak_reserved": self.peak_reserved, "verdict": asdict(self.verdict),
                "blockers": [asdict(b) for b in self.blockers], "window_bytes": self.window_bytes,
                "remedies": [r.to_dict() for r in self.remedies], "summary": self.summary,
                "skipped": [asdict(s) for s in self.skipped]}


# --- the replays --------------------------------------------------------------------------------

class _GrowthWatch:
    """Wraps a model's ``malloc`` to find the worst growth: the request the pool grew for because
    no hole held it, although its free memory together would have (the most free memory stranded
    at that moment)."""

    def __init__(self, model: AllocatorModel, trace: Trace) -> None:
        self.model = model
        self.alloc_index = [i for i, e in enumerate(trace.events) if e.action == "alloc"]
        self.calls = 0
        self.worst: tuple[int, int, int, int, int, int] | None = None   # free, index, size, largest, reserved, allocated
        self._malloc = model.malloc
        model.malloc = self

    def __call__(self, size: int, **kwargs) -> int | None:
        model = self.model
        free_before = model.reserved - model.allocated
        reserved, allocated = model.reserved, model.allocated
        largest = model.largest_free() if size <= free_before else 0
        addr = self._malloc(size, **kwargs)
        index = self.alloc_index[self.calls] if self.calls < len(self.alloc_index) else None
        self.calls += 1
        # fragmentation: no hole anywhere held the request, though all free memory together did
        # (a hole in another pool or stream that would have held it is that pool's rule instead)
        if addr is not None and model.reserved > reserved and largest < size <= free_before and index is not None \
                and (self.worst is None or free_before > self.worst[0]):
            self.worst = (free_before, index, size, largest, reserved, allocated)
        return addr


def _live_peak(trace: Trace) -> tuple[int, int | None]:
    """The most bytes the recording's tensors hold at once, each request rounded up to the 512 B
    every modelled allocator hands out at least (the tensors alive before its first event
    included), and the event where: no placement on any card holds less. ``(bytes, event
    index)``; the index is ``None`` when the peak is the recorded initial state."""
    live: dict = {}
    held = peak = 0
    if trace.initial is not None:
        for block in trace.initial.live_blocks():
            held += block.size
            if block.id is not None:
                live[block.id] = block.size
        peak = held
    where = None
    for i, e in enumerate(trace.events):
        if e.action == "alloc":
            if e.id in live:
                continue
            live[e.id] = size = aligned(e.size)
            held += size
            if held > peak:
                peak, where = held, i
        elif e.action == "free":
            held -= live.pop(e.id, 0)
    return peak, where


def _start_above(trace: Trace, capacity: int | None) -> str:
    """The words that say the recording starts above the card (``""`` when it does not)."""
    start = trace.initial
    if capacity is None or start is None or start.reserved <= capacity:
        return ""
    return (f"the recording starts with {format_size(start.reserved)} reserved ({format_size(start.allocated)} "
            f"in live tensors) before its first event, more than the {format_size(capacity)} card; ")


def _pool_words(pool: str | None, virtual: bool) -> str:
    """Where a request is served, in the allocator's own terms."""
    if pool in ("small", "large"):
        limit = "1 MiB or less" if pool == "small" else "over 1 MiB"
        mapped = " (its mapped pages: free pages are unmapped and mapped again only as the card allows)" \
            if virtual else ""
        return f"the {pool} pool, which alone serves requests of {limit}{mapped}"
    if pool is not None:
        return f"pool mode's {pool!r} region"
    return "the pool"


def _failure(trace: Trace, oom, capacity: int | None, virtual: bool) -> tuple[str, str]:
    """``(kind, text)`` of the first failed request: whether the card is already too small, then
    the pool that serves the request and its largest piece, so the words never contradict the
    figures (a small request is not served by the large pool's hole)."""
    head = _start_above(trace, capacity)
    peak, where = _live_peak(trace)
    if capacity is not None and peak > capacity:
        at = "before the first event" if where is None else f"at event {where}"
        first = (f"the first request that failed, at event {oom.event_index}, was itself fragmentation: "
                 + _piece_text(oom, virtual) if oom.kind == "fragmentation" else
                 f"the first request that failed asked {format_size(oom.size)} at event {oom.event_index}")
        return "capacity", (head + f"its live tensors reach {format_size(peak)} {at}, more than the card: no "
                            f"placement holds this run: capacity: the card is too small for this step ({first})")
    if oom.kind == "fragmentation":
        return "fragmentation", head + _piece_text(oom, virtual) + ": fragmentation"
    return "capacity", head + _piece_text(oom, virtual) + ": capacity: the card is too small for this step"


def _piece_text(oom, virtual: bool) -> str:
    """The failed request, the pool that serves it and its largest piece there, the free memory."""
    usable = oom.usable_free
    device = oom.device_free or 0
    piece = oom.largest_free if oom.pool_largest_free is None else oom.pool_largest_free
    text = (f"needed {format_size(oom.size)} in one piece from {_pool_words(oom.pool, virtual)}; the largest piece "
            f"was {format_size(piece)}" + (" in that pool" if oom.pool is not None else ""))
    free = f"{format_size(usable)} were free in the pool" + (
        f" ({format_size(oom.free_total)} held, {format_size(usable)} of it within the card)"
        if usable != oom.free_total else "") + (f" (+{format_size(device)} not yet reserved)" if device else "")
    if oom.pool is not None and oom.largest_free > piece:
        free += f", its largest piece {format_size(oom.largest_free)} in a pool this request cannot use"
    return f"{text}; {free}"


def _verdict(trace: Trace, base: str, capacity: int | None, options: dict) -> tuple[Verdict, ReplayResult]:
    # the compiled model where built (its failures name their pool as the reference's do); the
    # verdict reads the first failure (a far too small card fails at most requests: the rest are counted)
    model = create(base, capacity, **options)
    model.full_oom_records = 1
    result = replay(trace, model)
    if result.ooms:
        oom = result.ooms[0]
        kind, text = _failure(trace, oom, capacity, model.virtual)
        largest = oom.largest_free if oom.pool_largest_free is None else oom.pool_largest_free
        ratio = frag_ratio(oom.free_total, oom.largest_free) if oom.largest_free else None
        return Verdict(kind, True, oom.size, oom.free_total, largest, ratio, oom.event_index,
                       oom.reserved, oom.allocated, text, pool=oom.pool, first_kind=oom.kind), result
    start = _start_above(trace, capacity)
    peak, where = _live_peak(trace)
    if capacity is not None and peak > capacity:
        # no request failed only because each fit in the pool cached before the first event
        at = "before the first event" if where is None else f"at event {where}"
        return Verdict("capacity", False, event=where, reserved=result.peak_reserved,
                       allocated=result.peak_allocated,
                       text=f"{start}its live tensors reach {format_size(peak)} {at}, more than the card: no "
                            "placement holds this run: capacity: the card is too small for this step (no request "
                            "failed in the replay: each fit in the memory cached before the first event)",
                       first_kind="capacity"), result
    # the growth watch wraps malloc, which takes the replay call by call: only a run that survives needs it
    watch = _GrowthWatch(create(base, capacity, **options), trace)
    result = replay(trace, watch.model)
    if watch.worst is None:
        return Verdict("none", False, text=f"{start}no request failed, and the pool never grew while its free "
                       "memory would have covered the request"), result
    free, index, size, largest, reserved, allocated = watch.worst
    text = (f"needed {format_size(size)} in one piece; {format_size(free)} were free in the pool, the largest piece "
            f"was {format_size(largest)}: fragmentation. The pool grew instead (reserved {format_size(reserved)} for "
            f"{format_size(allocated)} in use); a card without that room fails here")
    return Verdict("fragmentation", False, size, free, largest, frag_ratio(free, largest) if largest else None,
                   index, reserved, allocated, text, first_kind="fragmentation"), result


def _blockers(trace: Trace, base: str, capacity: int | None, verdict: Verdict,
              options: dict) -> tuple[list[Blocker], int | None, Layout | None]:
    if verdict.event is None or verdict.request is None or (verdict.first_kind or verdict.kind) != "fragmentation":
        return [], None, None        # a capacity failure: moving blocks would not make room
    before = replay(trace, create(base, capacity, **options), stop=verdict.event, sample_every=0)
    layout, ids = before.final_layout, before.live_ids
    request = aligned(verdict.request)
    best = cheapest_opening(layout, request, respect_pinned=False)
    if not verdict.failed or capacity is not None:
        # Free memory spread over segments that never merge: the blocks that pin whole segments.
        # Emptied, a segment goes back to the device, and with what is not reserved yet a new
        # one of the request's size fits. Segments with the fewest live bytes per byte first.
        # Where the pool grew instead of failing, the card that dies there has nothing left
        # beyond what is reserved: the blocks it would have had to move.
        need = request - (max(capacity - layout.reserved, 0) if verdict.failed else 0)
        pinned = sorted((s for s in layout.segments if any(b.live for b in s.blocks)),
                        key=lambda s: (sum(b.size for b in s.blocks if b.live) / s.size, s.addr))
        chosen, gained = [], 0
        for seg in pinned:
            if gained >= need:
                break
            chosen.append(seg)
            gained += seg.size
        if gained >= need:
            blocks = [b for seg in chosen for b in seg.blocks if b.live]
            cost = sum(b.size for b in blocks)
            if best is None or cost < best[0]:
                best = (cost, blocks, blocks)
    if best is None:
        return [], None, layout
    cost, moved, live = best
    alloc_at, free_at, tag_of = {}, {}, {}
    for i, e in enumerate(trace.events):
        if e.action == "alloc":
            alloc_at[e.id], tag_of[e.id] = i, e.tag
        elif e.action == "free":
            free_at.setdefault(e.id, i) if e.id not in alloc_at or i > alloc_at[e.id] else None
    lifetimes = [free_at[k] - v for k, v in alloc_at.items() if k in free_at and free_at[k] > v]
    median = statistics.median(lifetimes) if lifetimes else 0
    frames = trace.meta.get("frames") or {}

    def is_long(ident) -> bool:
        start, end = alloc_at.get(ident), free_at.get(ident)
        if start is None or end is None or end < start:
            return True
        return median > 0 and end - start > LONG_LIVED_FACTOR * median

    neighbours_of = {}
    for seg in layout.segments:
        seg_live = [b for b in seg.blocks if b.live]
        for k, b in enumerate(seg_live):
            neighbours_of[b.addr] = [seg_live[j] for j in (k - 1, k + 1) if 0 <= j < len(seg_live)]
    out = []
    for block in moved:
        ident = ids.get(block.addr)
        start = alloc_at.get(ident)
        end = free_at.get(ident) if ident in free_at and (start is None or free_at[ident] > start) else None
        neighbours = neighbours_of.get(block.addr, [])
        long_lived = is_long(ident)
        out.append(Blocker(addr=block.addr, size=block.size, tag=tag_of.get(ident) or block.tag,
                           allocated_at=start, freed_at=end,
                           lifetime_events=None if start is None or end is None else end - start,
                           long_lived=long_lived,
                           between_transients=long_lived and bool(neighbours)
                           and all(not is_long(ids.get(n.addr)) for n in neighbours),
                           frames=list(frames.get(ident, [])), id=ident))
    return out, cost, layout


def diagnose(trace: Trace, *, capacity: int | None = None, allocator: str | None = None,
             progress: Callable[[str], None] | None = None) -> Diagnosis:
    """Verdict, blockers and measured remedies of one recording (see the module docstring).

    Args:
        trace: the recording (any format ``replay`` reads).
        capacity: device memory the pool may reserve, bytes; ``None``: unbounded (every
            setting then survives, and the ranking is by peak reserved).
        allocator: the recorded allocator's model (default: the one that recorded it,
            :func:`~ms_memopt.replay.replay.recorded_allocator`); its family's settings are tried.
        progress: called with each setting's name before it is replayed.

    Raises:
        InputError: a capacity below zero, or a trace that does not replay.
    """
    if capacity is not None and capacity <= 0:
        raise InputError(f"expected a positive capacity, got {capacity}", key="--capacity")
    recorded = recorded_allocator(trace)
    if allocator is None or allocator == recorded.name:
        base, options = recorded.name, recorded.options_for(capacity)
        why = recorded.why if allocator is None else f"--allocator (as recorded: {recorded.why})"
    else:
        base, options, why = allocator, {}, f"--allocator (the recording's own: {recorded.name}, {recorded.why})"
    family = family_of_model(base)
    if family == "torch" and (trace.format == "msmemscope" or trace.meta.get("framework") == "torch_npu"):
        family = "torch_npu"            # torch_npu's allocator is PyTorch's, set through its own variable
    if progress is not None:
        progress("the recording as recorded")
    verdict, baseline_result = _verdict(trace, base, capacity, options)
    blockers, window, layout = _blockers(trace, base, capacity, verdict, options)
    remedies: list[Remedy] = []
    skipped: list[SkippedSetting] = []
    if verdict.kind == "none":
        text = ("nothing needs saving: no request failed"
                + (f" at {format_size(capacity)}" if capacity is not None else "")
                + ", and the pool never grew while its free memory would have held the request")
    elif verdict.kind == "capacity" and not verdict.failed:
        # every setting "survives" in the pool cached before the first event, which no card this size holds
        text = (f"no setting saves this run at {format_size(capacity)}: its live tensors alone are more than the "
                f"card (the replays fail no request only because the recording starts with "
                f"{format_size(trace.initial.reserved if trace.initial else 0)} cached). What would: a card of at "
                f"least {format_size(_live_peak(trace)[0])}")
    else:
        settings, skipped = remedy_settings(trace, capacity=capacity, allocator=base, options=options, family=family)
        remedies = measure_remedies(trace, settings, capacity=capacity, progress=progress)
        text = summary(remedies, capacity, needs=_plan_needs(trace, capacity))
    return Diagnosis(trace=trace.source, format=trace.format, family=family, allocator=base,
                     capacity=capacity, events=len(trace.events), verdict=verdict, blockers=blockers,
                     remedies=remedies, peak_allocated=baseline_result.peak_allocated,
                     peak_reserved=baseline_result.peak_reserved, window_bytes=window, layout=layout,
                     allocator_why=why, allocator_options=options, skipped=skipped, summary=text)


def _plan_needs(trace: Trace, capacity: int | None) -> str | None:
    """What the plan of the recipe a simulated recording names says a card needs (``ms-memopt
    plan``), when the recording names one and it can be read here; else ``None``."""
    by = trace.meta.get("recorded_by")
    recipe = by.get("recipe") if isinstance(by, dict) else None
    if capacity is None or not isinstance(recipe, str) or not recipe.endswith((".yaml", ".yml")):
        return None
    if not Path(recipe).is_file():
        return f"`ms-memopt plan {recipe} --capacity {_gb(capacity)}` says what a card needs (the recipe is not here)"
    try:
        loaded = load_recipe(recipe)
        device = dataclasses.replace(loaded.memopt.device, hbm=capacity)
        plan = estimate(dataclasses.replace(loaded, memopt=dataclasses.replace(loaded.memopt, device=device)))
    except InputError as exc:
        return f"`ms-memopt plan {recipe}` could not be read ({exc})"
    worst = plan.worst
    text = (f"`ms-memopt plan {recipe} --capacity {_gb(capacity)}` puts stage {worst.stage} at "
            f"{format_size(worst.total)} per card")
    if plan.fits:
        return text + ", which fits: the loss is the pool's fragmentation, which pool mode's regions avoid"
    if plan.checkpoint_every is not None:
        return (text + f", more than the card; with activation checkpointing every {plan.checkpoint_every} "
                "layers (memopt.checkpoint_every, pool mode's regions) it fits")
    return text + ", more than the card, and no checkpointing interval fits: more cards (a larger split) or a larger card"


def _gb(nbytes: int) -> str:
    """A size as ``--capacity`` takes it: ``80GiB``, ``7.5MiB``."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.4g}GiB"
    return f"{nbytes / 2**20:.4g}MiB"


# --- two recordings -----------------------------------------------------------------------------

@dataclass
class Comparison:
    """``ms-memopt doctor A B``: where two recordings part, and which fragments more."""

    a: str
    b: str
    first_divergence: int | None
    difference: str
    moments: list[dict]
    more_fragmented: str | None
    from_event: int | None
    summary: str

    def to_dict(self) -> dict:
        return asdict(self)


def _describe(event) -> str:
    if event is None:
        return "(the recording ended)"
    return f"{event.action} {format_size(event.size)}" + (f" [{event.tag}]" if event.tag else "")


def compare(a: Trace, b: Trace, *, capacity: int | None = None, moments: int = 8) -> Comparison:
    """Align ``a`` and ``b`` event by event (action and size), report the first divergence, the
    layouts' metrics side by side at ``moments`` matched moments (the same fraction of each
    recording), and which one fragments more (the bytes reserved but not in use, the pool's
    fragmentation overhead) and from which event of it on.

    Example:
        >>> from ms_memopt.core.events import Event, Trace
        >>> x = Trace([Event("alloc", id=1, size=4096), Event("free", id=1)], source="a")
        >>> y = Trace([Event("alloc", id=1, size=8192), Event("free", id=1)], source="b")
        >>> compare(x, y).first_divergence
        0
    """
    first = None
    for i, (ea, eb) in enumerate(zip(a.events, b.events)):
        if (ea.action, ea.size) != (eb.action, eb.size):
            first = i
            break
    if first is None and len(a.events) != len(b.events):
        first = min(len(a.events), len(b.events))
    if first is None:
        difference = "the two recordings make the same requests in the same order"
    else:
        ea = a.events[first] if first < len(a.events) else None
        eb = b.events[first] if first < len(b.events) else None
        difference = f"event {first}: {a.source or 'A'} {_describe(ea)}, {b.source or 'B'} {_describe(eb)}"

    def overheads(trace: Trace) -> list[tuple[int, int, int, int, float | None]]:
        samples: list = []
        recorded = recorded_allocator(trace)
        replay(trace, create(recorded.name, capacity, **recorded.options_for(capacity)),
               on_sample=lambda i, m: samples.append((i, m.reserved, m.allocated, m.largest_free, m.frag_ratio)))
        return samples

    sa, sb = overheads(a), overheads(b)
    rows = []
    for k in range(1, moments + 1):
        pa = sa[min(len(sa) - 1, k * len(sa) // moments - 1)] if sa else None
        pb = sb[min(len(sb) - 1, k * len(sb) // moments - 1)] if sb else None
        rows.append({"fraction": k / moments,
                     "a": None if pa is None else {"event": pa[0], "reserved": pa[1], "allocated": pa[2],
                                                   "largest_free": pa[3], "frag_ratio": pa[4]},
                     "b": None if pb is None else {"event": pb[0], "reserved": pb[1], "allocated": pb[2],
                                                   "largest_free": pb[3], "frag_ratio": pb[4]}})
    worst_a = max((r - u for _, r, u, _, _ in sa), default=0)
    worst_b = max((r - u for _, r, u, _, _ in sb), default=0)
    more = None if worst_a == worst_b else ("b" if worst_b > worst_a else "a")
    from_event = None
    if more is not None:
        mine, other = (sb, sa) if more == "b" else (sa, sb)
        top = max(r - u for _, r, u, _, _ in other) if other else 0
        from_event = next((i for i, r, u, _, _ in mine if r - u > top), None)
    names = {"a": a.source or "A", "b": b.source or "B"}
    summary = ("both fragment alike" if more is None else
               f"{names[more]} fragments more: {format_size(max(worst_a, worst_b))} reserved but not in use at its "
               f"worst against {format_size(min(worst_a, worst_b))}, beyond the other's worst from its event "
               f"{from_event} on")
    return Comparison(a=names["a"], b=names["b"], first_divergence=first, difference=difference, moments=rows,
                      more_fragmented=None if more is None else names[more], from_event=from_event, summary=summary)

"""Many training steps of one card through an allocator model, under a memory policy.

The workload (:mod:`ms_memopt.workload.step`) yields each step's events; the loop feeds them to
the allocator model, tracks tensor id -> address, and measures the layout

* at every **scan** (the end of every ``scan_every``-th step, after the optimizer), and
* **just before every watched request** (an allocation whose tag is a key of ``watch``,
  e.g. the AllReduce buffer), where ``largest_free`` against the request is what matters.

Measurements use the model's counters (``reserved - allocated`` and ``largest_free()``),
never a full layout, so a sample costs microseconds; layouts are built only to compact.

Policies:

``baseline``  the allocator alone.
``compact``   after the optimizer step every ``compact_every`` steps, and at a scan that warns,
              the layout is compacted (every live block moved to the lowest addresses of its
              segment, then the least-used segments emptied into holes elsewhere and given back:
              :mod:`ms_memopt.analysis.compaction.model`), and the model restarts from the compacted
              layout (``restore``); a compaction whose plan would not raise the largest piece a
              request could get is not run (``compaction_skips`` says why). At a request that
              fails, a last-resort compaction runs and the request is asked again (PyNative
              allows it: the failing op waits; inside a compiled graph the request belongs to the
              graph's memory plan and cannot wait: docs/compaction.md); the run dies only when even
              then no piece holds it. A scan warns (``compact_trigger``) when the forecast
              (:mod:`ms_memopt.analysis.forecast`, fed the samples before the watched request and the
              memory in use after each optimizer step) says the request may stop fitting in one
              piece within ``forecast_within`` steps (``"forecast"``, the default), or when its
              window saw the request with less than ``(1 + watch_margin)`` times its size free in
              one piece (``"margin"``, the earlier rule).
``pool``      pool mode: fixed regions by purpose (:class:`~ms_memopt.allocators.pool.PoolModeAllocator`).

A job dies at its first failed request: ``oom_step`` is that step (``None`` when none).

Two ways to look inside a run without a second event loop:

* ``on_watch``: called with a :class:`WatchPoint` just before every watched request (where the
  ``watch`` sample is taken) and at the failing request of an OOM; ``point.layout()`` is the
  model's layout at that moment, live blocks tagged with their request's tag (the memory map of
  ``make demo`` is collected this way). The tags are noted a step ahead, so the compiled loop
  still runs the step (unless an id of the step is allocated twice, or while live).
* ``placed``: ``{policy: PlacedRun()}``; the first seed's run of each such policy records its
  events with the model's addresses and its final layout (for ``--export-memory-viz``).
The timeline (one JSON object per sample) streams to a file as it is measured, so memory
stays constant however many steps run.

Example:
    >>> from ms_memopt.workload.step import WorkloadSpec
    >>> spec = WorkloadSpec(enabled=False)
    >>> r = simulate_policy(spec, "baseline", SimConfig(steps=3, capacity=96 * 2**30))
    >>> r.oom_step is None
    True
"""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import IO

from ms_memopt.allocators import create
from ms_memopt.allocators.base import AllocatorModel, oom_kind
from ms_memopt.analysis.forecast import Forecast, Forecaster
from ms_memopt.analysis.scan import forecast_fields
from ms_memopt.config.recipe import TimingConfig
from ms_memopt.core.events import ROW_INDEX, Event
from ms_memopt.core.layout import Layout
from ms_memopt.core.metrics import frag_ratio, measure
from ms_memopt.replay.loop import drive
from ms_memopt.simulation.pool_sizing import pool_for_workload
from ms_memopt.simulation.timing import StepCounts, collective_bytes, optimizer_extra_bytes, step_flops
from ms_memopt.templates.workload import make_workload
from ms_memopt.workload.step import WATCH_TAG, StepWorkload, WorkloadSpec

__all__ = [
    "POLICIES",
    "PlacedRun",
    "PolicyResult",
    "PolicySummary",
    "SimConfig",
    "WatchPoint",
    "simulate",
    "simulate_policy",
]

POLICIES = ("baseline", "compact", "pool")
#: skipped compactions kept in a result with their reason (the rest are counted)
MAX_SKIPS_KEPT = 20
# where a row (a tuple of Event's fields, ms_memopt.core.events.FIELDS) holds what the loop reads
_ACTION, _ID, _SIZE, _POOL, _TAG = (ROW_INDEX[n] for n in ("action", "id", "size", "pool", "tag"))
COMPACT_TRIGGERS = ("forecast", "margin")
#: tags of freed tensors a run may keep before it drops them (tags noted ahead: _Run._tag_ahead)
_STALE_TAGS = 1 << 16


@dataclass
class SimConfig:
    """How to simulate; sizes in bytes.

    ``allocator`` and ``allocator_options`` create the model of ``baseline`` and ``compact``
    (``pool`` always uses pool mode); ``watch`` maps request tags to sizes (the sizes only
    matter for the early warning). ``compact_trigger`` picks the ``compact`` policy's warning:
    ``"forecast"`` (compact at a scan whose forecast warns within ``forecast_within`` steps;
    ``None``: ``scan_every``, i.e. before the next scan could act) or ``"margin"`` (the largest
    free block seen before a watched request fell below ``1 + watch_margin`` times it).
    ``forecast_window`` is the forecast's window in steps (:class:`~ms_memopt.analysis.forecast.Forecaster`).
    """

    steps: int = 1000
    capacity: int | None = 96 * 2**30
    allocator: str = "mindspore"
    allocator_options: dict = field(default_factory=dict)
    scan_every: int = 100
    compact_every: int | None = 500
    watch: dict[str, int] = field(default_factory=lambda: {WATCH_TAG: 4_200_000_000})
    watch_margin: float = 0.5
    compact_trigger: str = "forecast"
    forecast_within: int | None = None
    forecast_window: int = 10
    seed: int = 0
    #: the time model's constants (``memopt.timing``, :mod:`ms_memopt.simulation.timing`)
    timing: TimingConfig = field(default_factory=TimingConfig)

    def __post_init__(self) -> None:
        if self.compact_trigger not in COMPACT_TRIGGERS:
            raise ValueError(f"unknown compact_trigger {self.compact_trigger!r}; expected one of "
                             f"{', '.join(COMPACT_TRIGGERS)}")

    @property
    def forecast_horizon(self) -> int:
        """Steps ahead a forecast must see the crossing to warn (``forecast_within`` or ``scan_every``)."""
        if self.forecast_within is not None:
            return self.forecast_within
        return self.scan_every or 100


@dataclass
class PolicyResult:
    """One policy, one seed; sizes in bytes, ratios as defined in :mod:`ms_memopt.core.metrics`.

    ``frag_at_oom`` is the frag ratio of the last scan before the OOM; ``oom_kind`` is
    ``"fragmentation"`` when the failing request was at most ``free_total + device_free`` at
    that moment (it would fit if the free memory were one piece), else ``"capacity"``
    (:func:`~ms_memopt.allocators.base.oom_kind`); ``allocated_at_oom`` is what was in use when it failed (the
    monitor's reading at the OOM; ``peak_allocated`` is the run's maximum). ``frag_before_compaction``/``frag_after_compaction`` are the
    worst over all compactions; ``frag_after_compaction_segment_max`` the worst frag ratio
    inside one segment (pool block) right after a compaction (what compaction can reach in one
    contiguous range). ``largest_free_by_window`` is the smallest ``largest_free``
    seen in each ``scan_every``-step window (at scans and before watched requests).
    ``forecast_warned_at`` is the first scan whose forecast of the watched request warned within
    ``SimConfig.forecast_horizon`` steps, ``forecast_step_at_warning`` the crossing step it
    estimated then (both ``None`` without a warning).
    """

    policy: str
    seed: int
    steps: int
    oom_step: int | None = None
    oom_kind: str | None = None
    oom_tag: str | None = None
    oom_size: int | None = None
    free_total_at_oom: int | None = None
    allocated_at_oom: int | None = None
    largest_free_at_oom: int | None = None
    frag_at_oom: float | None = None
    frag_ratio_max: float | None = None
    largest_free_min: int | None = None
    largest_free_by_window: list[int] = field(default_factory=list)
    compactions: int = 0
    #: compactions run at a request that failed (the rest ran after an optimizer step)
    last_resort_compactions: int = 0
    #: compactions not run, ``{"step", "why"}`` (the first :data:`MAX_SKIPS_KEPT`); ``compactions_skipped`` counts all
    compaction_skips: list[dict] = field(default_factory=list)
    compactions_skipped: int = 0
    frag_before_compaction: float | None = None
    frag_after_compaction: float | None = None
    largest_free_after_compaction_min: int | None = None
    frag_after_compaction_segment_max: float | None = None
    bytes_moved: int = 0
    forecast_warned_at: int | None = None
    forecast_step_at_warning: int | None = None
    peak_allocated: int = 0
    peak_reserved: int = 0
    region_frag_max: float | None = None
    region_frag_max_by_region: dict[str, float] | None = None
    shapes_seen: int = 0
    events: int = 0
    seconds: float = 0.0
    #: per completed step (1..), what the time model prices (:meth:`ms_memopt.simulation.timing.StepCounts.as_tuple`);
    #: not in :meth:`to_dict` (a run's worth of tuples)
    step_counts: list = field(default_factory=list, repr=False)
    #: bytes this rank sends in its stage's gradient AllReduce (:func:`ms_memopt.simulation.timing.collective_bytes`)
    collective_bytes: float = 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("step_counts")
        return out


@dataclass
class PolicySummary:
    """One policy over several seeds: each seed's result and the median OOM step
    (``None`` when fewer than half the seeds OOM)."""

    policy: str
    seeds: list[PolicyResult]

    @property
    def median_oom_step(self) -> float | None:
        steps = [r.oom_step for r in self.seeds if r.oom_step is not None]
        if not steps or 2 * len(steps) < len(self.seeds):
            return None
        # seeds that never OOM count as later than any step
        padded = sorted(steps) + [float("inf")] * (len(self.seeds) - len(steps))
        med = statistics.median(padded)
        return None if med == float("inf") else med

    def to_dict(self) -> dict:
        ooms = [r.oom_step for r in self.seeds if r.oom_step is not None]
        return {"policy": self.policy, "median_oom_step": self.median_oom_step,
                "oom_seeds": len(ooms), "oom_step_min": min(ooms, default=None),
                "oom_step_max": max(ooms, default=None),
                "seeds": [r.to_dict() for r in self.seeds]}



@dataclass
class PlacedRun:
    """The events of one run with the model's addresses, and its layout at the end.

    Frees of tensors a pool-mode cache evicted appear as frees at the eviction; a compaction
    appears as a free and an alloc (at the new address) per moved block. Every event is kept
    in memory: a few hundred steps of the 100B recipe are millions of events.
    """

    events: list[Event] = field(default_factory=list)
    final: Layout | None = None


@dataclass
class WatchPoint:
    """What ``on_watch`` receives: a run just before its watched request ``event`` (``kind``
    ``"watch"``) or at the request that failed (``kind`` ``"oom"``).

    ``model`` is the live allocator model (do not feed it); :meth:`layout` builds its layout.
    """

    policy: str
    seed: int
    step: int
    kind: str
    event: Event
    model: AllocatorModel
    _run: "_Run" = field(repr=False)

    def layout(self) -> Layout:
        """The model's layout now, each live block without a tag tagged with the tag of the
        request it serves (pool-mode blocks already carry their region's name)."""
        layout = self.model.layout()
        run = self._run
        # the live tensors' tags (tag_of may still hold tensors freed since: the loop noted them ahead)
        tag_of = run.tag_of
        tag_at = {addr: tag_of.get(tid) for tid, addr in run.addr_of.items()}
        for block in layout.blocks():
            if block.live and block.tag is None:
                block.tag = tag_at.get(block.addr)
        return layout


# --- one run ---------------------------------------------------------------------------------
class _Tracker:
    """Running figures of one run (sizes in bytes)."""

    def __init__(self, result: PolicyResult, timeline: IO[str] | None) -> None:
        self.r = result
        self.timeline = timeline
        self.window_min: int | None = None
        self.watch_min: int | None = None        # smallest largest_free before a watched request
        self.last_scan_frag: float | None = None

    def sample(self, step: int, kind: str, free_total: int, largest: int, extra: dict | None = None) -> float | None:
        r = self.r
        ratio = frag_ratio(free_total, largest)
        if ratio is not None and (r.frag_ratio_max is None or ratio > r.frag_ratio_max):
            r.frag_ratio_max = ratio
        if r.largest_free_min is None or largest < r.largest_free_min:
            r.largest_free_min = largest
        if self.window_min is None or largest < self.window_min:
            self.window_min = largest
        if self.timeline is not None:
            row = {"policy": r.policy, "seed": r.seed, "step": step, "kind": kind,
                   "free_total": free_total, "largest_free": largest, "frag_ratio": ratio}
            if extra:
                row.update(extra)
            self.timeline.write(json.dumps(row, separators=(",", ":")) + "\n")
        return ratio

    def close_window(self) -> None:
        if self.window_min is not None:
            self.r.largest_free_by_window.append(self.window_min)
        self.window_min = None


def _free_total(model: AllocatorModel) -> int:
    return model.reserved - model.allocated


def _device_free(model: AllocatorModel) -> int | None:
    return None if model.capacity is None else max(model.capacity - model.reserved, 0)


def _make_model(policy: str, spec: WorkloadSpec, cfg: SimConfig) -> AllocatorModel:
    if policy == "pool":
        return pool_for_workload(spec, capacity=cfg.capacity, fast=cfg.allocator_options.get("fast"))
    return create(cfg.allocator, cfg.capacity, **cfg.allocator_options)


def _fresh(cfg: SimConfig) -> AllocatorModel:
    """A new model of ``cfg``'s allocator to restore a layout into (no pre-grown blocks: the
    layout brings its own)."""
    options = {k: v for k, v in cfg.allocator_options.items() if k not in ("pregrow", "init_size")}
    return create(cfg.allocator, cfg.capacity, **options)


def _compact(model: AllocatorModel, addr_of: dict[int, int], cfg: SimConfig, need: int | None = None):
    """:func:`~ms_memopt.analysis.compaction.model.try_compaction` with a fresh model of ``cfg``'s allocator."""
    from ms_memopt.analysis.compaction.model import try_compaction

    return try_compaction(model, addr_of, lambda: _fresh(cfg), need=need)


class _StepTags:
    """The tag of each allocation of one step by tensor id, read once for every policy fed the
    step in lock step.

    ``fresh``: every id of the step is larger than any id of the steps before, so none of them
    can be live yet (the workload numbers its tensors in order), which spares each run the check.
    """

    def __init__(self) -> None:
        self._batch: list | None = None
        self._tags: dict | None = None
        self._fresh = False
        self._top: int | None = None       # the largest id of the steps read so far

    def of(self, batch: list[tuple]) -> tuple[dict | None, bool]:
        """``(tags, fresh)`` of ``batch``'s allocations (``tags`` ``None`` when an id is allocated
        twice in the step); the last batch's are kept while it is fed to each policy."""
        if batch is not self._batch:
            pairs = [(row[_ID], row[_TAG]) for row in batch if row[_ACTION] == "alloc"]
            tags = dict(pairs)
            self._batch, self._tags = batch, (tags if len(tags) == len(pairs) else None)
            self._fresh = self._note_ids(tags)
        return self._tags, self._fresh

    def _note_ids(self, tags: dict) -> bool:
        """Whether every id of ``tags`` is above the steps before's (ids that are not numbers: no)."""
        if not tags:
            return True
        try:
            low, high = min(tags), max(tags)
            fresh = self._top is None or low > self._top
            self._top = high if self._top is None else max(self._top, high)
        except TypeError:
            self._top = None
            return False
        return fresh


class _Run:
    """One policy on one seed, fed one step's events at a time (so several policies can
    share one generated stream)."""

    def __init__(self, spec: WorkloadSpec, policy: str, cfg: SimConfig, seed: int,
                 timeline: IO[str] | None, on_watch: Callable[[WatchPoint], None] | None = None,
                 placed: PlacedRun | None = None, peek: Callable[[int], list | None] | None = None,
                 step_tags: _StepTags | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.cfg = cfg
        self.result = PolicyResult(policy=policy, seed=seed, steps=cfg.steps)
        self.track = _Tracker(self.result, timeline)
        self.model = _make_model(policy, spec, cfg)
        self.watch = dict(cfg.watch)
        self.watch_need = max(self.watch.values(), default=0)
        self.compacting = policy == "compact"
        # one forecast, of the largest watched request: it is the first to stop fitting
        self.forecaster = Forecaster(self.watch_need, window=cfg.forecast_window) if self.watch_need else None
        self.region_metrics = getattr(self.model, "region_metrics", None)
        self.addr_of: dict[int, int] = {}
        self.on_watch = on_watch
        self.placed = placed
        # tensor id -> tag, kept only for on_watch's tagged layouts (allocator models keep no tags)
        self.tag_of: dict[int, str | None] = {}
        self.step_tags = (step_tags or _StepTags()) if on_watch is not None else None
        self.size_of: dict[int, int] = {}   # tensor id -> bytes, kept only when recording (evictions)
        self.dead = False
        self.seconds = 0.0
        # the time model (ms_memopt.simulation.timing): the step's lengths (set by the lock-step loop), the
        # unfused optimizer's extra traffic (pool mode runs the fused one), the collective
        self.spec = spec
        self.lengths: list[int] | None = None
        self.requests, self.new_shape = 0, False
        # a hand-made step's layer passes: the host time may price the real pool's requests per pass
        self.layer_passes = 0 if spec.template else spec.layers * spec.micro_batches
        self.optimizer_bytes = 0 if policy == "pool" else optimizer_extra_bytes(spec)
        self.result.collective_bytes = collective_bytes(spec)
        self._stall_counts = [0, 0, 0, 0, 0]
        self.compaction_tensors = 0
        # a learned template's next step, to look ahead at before a compaction at a step end
        self.peek = peek

    def _stall_start(self) -> tuple:
        model = self.model
        return (model.segment_allocs, model.reserved if model.virtual else 0,
                getattr(model, "eager_frees", 0), getattr(model, "slow_path_events", 0),
                getattr(model, "segment_frees", 0))

    def _stall_add(self, start: tuple) -> None:
        """Add what the model did since ``start`` (:meth:`_stall_start`) to the step's counts."""
        now = self._stall_start()
        counts = self._stall_counts
        counts[0] += max(0, now[0] - start[0])
        counts[1] += abs(now[1] - start[1]) // (2 << 20)
        counts[2] += max(0, now[2] - start[2])
        counts[3] += max(0, now[3] - start[3])
        counts[4] += max(0, now[4] - start[4])

    def _note_step(self, step: int, moved: int, compactions: int) -> None:
        """The completed step's :class:`~ms_memopt.simulation.timing.StepCounts` (steps 1..)."""
        if step < 1:
            return
        flops, model_flops, bubble = step_flops(self.spec, self.lengths or [self.spec.seq_length]
                                                * self.spec.micro_batches)
        a, v, d, slow, freed = self._stall_counts
        self.result.step_counts.append(StepCounts(flops, model_flops, bubble, a, v, d, slow, self.optimizer_bytes,
                                                  compactions, moved, self.requests,
                                                  self.requests if self.new_shape else 0,
                                                  self.compaction_tensors, device_frees=freed,
                                                  layer_passes=self.layer_passes).as_tuple())

    def feed(self, step: int, batch: list[tuple]) -> bool:
        """Run one step's events, as rows (:meth:`StepWorkload.step_rows`: ``Event(*row)`` is
        the event; no object per event) through :func:`~ms_memopt.replay.loop.drive`; ``False``
        once the job has died (OOM)."""
        if self.dead:
            return False
        started = time.perf_counter()
        self._stall_counts = [0, 0, 0, 0, 0]
        self._stall_from = self._stall_start()
        self.compaction_tensors = 0
        moved_before, compactions_before = self.result.bytes_moved, self.result.compactions
        self.step = step
        recording = self.placed is not None
        # recording sees every call, and so does tagging when the step's tags cannot be noted
        # ahead: the loop runs them in Python (else the compiled loop serves the stretches of
        # allocs and frees between marks and watched requests)
        hooked = recording or (self.on_watch is not None and not self._tag_ahead(batch))
        run = drive(batch, self.model, addr_of=self.addr_of, streams=False, stop_on_oom=True,
                    forget_evicted=True, watch=self.watch, on_watch=self._at_watch, on_mark=self._at_mark,
                    on_alloc=self._at_alloc if hooked else None,
                    on_free=self._at_free if hooked else None,
                    on_evict=self._at_evict if hooked else None,
                    on_oom=self._at_oom if self.compacting else None)
        self.model = run.model
        self.requests = run.allocs
        if run.oom_index is not None:
            self._fail(Event(*batch[run.oom_index]), step)
        if not self.dead:
            self.result.events += len(batch)
            self._stall_add(self._stall_from)
            self._note_step(step, self.result.bytes_moved - moved_before,
                            self.result.compactions - compactions_before)
        self.seconds += time.perf_counter() - started
        return not self.dead

    def _tag_ahead(self, batch: list[tuple]) -> bool:
        """Note the tag of every allocation of the step before the compiled loop runs it (it
        calls no hook back), so ``on_watch``'s layouts get their tags without the pure-Python
        loop; ``False`` (nothing noted) when that could tag a live block wrongly, i.e. when a
        tensor id is allocated twice in the step or while it is live: the hooks tag that step."""
        tags, fresh = self.step_tags.of(batch)
        addr_of = self.addr_of
        if tags is None or not (fresh or tags.keys().isdisjoint(addr_of)):
            return False
        tag_of = self.tag_of
        if len(tag_of) > 2 * len(addr_of) + _STALE_TAGS:       # now and then, not at every step
            self.tag_of = tag_of = {tid: tag_of.get(tid) for tid in addr_of}
        tag_of.update(tags)
        return True

    # --- the loop's hooks (ms_memopt.replay.loop) ---------------------------------------------
    def _at_watch(self, index: int, row: tuple, model: AllocatorModel) -> None:
        """Just before a watched request: the sample that matters (``largest_free`` against it)."""
        result, track, step = self.result, self.track, self.step
        tag, size = row[_TAG], row[_SIZE]
        extra = {"tag": tag, "size": size}
        if self.region_metrics is not None:
            extra["region_frag"] = _note_regions(result, self.region_metrics())
        lf = model.largest_free()
        track.sample(step, "watch", _free_total(model), lf, extra)
        if track.watch_min is None or lf < track.watch_min:
            track.watch_min = lf
        if self.forecaster is not None:
            self.forecaster.add(step, lf)
        if self.on_watch is not None:
            self.on_watch(WatchPoint(result.policy, result.seed, step, "watch", Event(*row), model, self))

    def _at_alloc(self, index: int, row: tuple, addr: int | None) -> None:
        if addr is None:
            return
        tid, size, tag = row[_ID], row[_SIZE], row[_TAG]
        if self.on_watch is not None:
            self.tag_of[tid] = tag
        if self.placed is not None:
            self.size_of[tid] = size
            self.placed.events.append(Event("alloc", id=tid, size=size, addr=addr, pool=row[_POOL], tag=tag,
                                            step=self.step))

    def _at_free(self, index: int, row: tuple, addr: int) -> None:
        tid = row[_ID]
        self.tag_of.pop(tid, None)
        if self.placed is not None:
            self.placed.events.append(Event("free", id=tid, size=self.size_of.pop(tid, row[_SIZE]), addr=addr,
                                            step=self.step))

    def _at_evict(self, index: int, gone: list[tuple[int, int]]) -> None:
        """A pool-mode cache evicted these tensors (the loop dropped them from ``addr_of``)."""
        for tid, addr in gone:
            self.tag_of.pop(tid, None)
            if self.placed is not None:
                self.placed.events.append(Event("free", id=tid, size=self.size_of.pop(tid, 0), addr=addr,
                                                step=self.step))

    def _at_mark(self, index: int, row: tuple, model: AllocatorModel) -> AllocatorModel:
        """A mark: the model notes it; the optimizer's end is a step's end (scan, compaction)."""
        tag, size = row[_TAG], row[_SIZE]
        if tag != "optimizer_end":
            model.note_mark(tag, size)
            return model
        cfg, track, result, step = self.cfg, self.track, self.result, self.step
        scan = cfg.scan_every and step % cfg.scan_every == 0
        forecaster = self.forecaster
        if forecaster is not None:      # long-lived memory: what stays after the optimizer step
            forecaster.add(step, None, long_lived=model.allocated)
        fc = None
        if scan:
            extra = {"allocated": model.allocated}
            if self.region_metrics is not None:
                extra["region_frag"] = _note_regions(result, self.region_metrics())
            if forecaster is not None:
                fc = forecaster.forecast()
                extra["forecast"] = forecast_fields(fc, cfg.forecast_horizon)
                if result.forecast_warned_at is None and fc.warns(cfg.forecast_horizon):
                    result.forecast_warned_at, result.forecast_step_at_warning = step, fc.step
            track.last_scan_frag = track.sample(step, "scan", _free_total(model), model.largest_free(), extra)
        if self.compacting:
            periodic = cfg.compact_every and step % cfg.compact_every == 0
            warned = scan and self._warned(fc)
            why = "periodic" if periodic else "warning"
            if (periodic or warned) and self._averts(model, step, why):
                before, model = model, self._compaction(model, why)
                if forecaster is not None and model is not before:
                    forecaster.reset(step)      # the trend described the layout just compacted
        if scan:
            track.watch_min = None
            track.close_window()
        return model

    def _compaction(self, model: AllocatorModel, why: str, need: int | None = None) -> AllocatorModel:
        """Compact ``model`` when it helps (:func:`_compact`); the model to go on with."""
        result, step = self.result, self.step
        self.model = model          # the stall counts read the model being compacted
        self._stall_add(self._stall_from)
        done = _compact(model, self.addr_of, self.cfg, need)
        self._stall_from = self._stall_start()
        if done.skipped is not None:
            self._skipped(f"{why}: {done.skipped}")
            return model
        self.model = done.model
        if self.placed is not None:
            _record_moves(self.placed.events, done.moves, step)
        _note_compaction(result, self.track, step, done.before, done.after, done.bytes_moved, why)
        # the host work walks every live tensor (mark, offsets), not only the moved ones
        self.compaction_tensors += sum(1 for _ in done.before.live_blocks())
        return done.model

    def _averts(self, model: AllocatorModel, step: int, why: str) -> bool:
        """Whether a compaction at this step end is worth it. On a learned template (a PyNative
        model's own steps, where a request that fails can wait for a last-resort compaction) only
        when the next step, run on a copy of the pool as it is, fails: the step is then first
        aid, and until the step before the one the baseline dies in the run is the baseline's
        (so it never dies sooner). The hand-made workload compacts at every planned step end,
        as the field report's periodic first aid does."""
        if self.peek is None:
            return True
        rows = self.peek(step + 1)
        if rows is not None:
            shadow = _fresh(self.cfg)
            shadow.restore(model.layout())
            ahead = drive(rows, shadow, addr_of=dict(self.addr_of), streams=False, stop_on_oom=True)
            if ahead.oom_index is not None:
                return True
        self._skipped(f"{why}: the next step fits the pool as it is (a request that fails gets a last-resort "
                      "compaction)")
        return False

    def _skipped(self, why: str) -> None:
        """A compaction not run, and why (the first :data:`MAX_SKIPS_KEPT` reasons are kept)."""
        result = self.result
        result.compactions_skipped += 1
        if len(result.compaction_skips) < MAX_SKIPS_KEPT:
            result.compaction_skips.append({"step": self.step, "why": why})

    def _at_oom(self, index: int, row: tuple, model: AllocatorModel) -> AllocatorModel | None:
        """A request failed: a last-resort compaction when afterwards a piece holds it."""
        compacted = self._compaction(model, "last resort", need=row[_SIZE])
        if compacted is model:
            return None
        self.result.last_resort_compactions += 1
        return compacted

    def _warned(self, fc: Forecast | None) -> bool:
        """The ``compact`` policy's warning at a scan (see :class:`SimConfig` ``compact_trigger``)."""
        if self.cfg.compact_trigger == "margin":
            low = self.track.watch_min
            return low is not None and low < self.watch_need * (1.0 + self.cfg.watch_margin)
        return fc is not None and fc.warns(self.cfg.forecast_horizon)

    def _fail(self, event, step: int) -> None:
        model, result = self.model, self.result
        oom = model.ooms[-1] if model.ooms else None
        free_total = _free_total(model)
        result.oom_step = step
        result.oom_tag = event.tag
        result.oom_size = event.size
        result.free_total_at_oom = free_total
        result.allocated_at_oom = model.allocated
        result.largest_free_at_oom = oom.largest_free if oom else model.largest_free()
        # the model's own record when it made one (the numbers replay reports), else the same rule
        result.oom_kind = oom.kind if oom is not None else oom_kind(event.size, free_total, _device_free(model))
        result.frag_at_oom = self.track.last_scan_frag
        self.track.sample(step, "oom", free_total, result.largest_free_at_oom,
                          {"tag": event.tag, "size": event.size, "oom_kind": result.oom_kind})
        self.dead = True
        if self.on_watch is not None:
            self.on_watch(WatchPoint(result.policy, result.seed, step, "oom", event, model, self))

    def finish(self, gen: StepWorkload, generation_seconds: float) -> PolicyResult:
        result, model = self.result, self.model
        self.track.close_window()
        result.peak_allocated = model.peak_allocated
        result.peak_reserved = max(model.peak_reserved, model.reserved)
        result.shapes_seen = len(gen.shapes_seen)
        result.seconds = self.seconds + generation_seconds
        if self.placed is not None:
            self.placed.final = model.layout()
        return result


def _run_lockstep(spec: WorkloadSpec, policies: tuple[str, ...], cfg: SimConfig, seed: int,
                  timeline: IO[str] | None, on_step: Callable[[int], None] | None,
                  on_watch: Callable[[WatchPoint], None] | None = None,
                  placed: dict[str, PlacedRun] | None = None) -> list[PolicyResult]:
    """Every policy on one seed, fed the same generated steps (generated once)."""
    placed = placed or {}
    gen = make_workload(spec, seed)
    peek = getattr(gen, "peek_rows", None)
    step_tags = _StepTags()       # read once a step for every policy that tags its layouts
    runs = [_Run(spec, policy, cfg, seed, timeline, on_watch, placed.get(policy), peek, step_tags)
            for policy in policies]
    started = time.perf_counter()
    batch = gen.prologue_rows()
    generation = time.perf_counter() - started
    alive = [run for run in runs if run.feed(0, batch)]
    for step in range(1, cfg.steps + 1):
        if not alive:
            break
        started = time.perf_counter()
        shapes = len(gen.shapes_seen)
        batch = gen.step_rows(step)
        # the time model prices kernel builds at a shape new to the rank (and each request, counted by the loop)
        new_shape = len(gen.shapes_seen) > shapes
        generation += time.perf_counter() - started
        for run in alive:
            run.lengths, run.new_shape = gen.lengths, new_shape
        alive = [run for run in alive if run.feed(step, batch)]
        if on_step is not None:
            on_step(step)
    share = generation / max(1, len(runs))
    return [run.finish(gen, share) for run in runs]


def simulate_policy(spec: WorkloadSpec, policy: str, cfg: SimConfig, *, seed: int | None = None,
                    timeline: IO[str] | None = None,
                    on_step: Callable[[int], None] | None = None,
                    on_watch: Callable[[WatchPoint], None] | None = None,
                    placed: PlacedRun | None = None) -> PolicyResult:
    """Run ``cfg.steps`` steps of ``spec`` under ``policy`` with one seed.

    Args:
        spec: the workload.
        policy: ``"baseline"``, ``"compact"`` or ``"pool"``.
        cfg: steps, capacity, allocator, scan and compaction intervals, watched requests.
        seed: the workload seed (default ``cfg.seed``); the same seed gives the same events
            under every policy.
        timeline: a text file to stream the samples to as JSON lines.
        on_step: called after every step (progress bars).
        on_watch: called with a :class:`WatchPoint` before every watched request and at an OOM.
        placed: receives the events with the model's addresses and the final layout.
    """
    seed = cfg.seed if seed is None else seed
    return _run_lockstep(spec, (policy,), cfg, seed, timeline, on_step, on_watch,
                         {policy: placed} if placed is not None else None)[0]


def _note_regions(result: PolicyResult, per_region: dict[str, float | None]) -> dict[str, float | None]:
    """Keep the worst frag ratio inside each pool-mode region."""
    worst = result.region_frag_max_by_region or {}
    for name, ratio in per_region.items():
        if ratio is not None:
            worst[name] = max(worst.get(name, 0.0), ratio)
            if result.region_frag_max is None or ratio > result.region_frag_max:
                result.region_frag_max = ratio
    result.region_frag_max_by_region = worst
    return per_region


def _record_moves(record: list[Event], moves: list, step: int) -> None:
    """A compaction as events: each moved block freed at its old address, allocated at the new."""
    for move in moves:
        record.append(Event("free", id=move.block_id, size=move.size, addr=move.src, step=step, tag="compaction"))
    for move in moves:
        record.append(Event("alloc", id=move.block_id, size=move.size, addr=move.dst, step=step, tag="compaction"))


def _note_compaction(result: PolicyResult, track: _Tracker, step: int, before: Layout, after: Layout,
                     moved: int, why: str) -> None:
    mb, ma = measure(before), measure(after)
    result.compactions += 1
    result.bytes_moved += moved
    if mb.frag_ratio is not None and (result.frag_before_compaction is None or mb.frag_ratio > result.frag_before_compaction):
        result.frag_before_compaction = mb.frag_ratio
    if ma.frag_ratio is not None and (result.frag_after_compaction is None or ma.frag_ratio > result.frag_after_compaction):
        result.frag_after_compaction = ma.frag_ratio
    for seg in after.segments:
        holes = [b.size for b in seg.blocks if not b.live]
        seg_ratio = frag_ratio(sum(holes), max(holes, default=0))
        if seg_ratio is not None and (result.frag_after_compaction_segment_max is None
                                      or seg_ratio > result.frag_after_compaction_segment_max):
            result.frag_after_compaction_segment_max = seg_ratio
    if result.largest_free_after_compaction_min is None or ma.largest_free < result.largest_free_after_compaction_min:
        result.largest_free_after_compaction_min = ma.largest_free
    track.sample(step, "compaction", ma.free_total, ma.largest_free,
                 {"why": why, "frag_before": mb.frag_ratio, "largest_free_before": mb.largest_free,
                  "bytes_moved": moved})


def simulate(spec: WorkloadSpec, cfg: SimConfig, *, policies: tuple[str, ...] = POLICIES,
             seeds: list[int] | None = None, timeline: IO[str] | None = None,
             on_step: Callable[[int], None] | None = None,
             on_watch: Callable[[WatchPoint], None] | None = None,
             placed: dict[str, PlacedRun] | None = None) -> dict[str, PolicySummary]:
    """Every policy over every seed. The policies of one seed run in lock step on one generated
    stream (the same events for every policy, generated once).

    ``on_watch`` sees every run (check ``point.policy`` / ``point.seed``); ``placed`` records the
    first seed's run of each policy it names (see :class:`PlacedRun`)."""
    seeds = [cfg.seed] if seeds is None else list(seeds)
    per_policy: dict[str, list[PolicyResult]] = {p: [] for p in policies}
    for index, seed in enumerate(seeds):
        for result in _run_lockstep(spec, tuple(policies), cfg, seed, timeline, on_step, on_watch,
                                    placed if index == 0 else None):
            per_policy[result.policy].append(result)
    return {p: PolicySummary(p, runs) for p, runs in per_policy.items()}

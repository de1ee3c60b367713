"""The settings ``ms-memopt doctor`` replays over a recording, per allocator family, and their ranking.

A remedy is advice in the recording's own terms: a MindSpore job gets ``MS_ALLOC_CONF`` and
``ms.runtime.set_memory`` (and the project's compaction and pool mode), a PyTorch job
``PYTORCH_CUDA_ALLOC_CONF``, a torch_npu job ``PYTORCH_NPU_ALLOC_CONF``. The family follows the
model the recording is replayed through (:func:`family_of_model`), so ``--allocator mindspore``
on a PyTorch snapshot gets MindSpore's settings.

:data:`SETTINGS` is the table: family -> the settings tried, each with the exact line the
user writes (``{capacity_gb}`` is filled with the capacity, e.g. ``80GB``). Text advice without
a replay (crash logs, :mod:`ms_memopt.doctor.remedy_table`) can name the same lines from it.
Each :class:`Setting` is replayed (:func:`measure_remedies`) and ranked: survives at the
capacity, then peak reserved without a capacity (what the setting saves), then the worst frag
ratio. :func:`summary` says in one sentence which setting saves the run, or plainly that none
does and what would.

Example:
    >>> [s.setting for s in SETTINGS["mindspore"]][:2]
    ['enable_vmm:True', 'increase_size=256.00 MiB']
    >>> family_of_model("torch-npu-expandable"), family_of_model("mindspore-bestfit")
    ('torch_npu', 'mindspore')
"""
from __future__ import annotations

import multiprocessing
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from ms_memopt.allocators import create
from ms_memopt.allocators.base import AllocatorModel
from ms_memopt.allocators.options import OPTION_TYPES
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Trace
from ms_memopt.core.units import format_size
from ms_memopt.io.traces.ms_pool_log import POOL_NAME
from ms_memopt.replay.replay import ReplayResult, replay
from ms_memopt.simulation.executors import default_workers

__all__ = ["Setting", "Remedy", "SETTINGS", "FAMILY_OF_MODEL", "EXPANDABLE_OF", "family_of_model",
           "remedy_settings", "measure_remedies", "summary", "SkippedSetting"]

#: allocator model -> the family whose settings apply to it
FAMILY_OF_MODEL = {"mindspore": "mindspore", "mindspore-bestfit": "mindspore", "mindspore-vmm": "mindspore",
                   "torch": "torch", "torch-expandable": "torch",
                   "torch-npu": "torch_npu", "torch-npu-expandable": "torch_npu"}
#: a caching allocator model -> its model with ``expandable_segments:True``
EXPANDABLE_OF = {"torch": "torch-expandable", "torch-npu": "torch-npu-expandable"}

#: the models whose addresses were checked against real recordings (docs/verified.md) with
#: their default options; every other setting follows the allocator's source only
_VERIFIED = {("torch", ()), ("torch-npu", ()), ("mindspore-bestfit", ())}


@dataclass(frozen=True)
class Setting:
    """One setting to replay. ``line`` is what the user writes (``{capacity_gb}`` filled from
    the capacity). ``allocator``: the model to replay (``None``: the recorded one, with
    ``options`` on top of its recorded options; ``"expandable"``: its expandable twin,
    :data:`EXPANDABLE_OF`). ``policy``: ``baseline``, ``compact``, ``pool`` or ``empty_cache``.
    ``needs``: what the recording must offer: ``capacity`` (a ``--capacity``), ``steps`` (step
    events), ``ascend`` (not MindSpore's CPU pool), ``start`` (recorded from the first
    allocation: no state before it), ``grown`` / ``pregrown`` (the recorded pool grows on demand /
    was pre-grown to the card with ``init_size``)."""

    setting: str
    line: str
    allocator: str | None = None
    options: tuple = ()
    policy: str = "baseline"
    note: str = ""
    needs: tuple = ()


def _gb(nbytes: int) -> str:
    """A size as MindSpore's ``set_memory`` takes it: GB (2**30 bytes), e.g. ``80GB``, ``0.25GB``."""
    return f"{nbytes / 2**30:.4g}GB"


def _torch_like(var: str, fraction_call: str, divisions_note: str = "") -> list[Setting]:
    """PyTorch's caching allocator settings, as torch and torch_npu spell them (``var``);
    ``divisions_note``: where ``roundup_power2_divisions`` is taken."""
    out = [Setting("expandable_segments:True", f"export {var}=expandable_segments:True", "expandable")]
    out += [Setting(f"max_split_size_mb:{mb}", f"export {var}=max_split_size_mb:{mb}", None,
                    (("max_split_size_mb", mb),)) for mb in (64, 128, 256, 512)]
    out += [Setting(f"garbage_collection_threshold:{f}",
                    f"export {var}=garbage_collection_threshold:{f} (with {fraction_call}, which it needs)", None,
                    (("garbage_collection_threshold", f),), needs=("capacity",)) for f in (0.6, 0.8)]
    out += [Setting(f"roundup_power2_divisions:{d}", f"export {var}=roundup_power2_divisions:{d}", None,
                    (("roundup_power2_divisions", d),), note=divisions_note) for d in (4, 8)]
    return out


_MINDSPORE = [
    Setting("enable_vmm:True", 'export MS_ALLOC_CONF="enable_vmm:True"', "mindspore-vmm",
            note="Ascend with a driver >= 24.0.0 (the 2.10 default on 910B/910_93)", needs=("ascend",)),
    *[Setting(f"increase_size={format_size(size)}",
              f'ms.runtime.set_memory(increase_size="{_gb(size)}")  # with your other arguments', None,
              (("increase_size", size),), needs=("grown",)) for size in (256 << 20, 512 << 20, 2 << 30, 4 << 30)],
    Setting("init_size=capacity (pre-grown)",
            'ms.runtime.set_memory(init_size="{capacity_gb}")  # in the launch script, before the first tensor',
            None, (("pregrow", True),), needs=("capacity",)),
    Setting("init_size default (grown on demand)",
            'ms.runtime.set_memory(init_size="2GB")  # the default: the pool grows by increase_size as it needs',
            None, (("pregrow", False), ("init_size", 0)), needs=("pregrown",)),
    Setting("empty_cache at the step ends", "ms.runtime.empty_cache() after each step", None, policy="empty_cache",
            note="MindSpore 2.10's best-fit Ascend pool only warns; under VMM it unmaps idle pages", needs=("steps",)),
    Setting("compaction at the step ends", "CompactionCallback(every=1) (ms_memopt.mindspore; on Ascend it moves "
            "only what ms-memopt owns, docs/compaction.md)", None, policy="compact", needs=("steps",)),
    Setting("pool mode", "enable_pool_mode(net, optimizer, checkpoint_every=k, batch_size=b) (ms_memopt.mindspore, "
            "docs/pool_mode.md)", "pool", policy="pool",
            note="regions by the purposes the recording's lifetimes show, sized from this recording: a best case",
            needs=("capacity", "start")),
]

#: family -> the settings doctor replays, in the family's own terms (module doc)
SETTINGS: dict[str, list[Setting]] = {
    "mindspore": _MINDSPORE,
    "torch": _torch_like("PYTORCH_CUDA_ALLOC_CONF", "torch.cuda.set_per_process_memory_fraction"),
    # torch_npu reads roundup_power2_divisions from 7.3 (NPUCachingAllocator.cpp, parseArgs); older ones refuse it
    "torch_npu": _torch_like("PYTORCH_NPU_ALLOC_CONF", "torch_npu.npu.set_per_process_memory_fraction",
                             "torch_npu 7.3 or later (earlier versions refuse the option at start-up)"),
}


def family_of_model(allocator: str) -> str:
    """The family of an allocator model's settings (:data:`FAMILY_OF_MODEL`; unknown: its name)."""
    return FAMILY_OF_MODEL.get(allocator, allocator)


@dataclass
class Remedy:
    """One setting replayed over the recording; ``line`` is what to set."""

    setting: str
    line: str
    allocator: str
    options: dict
    peak_reserved: int
    #: the peak without a capacity: what the setting saves (equal to ``peak_reserved`` when unbounded)
    peak_reserved_unbounded: int
    oom_count: int
    slow_path_events: int
    frag_ratio_max: float | None
    survives: bool
    verified: bool
    note: str = ""
    timeline: list[tuple[int, int, int, float | None]] = field(default_factory=list, repr=False)
    #: ``peak_reserved_unbounded`` was measured without a limit (not for a pool pre-grown to the
    #: card or pool mode, whose peak is the card)
    unbounded: bool = True

    @property
    def measured(self) -> bool:
        return not self.note.startswith("not measured")

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("timeline")
        return out


@dataclass(frozen=True)
class SkippedSetting:
    """A setting of the family not tried on this recording, and why."""

    setting: str
    why: str


def _why_not(setting: Setting, trace: Trace, capacity: int | None, options: dict, steps: bool) -> str | None:
    """Why ``setting`` is not tried on ``trace`` (``steps``: it has step events), or ``None``."""
    pregrown = bool(options.get("pregrow")) or bool(capacity and options.get("init_size", 0) >= capacity)
    for need in setting.needs:
        if need == "grown" and pregrown:
            return "the recorded pool is pre-grown to the card (init_size), so it never grows by increase_size"
        if need == "pregrown" and not pregrown:
            return "the recorded pool is not pre-grown"
        if need == "capacity" and capacity is None:
            return "needs --capacity (it sizes to the card)"
        if need == "steps" and not steps:
            return "the recording has no step events (record with ms-memopt record, whose step marks it writes)"
        if need == "ascend" and trace.meta.get("pool") == POOL_NAME:
            return ("this is MindSpore's CPU pool (DynamicMemPoolBestFit); VMM exists only in the Ascend pool "
                    "(AscendVmmAdapter), so MS_ALLOC_CONF enable_vmm changes nothing on CPU")
        if need == "start" and trace.initial is not None and any(b.live for b in trace.initial.blocks()):
            live = [b for b in trace.initial.blocks() if b.live]
            return (f"not measured: the recording starts mid-run, {len(live)} blocks "
                    f"({format_size(sum(b.size for b in live))}) already live at addresses the recorded allocator "
                    "chose; pool mode plans every tensor from the first allocation, so it needs a recording from "
                    "the start of training (ms-memopt record, or _record_memory_history before the first tensor)")
    return None


def remedy_settings(trace: Trace, *, capacity: int | None, allocator: str, options: dict | None = None,
                    family: str | None = None) -> tuple[list[Setting], list[SkippedSetting]]:
    """The settings :func:`measure_remedies` replays for a recording replayed through
    ``allocator`` (with its recorded ``options``), the recorded one first (``"baseline"``), each
    resolved to a concrete model, options and line; and those of the family (default: the
    model's, :func:`family_of_model`) left out, with why."""
    options = dict(options or {})
    out = [Setting("baseline", "(as recorded)", allocator, tuple(sorted(options.items())))]
    skipped: list[SkippedSetting] = []
    values = {"capacity_gb": _gb(capacity) if capacity is not None else "?"}
    cpu_pool = trace.meta.get("pool") == POOL_NAME
    steps = any(e.action == "step" for e in trace.events)
    for setting in SETTINGS.get(family or family_of_model(allocator), []):
        why = _why_not(setting, trace, capacity, options, steps)
        if why is not None:
            skipped.append(SkippedSetting(setting.setting, why))
            continue
        if setting.allocator is None:
            model, merged = allocator, {**options, **dict(setting.options)}
            if merged == options and setting.policy == "baseline":
                skipped.append(SkippedSetting(setting.setting, "the recording already runs with it"))
                continue
            foreign = sorted(set(dict(setting.options)) - set(OPTION_TYPES.get(model, {})))
            if foreign:
                skipped.append(SkippedSetting(setting.setting, f"{model} has no {foreign[0]} (the recording's model)"))
                continue
        elif setting.allocator == "expandable":
            model = EXPANDABLE_OF.get(allocator)
            if model is None:           # already expandable
                skipped.append(SkippedSetting(setting.setting, "the recording already runs with it"))
                continue
            merged = {k: v for k, v in options.items() if k == "roundup_power2_divisions"}
        else:
            model, merged = setting.allocator, dict(setting.options)
        if model == allocator and setting.allocator is not None:
            skipped.append(SkippedSetting(setting.setting, "the recording already runs with it"))
            continue
        note = setting.note
        if cpu_pool and setting.line.startswith("ms.runtime.set_memory"):
            note = "for the Ascend job: MindSpore's CPU pool ignores set_memory (docs/doctor.md)"
        out.append(replace(setting, line=setting.line.format(**values), allocator=model,
                           options=tuple(sorted(merged.items())), note=note))
    return out, skipped


def _run(trace: Trace, setting: Setting, capacity: int | None) -> ReplayResult:
    options = dict(setting.options)
    if setting.policy in ("compact", "pool"):
        from ms_memopt.replay.whatif import replay_policy

        if setting.policy == "pool" and trace.initial is not None:
            # idle cached segments before the first event mean nothing to pool mode, which owns the
            # whole card from the start (a live block before it is refused earlier: needs "start")
            trace = replace(trace, initial=None)
        return replay_policy(trace, setting.policy, allocator=setting.allocator, capacity=capacity, options=options)
    timeline: list = []
    # the compiled path where built (the same placements and slow path); the table reads the first
    # failure and the count, so only the first is measured in full
    model = create(setting.allocator, capacity, **options)
    model.full_oom_records = 1
    on_step = None
    if setting.policy == "empty_cache":
        def on_step(step: int, current: AllocatorModel, addresses: dict) -> AllocatorModel:
            current.empty_cache()
            return current
    result = replay(trace, model, on_step=on_step,
                    on_sample=lambda index, m: timeline.append((index, m.free_total, m.largest_free, m.frag_ratio)))
    result.policy = {"timeline": timeline}
    return result


def _remedy(setting: Setting, result: ReplayResult, unbounded: ReplayResult, measured_unbounded: bool) -> Remedy:
    timeline = (result.policy or {}).get("timeline", [])
    note = setting.note
    regions = (result.policy or {}).get("regions")
    if regions:     # pool mode: say which purposes its regions hold
        note = (f"regions by the purposes the recording's lifetimes show ("
                + ", ".join(f"{name} {format_size(size)}" for name, size in regions.items())
                + "), sized from this recording: a best case")
    return Remedy(setting=setting.setting, line=setting.line, allocator=setting.allocator,
                  options=dict(setting.options), peak_reserved=result.peak_reserved,
                  peak_reserved_unbounded=unbounded.peak_reserved, oom_count=result.oom_count,
                  slow_path_events=result.slow_path_events, frag_ratio_max=result.frag_ratio_max,
                  survives=not result.oom_count, verified=(setting.allocator, setting.options) in _VERIFIED
                  and setting.policy == "baseline", note=note, timeline=timeline,
                  unbounded=measured_unbounded)


def _measure(trace: Trace, setting: Setting, capacity: int | None) -> Remedy:
    """``setting`` replayed at ``capacity`` (and without one, for its peak) as a :class:`Remedy`;
    one that could not be measured says why in ``note``."""
    try:
        result = _run(trace, setting, capacity)
        # what the setting saves is its peak without a card's limit (at the capacity every
        # failing setting peaks at the capacity); pool mode needs the capacity to size regions
        sized = setting.policy == "pool" or bool(dict(setting.options).get("pregrow"))
        unbounded = result if capacity is None or sized else _run(trace, setting, None)
    except (InputError, NotImplementedError, ValueError) as exc:  # e.g. pool regions larger than the card
        return Remedy(setting.setting, setting.line, setting.allocator, dict(setting.options), 0, 0, 0, 0,
                      None, False, False, note=f"not measured: {exc}")
    return _remedy(setting, result, unbounded, not sized or capacity is None)


#: (trace, capacity) of the settings being measured: what a forked worker inherits instead of
#: receiving the trace pickled (a million events)
_SHARED: tuple | None = None


def _measure_shared(setting: Setting) -> Remedy:
    """:func:`_measure` in a forked worker, on the trace it inherited."""
    trace, capacity = _SHARED
    return _measure(trace, setting, capacity)


def _measure_all(trace: Trace, settings: list[Setting], capacity: int | None,
                 progress: Callable[[str], None] | None) -> list[Remedy]:
    """:func:`_measure` of every setting, in order: on forked workers, one a core, when the system
    forks and has cores to spare (the workers share the read trace); one after the other otherwise."""
    global _SHARED
    workers = min(len(settings), default_workers())
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        remedies = []
        for setting in settings:
            if progress is not None:
                progress(setting.setting)
            remedies.append(_measure(trace, setting, capacity))
        return remedies
    _SHARED = (trace, capacity)
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            remedies = []
            for setting, remedy in zip(settings, pool.imap(_measure_shared, settings)):
                if progress is not None:
                    progress(setting.setting)
                remedies.append(remedy)
            return remedies
    finally:
        _SHARED = None


def measure_remedies(trace: Trace, settings: list[Setting], *, capacity: int | None,
                     progress: Callable[[str], None] | None = None) -> list[Remedy]:
    """Replay ``trace`` under each setting (the first is the recorded one) and rank them:
    survives at ``capacity``, then peak reserved without a capacity, then the worst frag ratio;
    settings that could not be measured last, with why in ``note``. The settings run in parallel
    where cores allow (forked workers sharing ``trace``: it is read once)."""
    remedies = _measure_all(trace, settings, capacity, progress)
    measured = [r for r in remedies if r.measured]
    # survivors by what they save; the others by how close they come: the card they need, then failures
    return sorted(measured, key=lambda r: (not r.survives, not r.survives and not r.unbounded,
                                           r.peak_reserved_unbounded, r.oom_count, r.frag_ratio_max or 0.0)) + \
        [r for r in remedies if not r.measured]


def summary(remedies: list[Remedy], capacity: int | None, *, needs: str | None = None) -> str:
    """One plain sentence: which setting saves the run at ``capacity``, or that none does and
    what would (the smallest card any setting fits in unbounded; ``needs``: a plan's words, e.g.
    "ms-memopt plan ... puts stage 0 at 82.43 GiB per card")."""
    measured = [r for r in remedies if r.measured]
    if not measured:
        return "no setting could be measured on this recording"
    if capacity is None:
        best = measured[0]
        return (f"{best.setting} reserves the least without a limit ({format_size(best.peak_reserved_unbounded)}); "
                "give --capacity to see which settings survive on a card")
    saving = [r for r in measured if r.survives and r.setting != "baseline"]
    base = next((r for r in measured if r.setting == "baseline"), None)
    if base is not None and base.survives:
        text = f"the run as recorded fits in {format_size(capacity)}"
        best = next((r for r in measured if r.survives and r.unbounded), None)
        if best is not None and best is not base and base.unbounded \
                and best.peak_reserved_unbounded < base.peak_reserved_unbounded:
            saved = base.peak_reserved_unbounded - best.peak_reserved_unbounded
            return text + (f"; {best.setting} would reserve {format_size(saved)} less (a smaller card would "
                           f"still hold it): {best.line}")
        return text + "; no setting reserves less"
    if saving:
        names = ", ".join(r.setting for r in saving[:3])
        return (f"{len(saving)} setting(s) save this run at {format_size(capacity)}, best first: {names}; "
                f"set: {saving[0].line}")
    closest = min(measured, key=lambda r: (r.oom_count, r.peak_reserved_unbounded))
    text = (f"no setting saves this run at {format_size(capacity)}: every one still runs out of memory "
            f"(the fewest failures: {closest.setting}, {closest.oom_count}).")
    grown = [r for r in measured if r.unbounded]
    if grown:
        smallest = min(grown, key=lambda r: r.peak_reserved_unbounded)
        text += (f" What would: a card of at least {format_size(smallest.peak_reserved_unbounded)} "
                 f"({smallest.setting}'s peak reserved without a limit)")
    else:
        text += " What would: a larger card (every setting here fills the card it is given)"
    if needs:
        text += f"; {needs}"
    pool = next((r for r in remedies if r.setting == "pool mode"), None)
    if pool is not None and not pool.measured:
        text += f"; pool mode {pool.note}"
    return text

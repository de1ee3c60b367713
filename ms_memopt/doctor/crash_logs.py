"""``ms-memopt doctor LOG`` and ``doctor LOGDIR``: the verdict from what a failed job printed.

The OOM message a framework prints holds the answer to the field report's question, was the
memory used up or only cut into pieces, whenever it prints the free memory inside the pool next to
the request (:mod:`ms_memopt.io.oom_logs` reads the messages). For each report the verdict is the
one rule of :func:`~ms_memopt.allocators.base.oom_kind`, on the figures as printed:

* ``free_total``: memory inside the pool no tensor held. PyTorch/torch_npu: "reserved but
  unallocated" (reserved - allocated in the older wording); MindSpore's dynamic pool: the idle
  memory of its state dump (``GLOG_v=1``); the two-pointer adapter: the gap between its static and
  dynamic pointers (one piece); the VMM path: MindSpore's total minus what is in use.
* ``device_free``: device memory the pool could still take: PyTorch's "free" (capped by a memory
  fraction's "allowed"), MindSpore's "current free memory size[...]" (0 when the device refused a
  new block).
* ``held_elsewhere``: device memory neither: other processes and this process outside the
  allocator (PyTorch: capacity - free - reserved), or withheld by ``max_device_memory``
  (MindSpore: the card's size - MindSpore's share).

``fragmentation``: ``request <= free_total + device_free``; ``outside`` (the allocator): the request
would have fitted in what was held elsewhere too; ``capacity``: not even then; ``undecidable``: a
figure the rule needs was not printed, and the verdict names it with the setting that prints it
next time. Every figure is a range (MindSpore's ``M`` rounds down, PyTorch rounds to two
decimals); when the rule gives another answer at the ends of the ranges the verdict says so
(``sure`` false, ``caveat``).

With the pool's debug dump beside the log (``MemoryDebugInfo<N>.txt``,
:func:`~ms_memopt.io.traces.ms_debug_dump.read_pool_debug_dump`) the verdict also has the layout
at the failure: the largest hole and the live blocks that would have to move to open one the
request's size (the compaction planner's cheapest window).

:func:`diagnose_logdir` reads a whole job's folder (msrun's ``worker_N.log``, ``rank_N/`` folders,
MindFormers' ``output/log/rank_N/``), every rank in parallel through
:func:`~ms_memopt.simulation.executors.run_tasks`, finds the rank(s) whose OOM came first and tells
them from the ranks that failed after them (HCCL timeouts and other exceptions).

Example:
    >>> from ms_memopt.io.oom_logs import parse_message
    >>> r = parse_message("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.20 GiB. GPU 0 has a "
    ...     "total capacity of 79.15 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has "
    ...     "78.07 GiB memory in use. Of the allocated memory 63.61 GiB is allocated by PyTorch, and 13.96 GiB "
    ...     "is reserved by PyTorch but unallocated.")
    >>> v = crash_verdict(r)
    >>> v.kind, v.sure
    ('fragmentation', True)
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path


from ms_memopt.allocators.base import oom_kind
from ms_memopt.analysis.compaction.planner import cheapest_opening
from ms_memopt.core.errors import InputError
from ms_memopt.core.layout import Layout
from ms_memopt.core.metrics import measure
from ms_memopt.core.units import aligned, format_size
from ms_memopt.doctor.remedy_table import RECORD, family_of, remedy_lines
from ms_memopt.io.oom_logs import Figure, LogScan, OOMReport, contradictions, rank_of_path, read_oom_log

__all__ = ["RuntimeShare", "RUNTIME_SHARE", "CrashVerdict", "CrashRemedy", "LogDiagnosis", "JobDiagnosis", "crash_verdict", "crash_remedies",
           "diagnose_log", "diagnose_logdir", "find_rank_logs", "scan_rank", "scan_ranks", "plan_for"]

@dataclass(frozen=True)
class RuntimeShare:
    """Device memory a framework's runtime holds outside its allocator whatever the user does,
    per device family, in bytes: ``share`` is what it typically takes, ``margin`` how far beyond
    it the unaccounted memory must go before the verdict says "outside" (the runtime's own take
    varies with the driver, the libraries loaded and the communicators); ``takes`` says what it
    is and ``check`` the command that tells who holds the card's memory."""

    share: int
    margin: int
    takes: str
    check: str


#: per framework (its device family). CUDA: a context with PyTorch's kernels, cuBLAS and cuDNN
#: takes 0.3-1.5 GiB by GPU and CUDA version (lazy module loading, CUDA 11.7+, lowers it).
#: Ascend under torch_npu: the CANN runtime's context and HCCL's buffers (HCCL_BUFFSIZE, 200 MiB
#: a communicator by default). MindSpore leaves the Ascend runtime and HCCL 2 GiB by default
#: (``max_device_memory`` below the card's size).
RUNTIME_SHARE = {
    "pytorch": RuntimeShare(1 << 30, 1 << 30, "a CUDA context with its kernels and libraries (0.3-1.5 GiB)",
                            "nvidia-smi --query-compute-apps=pid,used_memory --format=csv"),
    "torch_npu": RuntimeShare(1 << 30, 1 << 30, "the CANN runtime's context and HCCL's buffers",
                              "npu-smi info (its process table)"),
    "mindspore": RuntimeShare(2 << 30, 1 << 30, "what MindSpore leaves the Ascend runtime and HCCL by default",
                              "npu-smi info (its process table)"),
}
#: unaccounted device memory below this is not worth a word in the verdict
_UNACCOUNTED_SHOWN = 64 << 20
#: ranks whose first OOM is this close to the earliest one are "first" too (clocks of different hosts)
FIRST_WINDOW_SECONDS = 1.0
_DEBUG_DUMP = re.compile(r"MemoryDebugInfo\d*\.txt$")
_LOG_NAME = re.compile(r"\.(log|txt|out|err)(\.\d+)?(\.gz)?$|^(stdout|stderr)(\.gz)?$")


@dataclass
class CrashVerdict:
    """The verdict on one OOM report; sizes in bytes (the printed values; ``None`` when not printed).

    ``kind``: ``"fragmentation"``, ``"capacity"``, ``"outside"`` or ``"undecidable"``. ``sure``:
    the same kind at both ends of every printed figure's range; else ``caveat`` says what the
    rounding could flip. ``missing``/``setting``: for ``undecidable``, the figure the message lacks
    and the setting that prints it next time. ``largest_free``: the largest hole when a layout was
    read (else an upper bound from the pool's per-block idle sizes, ``largest_free_bound``).
    """

    kind: str
    request: int | None
    free_total: int | None = None
    device_free: int | None = None
    held_elsewhere: int | None = None
    capacity: int | None = None
    largest_free: int | None = None
    largest_free_bound: int | None = None
    sure: bool = True
    caveat: str | None = None
    missing: str | None = None
    setting: str | None = None
    failed: bool = True
    text: str = ""
    #: device memory held neither by the pool nor free (the runtime's own, other processes, a
    #: limit), as printed; "outside" only when it passes the runtime's share by its margin
    unaccounted: int | None = None
    #: bytes the message says other processes held (PyTorch 2.1+: "Process N has ...")
    held_by_others: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CrashRemedy:
    """One thing to set, for the report's framework and verdict: ``line`` as the user writes it."""

    setting: str
    line: str
    why: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LogDiagnosis:
    """Every OOM report of one log (or one rank's logs), each with its verdict and remedies.

    ``verdict``/``remedies``/``blockers`` are the first report's; ``record`` the command that records
    the run for a full diagnosis next time.
    """

    source: str
    rank: int | None
    reports: list[OOMReport]
    verdicts: list[CrashVerdict]
    remedies: list[CrashRemedy] = field(default_factory=list)
    record: str = ""
    layout_file: str | None = None
    blockers: list[dict] = field(default_factory=list)
    layout: Layout | None = None
    first_error: str | None = None
    first_error_time: str | None = None
    last_step: int | None = None
    bytes_read: int = 0

    @property
    def verdict(self) -> CrashVerdict | None:
        return self.verdicts[0] if self.verdicts else None

    def to_dict(self) -> dict:
        first = self.verdict
        reports = []
        for report, verdict in zip(self.reports, self.verdicts):
            entry = report.to_dict()
            entry["verdict"] = verdict.to_dict()
            reports.append(entry)
        return {"log": self.source, "rank": self.rank, "verdict": None if first is None else first.to_dict(),
                "reports": reports, "remedies": [r.to_dict() for r in self.remedies], "record": self.record,
                "layout_file": self.layout_file, "blockers": self.blockers, "first_error": self.first_error,
                "last_step": self.last_step, "bytes_read": self.bytes_read}


# --- the verdict --------------------------------------------------------------------------------------
def _sum(*figs: Figure | None) -> Figure | None:
    if any(f is None for f in figs):
        return None
    return Figure(sum(f.value for f in figs), sum(f.low for f in figs), sum(f.high for f in figs),
                  " + ".join(f.printed for f in figs))


def _diff(a: Figure | None, b: Figure | None) -> Figure | None:
    """``a - b`` as a range, floored at 0."""
    if a is None or b is None:
        return None
    return Figure(max(0, a.value - b.value), max(0, a.low - b.high), max(0, a.high - b.low),
                  f"{a.printed} - {b.printed}")


def _exact(value: int) -> Figure:
    return Figure(value, value, value, f"{value}B")


@dataclass
class _Terms:
    """What the rule needs from one report, each a range of bytes (``None``: not printed).

    ``unaccounted``: device memory held neither by the allocator's pool nor free (the runtime's
    own, other processes, a limit); ``held``: what of it counts as held elsewhere (beyond the
    runtime's share and its margin, or withheld by a limit); ``seen``: bytes other processes
    were printed to hold (PyTorch 2.1+ lists them), the evidence that settles "outside"."""

    free_total: Figure | None = None
    device_free: Figure | None = None
    held: Figure | None = None
    capacity: Figure | None = None
    missing: str | None = None
    setting: str | None = None
    unaccounted: Figure | None = None
    seen: Figure | None = None


def _beyond_share(unaccounted: Figure | None, framework: str) -> Figure | None:
    """The unaccounted memory beyond the runtime's share, counted only past the margin: each end
    of the range alike, so the rule stays monotone and the rounding caveat still holds."""
    if unaccounted is None:
        return None
    runtime = RUNTIME_SHARE[framework]
    beyond = _diff(unaccounted, _exact(runtime.share))

    def past(v: int) -> int:
        return v if v > runtime.margin else 0
    return Figure(past(beyond.value), past(beyond.low), past(beyond.high), beyond.printed)


def _terms(report: OOMReport) -> _Terms:
    """The rule's terms of a report (see :class:`_Terms` and the module's doc)."""
    f = report.figures
    if report.allocator == "mps":
        # the MPS allocator refuses what would pass its limit (the high watermark): free = allowed - in use
        allowed = f.get("allowed")
        in_use = _sum(f.get("allocated"), f.get("other_allocations") or _exact(0))
        if allowed is None:
            return _Terms(missing="the limit (max allowed)", setting="nothing to set: keep the message whole")
        return _Terms(_exact(0), _diff(allowed, in_use))
    if report.framework in ("pytorch", "torch_npu"):
        conf = "PYTORCH_NPU_ALLOC_CONF" if report.framework == "torch_npu" else "PYTORCH_CUDA_ALLOC_CONF"
        free_total = f.get("reserved_unallocated")
        device_free = f.get("device_free")
        capacity = f.get("capacity")
        if free_total is None or device_free is None:
            missing = "reserved but unallocated memory" if free_total is None else "the device's free memory"
            return _Terms(free_total, device_free, None, capacity, missing,
                          f"nothing to set: the allocator prints it by default ({conf} changes nothing here); keep "
                          f"the message whole (log str(exc) of the OutOfMemoryError, not a cut copy)")
        reserved = _sum(f.get("allocated"), free_total)
        unaccounted = _diff(_diff(capacity, device_free), reserved) if capacity is not None else None
        held = _beyond_share(unaccounted, report.framework)
        if "allowed" in f and reserved is not None:
            # a memory fraction: the pool may reserve up to "allowed"; the rest of the free memory is withheld
            room = _diff(f["allowed"], reserved)
            usable = Figure(min(room.value, device_free.value), min(room.low, device_free.low),
                            min(room.high, device_free.high), f"min({room.printed}, {device_free.printed})")
            withheld = _diff(device_free, usable)
            held = withheld if held is None else _sum(held, withheld)
            device_free = usable
        return _Terms(free_total, device_free, held, capacity, unaccounted=unaccounted,
                      seen=f.get("processes_in_use"))
    # MindSpore
    if report.allocator == "ascend-two-pointer":
        capacity, used = f.get("capacity"), f.get("ms_used")
        static = f.get("static")
        dynamic = f.get("dynamic_graph") or f.get("dynamic_total")
        unaccounted = _diff(capacity, used)
        held = _beyond_share(unaccounted, "mindspore")
        if used is not None and static is None and f.get("used_peak") is not None:
            # kernel by kernel: nothing in use beyond the used peak, so at least MindSpore's share minus that
            # peak was free (in the pool's blocks or not yet reserved): a lower bound
            free_lower = _diff(used, f["used_peak"])
            free_lower = Figure(free_lower.low, free_lower.low, free_lower.low, free_lower.printed)
            if report.request is not None and report.request.high <= free_lower.low:
                return _Terms(free_lower, _exact(0), held, capacity, unaccounted=unaccounted)
        if used is None or static is None or dynamic is None:
            return _Terms(None, None, held, capacity, "the pool's free memory at the failure (static and dynamic sizes)",
                          "GLOG_v=1 (the pool's state at the failure) or MS_ALLOC_CONF=\"memory_tracker:True\"",
                          unaccounted=unaccounted)
        gap = _diff(_diff(used, static), dynamic)     # one contiguous piece between the two pointers
        return _Terms(gap, _exact(0), held, capacity, unaccounted=unaccounted)
    if "ms_total" in f:                                # the VMM / eager-free path: every unused byte is one pool
        in_use = _sum(f.get("pool_in_use"), f.get("pool_used_by_event") or _exact(0))
        return _Terms(_diff(f["ms_total"], in_use), _exact(0))
    idle = f.get("pool_idle")
    device_free = f.get("device_free")
    if device_free is None and "device_granted" in f:
        device_free = _exact(0)                        # the device refused the pool's new block
    missing = None
    setting = None
    if idle is None:
        missing, setting = "the pool's idle memory at the failure", \
            "GLOG_v=1 (MindSpore logs the pool's state at a failed allocation at INFO level)"
    elif device_free is None:
        missing, setting = "the device memory the pool could still take", "GLOG_v=2 (the default; keep WARNING lines)"
    return _Terms(idle, device_free, None, None, missing, setting)


def _kind(request: int, free_total: int | None, device_free: int | None, held: int | None) -> str:
    return oom_kind(request, free_total or 0, device_free, held)


def crash_verdict(report: OOMReport, layout: Layout | None = None) -> CrashVerdict:
    """The verdict on one report (see the module's doc); ``layout``: the pool at the failure, when a
    debug dump was read, for the largest hole.

    Example:
        >>> from ms_memopt.io.oom_logs import parse_message
        >>> r = parse_message("NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.97 GiB total capacity; "
        ...                   "56.44 GiB already allocated; 56.44 GiB current active; 1.35 GiB free; 58.92 GiB "
        ...                   "reserved in total by PyTorch)")
        >>> crash_verdict(r).kind
        'fragmentation'
    """
    request = report.request
    terms = _terms(report)
    free_total, device_free, held, capacity = terms.free_total, terms.device_free, terms.held, terms.capacity
    missing, setting = terms.missing, terms.setting
    out = CrashVerdict(kind="undecidable", request=None if request is None else request.value,
                       free_total=None if free_total is None else free_total.value,
                       device_free=None if device_free is None else device_free.value,
                       held_elsewhere=None if held is None else held.value,
                       capacity=None if capacity is None else capacity.value,
                       unaccounted=None if terms.unaccounted is None else terms.unaccounted.value,
                       held_by_others=None if terms.seen is None else terms.seen.value)
    if report.blocks_idle:
        out.largest_free_bound = max(report.blocks_idle)
    if layout is not None:
        out.largest_free = measure(layout).largest_free
    report.contradictions = contradictions(report)
    if report.contradictions:
        # figures that cannot all be true: no verdict is computed from them
        out.sure = False
        out.missing = "figures that agree with each other (" + "; ".join(report.contradictions) + ")"
        out.setting = "nothing to set: read the figures from the allocator itself (torch.cuda.memory_stats(), " \
                      "torch_npu.npu.memory_stats(), MindSpore's GLOG_v=1 pool state) at the failure"
        out.caveat = "the printed figures contradict each other: the verdict is uncertain"
        out.text = _text(out, report)
        return out
    if request is None:
        out.missing = "the request's size and the allocator's figures"
        out.setting = ("nothing to set: the caching allocator prints them with its own OOM; this one came from the "
                       "driver or a library, or was cut (keep the message whole)"
                       if report.framework != "mindspore" else
                       "GLOG_v=2 or lower keeps the pool's WARNING line with the size; GLOG_v=1 adds its state")
        out.text = _text(out, report)
        return out
    if free_total is None and device_free is not None and request.high <= device_free.low:
        out.kind = "fragmentation"       # the device's free memory alone covered it: whatever the pool held
        out.text = _text(out, report)
        return out
    if free_total is None or (device_free is None and held is None and free_total.high < request.low):
        # the rule needs the pool's free memory; without it only "capacity" or "outside" of the card can be said
        if capacity is not None and request.low > capacity.high:
            out.kind = "capacity"
            out.text = _text(out, report)
            return out
        if held is not None and capacity is not None and request.low > capacity.high - held.low:
            out.kind = "outside"     # larger than MindSpore's share, smaller than the card
            out.text = _text(out, report)
            return out
        out.missing, out.setting = missing, setting
        out.text = _text(out, report)
        return out
    if device_free is None:
        if request.high <= free_total.low:
            out.kind = "fragmentation"       # the pool alone held enough
        else:
            out.missing, out.setting = missing, setting
        out.text = _text(out, report)
        return out
    out.kind = _kind(request.value, free_total.value, device_free.value, None if held is None else held.value)
    worst = _kind(request.high, free_total.low, device_free.low, None if held is None else held.low)
    best = _kind(request.low, free_total.high, device_free.high, None if held is None else held.high)
    if worst != best:
        out.sure = False
        figures = (request, free_total, device_free)
        printed = ", ".join(f.printed for f in figures if not f.exact)
        spread = max(f.high - f.low for f in figures)
        out.caveat = (f"the printed rounding ({printed}) could make it {worst if worst != out.kind else best}: "
                      f"the exact bytes differ by at most {format_size(spread)} per figure")
    if report.allocator == "ascend-two-pointer" and out.kind == "fragmentation" and "static" in report.figures:
        out.sure = False
        out.caveat = ("the two-pointer pool's free memory is one piece: a request it covered cannot fail; "
                      "the figures are rounded down to MiB (or the failure was of the other pointer)")
    if out.kind == "fragmentation" and out.largest_free is not None and out.largest_free >= request.low:
        # the pool's own map shows a hole the request fits: its placement did not fail it
        out.kind, out.sure = "undecidable", False
        out.missing = (f"why the pool's largest hole ({_gib(out.largest_free)}) did not serve the request (another "
                       "stream's or pool's memory, a limit, or the request rounded up past it)")
        out.setting = "MS_ALLOC_CONF=\"memory_tracker:True\" records every block with its stream and pool"
    if out.kind == "outside" and not (terms.seen is not None and terms.seen.low > RUNTIME_SHARE[report.framework].margin
                                      if report.framework in RUNTIME_SHARE else False) and "allowed" not in report.figures:
        # beyond the runtime's usual share, but nothing printed says who holds it
        out.sure = False
        runtime = RUNTIME_SHARE[report.framework]
        out.caveat = ((out.caveat + "; ") if out.caveat else "") + (
            f"likely, not certain: {_gib(out.unaccounted)} of the card was held neither by the pool nor free, "
            f"{_gib(out.held_elsewhere)} beyond the {_gib(runtime.share)} {runtime.takes} usually takes; "
            f"`{runtime.check}` at the failure shows whether another process held it")
    out.text = _text(out, report)
    return out


def _gib(nbytes: int | None) -> str:
    return format_size(nbytes, digits=1) if nbytes is not None else "?"


def _pool_of(report: OOMReport, request: int) -> str:
    """The pool a PyTorch-family caching allocator serves ``request`` bytes from (``get_pool``:
    up to kSmallSize, 1 MiB, the small pool of 2 MiB segments; above, the large pool); the
    printed free memory is both pools' together."""
    if report.framework not in ("pytorch", "torch_npu") or report.allocator == "mps":
        return ""
    return " from the small pool (requests of 1 MiB or less)" if request <= 1 << 20 else " from the large pool"


def _text(v: CrashVerdict, report: OOMReport) -> str:
    """The field report's words: "needed 4.2 GiB in one piece; 14.0 GiB were free, the largest piece 3.0 GiB"."""
    parts = [f"needed {_gib(v.request)} in one piece{_pool_of(report, v.request)}" if v.request is not None
             else "the size asked was not printed"]
    free = None if v.free_total is None else v.free_total + (v.device_free or 0)
    if free is not None:
        where = f" ({_gib(v.free_total)} in the pool" + (f", {_gib(v.device_free)} more on the device)"
                                                         if v.device_free else ")")
        parts.append(f"{_gib(free)} were free{where}")
    if v.largest_free is not None:
        parts[-1] += f", the largest piece {_gib(v.largest_free)}"
    elif v.largest_free_bound is not None and (free is None or v.largest_free_bound < (v.free_total or 0)):
        parts[-1] += f", the largest piece at most {_gib(v.largest_free_bound)}"
    if v.held_elsewhere:
        parts.append(f"{_gib(v.held_elsewhere)} of the card held elsewhere beyond the runtime's own")
    elif v.unaccounted and v.unaccounted >= _UNACCOUNTED_SHOWN and report.framework in RUNTIME_SHARE:
        runtime = RUNTIME_SHARE[report.framework]
        parts.append(f"{_gib(v.unaccounted)} of the card held neither by the pool nor free, within what "
                     f"{runtime.takes} can take ({_gib(runtime.share + runtime.margin)} at most counted as its own; "
                     f"`{runtime.check}` tells)")
    head = "; ".join(parts)
    word = {"fragmentation": "FRAGMENTATION: the free memory covered the request, not in one piece",
            "capacity": "CAPACITY: all free memory together did not cover the request",
            "outside": "OUTSIDE THE ALLOCATOR: the card had the memory, something else held it or a limit refused it",
            "undecidable": f"UNDECIDABLE: the message lacks {v.missing}; next time: {v.setting}"}[v.kind]
    tail = f" ({v.caveat})" if v.caveat else ""
    return f"{head}: {word}{tail}"


# --- what to do -------------------------------------------------------------------------------------
def crash_remedies(report: OOMReport, verdict: CrashVerdict) -> list[CrashRemedy]:
    """The remedy lines for the report's framework and verdict, filled with its figures, best first."""
    request = verdict.request or 0
    split = 64                         # max_split_size_mb: the largest of 64..512 MiB below half the request
    while split < 512 and split * 4 <= (request >> 20):
        split *= 2
    capacity = verdict.capacity
    f = report.figures
    peak = f.get("reserved") or f.get("actual_peak") or f.get("ms_used")
    fill = {"split_mb": split,
            "capacity": "SIZE" if capacity is None else format_size(capacity).replace(" ", ""),
            "capacity_gb": "SIZE" if capacity is None else f"{max(1, capacity // 2**30 - 2)}GB",
            "peak": "SIZE" if peak is None else f"{max(1, -(-peak.high // 2**30))}GB",
            "grow": f"{max(1, -(-request // 2**30))}GB"}
    out = []
    for setting, line, why in remedy_lines(report.framework, verdict.kind):
        if setting == "enable_vmm:True" and (report.vmm or report.allocator in ("dynamic-pool-vmm", "cpu-pool")):
            continue               # already on, or a CPU pool (VMM is Ascend's)
        out.append(CrashRemedy(setting, line.format(**fill), why))
    return out


def plan_for(recipe: str | os.PathLike) -> dict:
    """What ``ms-memopt plan RECIPE`` says the card needs (:func:`~ms_memopt.analysis.estimate.estimate`),
    for a capacity verdict: ``needs`` (bytes at the worst pipeline stage), ``capacity``, ``fits``,
    ``headroom`` (negative: short by), ``checkpoint_every`` and one sentence, ``text``.

    Raises:
        InputError: the recipe cannot be read.
    """
    from ms_memopt.analysis.estimate import estimate
    from ms_memopt.config.recipe import load_recipe

    plan = estimate(load_recipe(recipe)).to_dict()
    needs, capacity, headroom = plan["total"], plan["capacity"], plan["headroom"]
    verdict = (f"fits with {format_size(headroom)} to spare" if plan["fits"]
               else f"does not fit: short by {format_size(-headroom)}")
    text = (f"ms-memopt plan {Path(recipe).name}: the card needs {format_size(needs)} at its worst stage "
            f"({plan['worst_stage']}) of the {format_size(capacity)} it holds: {verdict}")
    if plan.get("checkpoint_every"):
        text += f"; recompute every {plan['checkpoint_every']} layers"
    return {"recipe": str(recipe), "needs": needs, "capacity": capacity, "fits": plan["fits"], "headroom": headroom,
            "checkpoint_every": plan.get("checkpoint_every"), "worst_stage": plan["worst_stage"], "text": text}


def record_command(report: OOMReport, verdict: CrashVerdict) -> str:
    """The exact way to record the run for a full diagnosis (replay, blockers, measured remedies)."""
    capacity = "SIZE" if verdict.capacity is None else format_size(verdict.capacity).replace(" ", "")
    return RECORD.get(family_of(report.framework), RECORD["mindspore"]).format(capacity=capacity)


# --- the layout at the failure --------------------------------------------------------------------------
def _layout_beside(path: Path) -> Path | None:
    """A ``MemoryDebugInfo<N>.txt`` in the log's folder (the pool's dump at the failure), the newest."""
    folder = path.parent if path.is_file() else path
    try:
        found = [p for p in folder.iterdir() if _DEBUG_DUMP.search(p.name)]
    except OSError:
        return None
    return max(found, key=lambda p: (p.stat().st_mtime, p.name)) if found else None


def layout_blockers(layout: Layout, request: int) -> list[dict]:
    """The live blocks whose moving opens a hole of ``request`` bytes in one pool block, cheapest first
    (the compaction planner's window); ``[]`` when no block's holes add up to the request."""
    best = cheapest_opening(layout, aligned(request))
    if best is None:
        return []
    return [{"addr": b.addr, "size": b.size, "tag": b.tag, "segment": best[2].addr, "pool": best[2].pool}
            for b in sorted(best[1], key=lambda b: -b.size)]


# --- one log ---------------------------------------------------------------------------------------------
def _diagnosis(scan: LogScan, layout_path: Path | None) -> LogDiagnosis:
    layout = None
    if layout_path is not None and scan.reports:
        from ms_memopt.io.traces.ms_debug_dump import read_pool_debug_dump

        try:
            layout = read_pool_debug_dump(layout_path)
        except InputError:
            layout, layout_path = None, None
    verdicts = [crash_verdict(r, layout if i == 0 else None) for i, r in enumerate(scan.reports)]
    out = LogDiagnosis(source=scan.source, rank=scan.rank, reports=scan.reports, verdicts=verdicts,
                       layout_file=None if layout is None else str(layout_path), layout=layout,
                       first_error=scan.first_error, first_error_time=scan.first_error_time,
                       last_step=scan.last_step, bytes_read=scan.bytes_read)
    if scan.reports:
        first, verdict = scan.reports[0], verdicts[0]
        out.remedies = crash_remedies(first, verdict)
        out.record = record_command(first, verdict)
        if layout is not None and verdict.request and verdict.kind in ("fragmentation", "undecidable"):
            out.blockers = layout_blockers(layout, verdict.request)
    return out


def diagnose_log(path: str | os.PathLike, *, layout: str | os.PathLike | None = None) -> LogDiagnosis:
    """Every OOM report in one text log with its verdict; the first report's remedies and the command
    that records the run next time. ``layout``: a ``MemoryDebugInfo<N>.txt`` (default: one in the log's
    folder, if any).

    Raises:
        InputError: the log cannot be read.
    """
    scan = read_oom_log(path)
    dump = Path(layout) if layout is not None else _layout_beside(Path(path))
    return _diagnosis(scan, dump)


# --- a job's folder ------------------------------------------------------------------------------------------
@dataclass
class JobDiagnosis:
    """A whole job's logs: the first failure (``first``: the rank(s) whose OOM came first), the ranks
    that failed after it without an OOM of their own (``followers``), counts per verdict over all
    ranks with an OOM, and each rank's :class:`LogDiagnosis`."""

    folder: str
    ranks: dict[int | str, LogDiagnosis]
    first: list[int | str]
    followers: list[int | str]
    silent: list[int | str]
    counts: dict[str, int]
    text: str
    bytes_read: int

    @property
    def first_diagnosis(self) -> LogDiagnosis | None:
        return self.ranks[self.first[0]] if self.first else None

    def to_dict(self) -> dict:
        first = self.first_diagnosis
        job = None
        if first is not None and first.reports:
            job = {"rank": self.first[0], "step": first.reports[0].step, "time": first.reports[0].time,
                   "verdict": first.verdict.to_dict(), "log": first.source, "text": self.text}
        return {"folder": self.folder, "job": job, "first_ranks": self.first, "followers": len(self.followers),
                "follower_ranks": self.followers[:64], "ranks_without_error": len(self.silent),
                "counts": self.counts, "ranks": len(self.ranks), "bytes_read": self.bytes_read,
                "verdict": None if first is None else first.verdict.to_dict(),
                "reports": [dict(r.to_dict(), verdict=v.to_dict(), rank=k)
                            for k, d in self.ranks.items() for r, v in zip(d.reports, d.verdicts)][:256],
                "remedies": [] if first is None else [r.to_dict() for r in first.remedies],
                "record": "" if first is None else first.record}


def find_rank_logs(folder: str | os.PathLike) -> dict[int | str, list[str]]:
    """The text logs of a job's folder grouped by rank (msrun's ``worker_N.log``, ``rank_N/``,
    MindFormers' ``output/log/rank_N/``); logs naming no rank keep their path as key
    (``scheduler.log``). Debug dumps are left out (read beside their rank's log).

    Raises:
        InputError: not a folder, or no log in it.
    """
    root = Path(folder)
    if not root.is_dir():
        raise InputError("not a folder; expected a job's log folder", source=str(folder))
    groups: dict[int | str, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if _DEBUG_DUMP.search(name) or not _LOG_NAME.search(name):
                continue
            path = os.path.join(dirpath, name)
            rank = rank_of_path(os.path.relpath(path, root))
            groups.setdefault(rank if rank is not None else os.path.relpath(path, root), []).append(path)
    if not groups:
        raise InputError("no log files (*.log, *.txt, *.out, *.err, .gz too) in this folder; expected msrun's "
                         "worker_N.log, rank_N/ folders or MindFormers' output/log/", source=str(folder))
    return groups


def _rank_dumps(groups: dict[int | str, list[str]], root: Path) -> dict[int | str, str | None]:
    """The pool debug dump of each rank: a ``MemoryDebugInfo<N>.txt`` in a folder that holds that
    rank's logs only (``rank_N/``); a dump in a folder shared by many ranks belongs to none."""
    owners: dict[str, set] = {}
    for key, paths in groups.items():
        for path in paths:
            owners.setdefault(os.path.dirname(path), set()).add(key)
    dumps: dict[str, str] = {}
    for dirpath, _, filenames in os.walk(root):
        found = sorted(n for n in filenames if _DEBUG_DUMP.search(n))
        if found and len(owners.get(dirpath, ())) == 1:
            dumps[dirpath] = os.path.join(dirpath, found[-1])
    return {key: next((dumps[os.path.dirname(p)] for p in paths if os.path.dirname(p) in dumps), None)
            for key, paths in groups.items()}


def scan_rank(task: tuple) -> LogDiagnosis:
    """One rank's logs (a worker task of :func:`diagnose_logdir`: ``(rank, paths, dump or None)``):
    reports merged in file order, the same message in two files (MindFormers' info.log and error.log)
    counted once."""
    rank, paths = task[0], task[1]
    dump = task[2] if len(task) > 2 else None
    merged: LogScan | None = None
    seen: set[tuple] = set()
    for path in paths:
        scan = read_oom_log(path, rank=rank if isinstance(rank, int) else None)
        if merged is None:
            merged = LogScan(source=path, rank=scan.rank)
        merged.bytes_read += scan.bytes_read
        for report in scan.reports:
            key = (report.framework, None if report.request is None else report.request.value, report.time)
            if key not in seen:
                seen.add(key)
                merged.reports.append(report)
        if merged.first_error is None and scan.first_error is not None:
            merged.first_error, merged.first_error_time = scan.first_error, scan.first_error_time
            merged.first_error_line = scan.first_error_line
        if scan.last_step is not None:
            merged.last_step = max(merged.last_step or 0, scan.last_step)
    if merged.reports:
        merged.source = merged.reports[0].source or merged.source
    return _diagnosis(merged, None if dump is None else Path(dump))


def scan_ranks(tasks: list[tuple]) -> list[LogDiagnosis]:
    """:func:`scan_rank` on a batch of ranks, in order (one worker task)."""
    return [scan_rank(task) for task in tasks]


def _seconds(stamp: str | None) -> float | None:
    if not stamp:
        return None
    m = re.match(r"(\d{4})-(\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{3})", stamp)
    if not m:
        return None
    import calendar

    y, mo, d, h, mi, s, ms = (int(x) for x in m.groups())
    return calendar.timegm((y, mo, d, h, mi, s)) + ms / 1000


def diagnose_logdir(folder: str | os.PathLike, *, executor: str = "local", address: str | None = None,
                    workers: int | None = None, processes: bool = True) -> JobDiagnosis:
    """A whole job's log folder: every rank read in parallel on ``executor`` (``"local"`` processes,
    ``"dask"``, ``"ray"``: :func:`~ms_memopt.simulation.executors.run_tasks`), memory bounded by the
    workers (each streams its rank's logs and returns only the reports). ``processes=False`` runs
    Dask's local cluster on threads (tests).

    The first failure: the rank(s) whose earliest OOM report has the earliest time (within
    :data:`FIRST_WINDOW_SECONDS`); without times, the lowest step, then the lowest rank. Ranks with
    an error but no OOM (HCCL timeouts, the exceptions that follow a peer's death) are followers.

    Raises:
        InputError: not a folder, no logs in it, or an unknown executor.
    """
    from ms_memopt.simulation.executors import default_workers, run_tasks

    groups = find_rank_logs(folder)
    dumps = _rank_dumps(groups, Path(folder))
    tasks = sorted(((key, paths, dumps[key]) for key, paths in groups.items()),
                   key=lambda t: (isinstance(t[0], str), t[0] if isinstance(t[0], int) else 0, str(t[0])))
    # ranks in batches: one task per rank would pay a round trip to a worker per 2 MB log
    size = max(1, min(64, len(tasks) // (max(1, workers or default_workers()) * 8)))
    batches = [tasks[i:i + size] for i in range(0, len(tasks), size)]
    results = [d for batch in run_tasks(scan_ranks, batches, executor=executor, address=address, workers=workers,
                                        processes=processes) for d in batch]
    ranks = {task[0]: diag for task, diag in zip(tasks, results)}
    with_oom = [k for k, d in ranks.items() if d.reports]
    counts: dict[str, int] = {}
    for k in with_oom:
        kind = ranks[k].verdict.kind
        counts[kind] = counts.get(kind, 0) + 1

    def order(k):
        r = ranks[k].reports[0]
        t = _seconds(r.time)
        return (t is None, t or 0.0, r.step if r.step is not None else 1 << 62, k if isinstance(k, int) else 1 << 62)

    first: list = []
    if with_oom:
        ordered = sorted(with_oom, key=order)
        t0 = _seconds(ranks[ordered[0]].reports[0].time)
        first = [k for k in ordered if k == ordered[0] or (
            t0 is not None and (_seconds(ranks[k].reports[0].time) or 1e30) - t0 <= FIRST_WINDOW_SECONDS)]
    followers = [k for k, d in ranks.items() if not d.reports and d.first_error is not None]
    silent = [k for k, d in ranks.items() if not d.reports and d.first_error is None]
    text = _job_text(ranks, first, followers, with_oom, counts)
    return JobDiagnosis(folder=str(folder), ranks=ranks, first=first, followers=followers, silent=silent,
                        counts=counts, text=text, bytes_read=sum(d.bytes_read for d in ranks.values()))


def _job_text(ranks, first, followers, with_oom, counts) -> str:
    if not first:
        return (f"no OOM report in {len(ranks)} rank log(s); {len(followers)} rank(s) failed with another error"
                if followers else f"no OOM report and no error in {len(ranks)} rank log(s)")
    k = first[0]
    d = ranks[k]
    r, v = d.reports[0], d.verdict
    who = f"rank {k}" if isinstance(k, int) else str(k)
    at = f" at step {r.step}" if r.step is not None else ""
    line = f"{who} died{at}: {v.text}"
    if len(first) > 1:
        line += f"; at the same moment: rank(s) {', '.join(str(x) for x in first[1:8])}" + (" ..." if len(first) > 8 else "")
    later = len(with_oom) - len(first)
    extra = []
    if later:
        extra.append(f"{later} more rank(s) ran out of memory later")
    if followers:
        extra.append(f"{len(followers)} rank(s) failed after it without an OOM of their own (HCCL timeouts, exceptions)")
    if extra:
        line += ". " + "; ".join(extra)
    return line


def format_counts(counts: dict[str, int]) -> str:
    """``fragmentation 3, capacity 1`` in a fixed order."""
    order = ("fragmentation", "capacity", "outside", "undecidable")
    return ", ".join(f"{k} {counts[k]}" for k in order if counts.get(k)) or "none"

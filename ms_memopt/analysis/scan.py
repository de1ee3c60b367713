"""Layout scans: the record, the restart-safe JSONL log, watched requests, warnings, sources.

Framework-free: a :class:`Source` measures a memory pool (a live device pool, a shadow
allocator model, an ms-memopt arena); a :class:`Scanner` asks it every ``every`` steps, checks
the watched requests, raises warnings and appends one :class:`ScanRecord` per scan to a
:class:`ScanLog`. The MindSpore side (``ms_memopt.mindspore.scan_callback``) only adds the
``Model.train`` callback and the sources that need MindSpore.

The log is JSON lines, one object per line, written with a single ``write`` and flushed, so a
process killed at any moment leaves every complete line parseable. Reopening a log drops a
torn last line and continues after the last complete step: a restarted run neither loses nor
duplicates records. Lines have ``"kind": "scan"`` (a scan) or ``"kind": "source_error"`` (a
source failed and is skipped from then on).

Example:
    >>> import tempfile, os
    >>> from ms_memopt.core.layout import Block, Layout, Segment
    >>> seg = Segment(0, 4096, [Block(0, 1024, True), Block(1024, 3072, False)])
    >>> src = LayoutSource("demo", lambda: Layout([seg]))
    >>> path = os.path.join(tempfile.mkdtemp(), "scan.jsonl")
    >>> scanner = Scanner([src], log=ScanLog(path), every=1, watch={"bucket": "2KiB"})
    >>> rec = scanner.step(1)
    >>> (rec.largest_free, rec.frag_ratio, rec.watch["bucket"]["fits"])
    (3072, 0.0, True)
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping

from ms_memopt.analysis.forecast import Forecast, Forecaster
from ms_memopt.core.errors import InputError
from ms_memopt.core.jsontext import parse_json, read_json_lines
from ms_memopt.core.layout import Layout
from ms_memopt.core.metrics import LayoutMetrics, frag_ratio, hole_histogram, measure
from ms_memopt.core.units import format_size, parse_size

__all__ = ["write_record_line", "ScanRecord", "Reading", "Source", "LayoutSource", "ScanLog", "Scanner",
           "parse_watch", "check_watch", "read_scan_log", "forecast_fields", "SCAN_LOG_NAME"]

#: set by ``ms-memopt record``: each scanned run's step ends are printed for the recording
_RECORDING = bool(os.environ.get("MS_MEMOPT_RECORD"))
RECORD_STEP = "ms-memopt step"     # what ms-memopt record turns into a step event
RECORD_MARK = "ms-memopt mark"     # ... and into a mark event


def recording() -> bool:
    """True under ``ms-memopt record``."""
    return _RECORDING


def record_mark(tag: str) -> None:
    """Under ``ms-memopt record``, put a ``mark`` event (``tag``) into the recording here, e.g.
    around a compaction; does nothing otherwise."""
    if _RECORDING:
        write_record_line(f"{RECORD_MARK} {tag}")


def write_record_line(text: str) -> None:
    """``text`` and its newline in one write(2) to stderr. ``print`` issues two writes, and the
    pool's C++ log lines (other threads, same fd) landed between them: the marker was glued to
    the front of a pool line. One write of under PIPE_BUF bytes is never split on a pipe."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (text + "\n").encode())

logger = logging.getLogger("ms_memopt.analysis.scan")

SCAN_LOG_NAME = "scan.jsonl"


@dataclass
class Reading:
    """What a source measured; sizes in bytes, ``None`` when the source cannot know.

    ``largest_free`` may exceed ``free_total`` only for virtual pools (see docs/allocators.md).
    ``extra`` carries source-specific figures (``eager_free``, ``peak_allocated`` ...).
    """

    reserved: int
    allocated: int
    free_total: int
    largest_free: int | None
    device_free: int | None = None
    hole_histogram: dict[str, int] | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_metrics(cls, m: LayoutMetrics, **extra) -> "Reading":
        return cls(reserved=m.reserved, allocated=m.allocated, free_total=m.free_total,
                   largest_free=m.largest_free, device_free=m.device_free,
                   hole_histogram=dict(m.hole_histogram), extra=dict(extra))

    @classmethod
    def from_layout(cls, layout: Layout, **extra) -> "Reading":
        return cls.from_metrics(measure(layout), **extra)


@dataclass
class ScanRecord:
    """One scan, as one JSON line of the scan log (docs/scans.md lists the fields)."""

    step: int
    rank: int
    time: float
    source: str
    reserved: int
    allocated: int
    free_total: int
    largest_free: int | None
    frag_ratio: float | None
    device_free: int | None
    hole_histogram: dict[str, int] | None
    watch: dict[str, dict] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    kind: str = "scan"

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def predicted_oom(self) -> bool:
        """True when some watched request would not fit."""
        return any(not w["fits"] for w in self.watch.values())

    @property
    def forecast_step(self) -> int | None:
        """The soonest step at which the forecast sees a watched request stop fitting in one
        piece (``None`` without such a forecast)."""
        steps = [w["forecast"]["step"] for w in self.watch.values()
                 if (w.get("forecast") or {}).get("step") is not None]
        return min(steps, default=None)


def parse_watch(watch: Mapping[str, object] | None) -> dict[str, int]:
    """Watched requests ``{"allreduce": "4.2GB"}`` -> ``{"allreduce": 4200000000}``.

    Raises:
        InputError: a size that does not parse or is zero (names the key ``watch.NAME``).
    """
    if watch is None:
        return {}
    if not isinstance(watch, Mapping):
        raise InputError(f"expected a mapping of name to size, got {type(watch).__name__}", key="watch")
    out = {}
    for name, size in watch.items():
        nbytes = parse_size(size, key=f"watch.{name}")
        if nbytes <= 0:
            raise InputError(f"a watched request must be > 0 bytes, got {size!r}", key=f"watch.{name}")
        out[str(name)] = nbytes
    return out


def check_watch(reading: Reading, watch: Mapping[str, int]) -> dict[str, dict]:
    """Whether each watched request fits now.

    A request fits ``in_hole`` when ``size <= largest_free``; it ``fits`` when it fits in a hole
    or the pool could grow a new block for it (``size <= device_free``). Unknown
    ``largest_free`` counts as not fitting in a hole.

    Example:
        >>> r = Reading(reserved=10, allocated=4, free_total=6, largest_free=3, device_free=0)
        >>> check_watch(r, {"a": 3, "b": 5})["b"]
        {'size': 5, 'fits': False, 'in_hole': False}
    """
    out = {}
    for name, size in watch.items():
        in_hole = reading.largest_free is not None and size <= reading.largest_free
        grows = reading.device_free is not None and size <= reading.device_free
        out[name] = {"size": size, "fits": bool(in_hole or grows), "in_hole": bool(in_hole)}
    return out


class Source(ABC):
    """Where a scan's numbers come from. ``name`` goes into each record's ``source``."""

    name: str = "source"

    @abstractmethod
    def read(self) -> Reading:
        """Measure the pool now; may raise (the scanner logs it once and skips the source)."""

    def describe(self) -> str:
        """One line for the first record: what this source measures and how."""
        return self.name

    def layout(self) -> Layout | None:
        """The pool's current layout when this source knows it block by block, else ``None``."""
        return None

    def step_end(self, step: int) -> None:
        """Called after every training step (scanned or not); sources that watch steps use it."""

    def arm(self, active: bool) -> None:
        """Called after every step: ``True`` when the next step will be scanned, so a source
        that observes steps (hooks) need only watch those and cost nothing in between."""

    def close(self) -> None:
        """Release hooks or files the source holds."""


class LayoutSource(Source):
    """A source that reports an exact layout, e.g. an ms-memopt arena's ``layout()``."""

    def __init__(self, name: str, layout_fn: Callable[[], Layout], description: str | None = None) -> None:
        self.name = name
        self._layout_fn = layout_fn
        self._description = description or f"{name}: exact layout"

    def read(self) -> Reading:
        return Reading.from_layout(self._layout_fn())

    def layout(self) -> Layout:
        return self._layout_fn()

    def describe(self) -> str:
        return self._description


class ScanLog:
    """Append-only, flushed, restart-safe JSONL scan log.

    Opening an existing log truncates a torn last line (a crash mid-write) and remembers the
    last complete scan step; :meth:`write` then skips records at or before that step, so a
    run restarted from an earlier checkpoint does not duplicate records.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.last_step: int | None = None
        self.resumed = False
        self._repair()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _repair(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        cut = data.rfind(b"\n") + 1
        if cut < len(data):
            logger.warning("scan log %s: dropping a torn last line (%d bytes)", self.path, len(data) - cut)
            with open(self.path, "r+b") as handle:
                handle.truncate(cut)
        for line in data[:cut].splitlines():
            try:
                obj = parse_json(line)
            except InputError:
                continue
            if isinstance(obj, dict) and obj.get("kind", "scan") == "scan" and isinstance(obj.get("step"), int):
                self.last_step = obj["step"] if self.last_step is None else max(self.last_step, obj["step"])
        self.resumed = cut > 0

    def write(self, record: ScanRecord | dict) -> bool:
        """Append one record (one ``write`` call); False when skipped as already logged."""
        obj = record.to_dict() if isinstance(record, ScanRecord) else dict(record)
        step = obj.get("step")
        if obj.get("kind", "scan") == "scan":
            if self.last_step is not None and isinstance(step, int) and step <= self.last_step:
                return False
            self.last_step = step
        line = json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n"
        os.write(self._fd, line.encode("utf-8"))
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ScanLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_scan_log(path: str | Path, *, kinds: Iterable[str] = ("scan",)) -> list[dict]:
    """Read a scan log: every complete line; a torn last line (no newline) is ignored.

    Raises:
        InputError: a complete line that is not a JSON object (names file and line).
    """
    wanted = set(kinds)
    out = []
    for number, obj in read_json_lines(path):
        kind = obj.get("kind", "scan")
        if not isinstance(kind, str):
            raise InputError(f"'kind' must be a string, got {kind!r}", source=str(path), line=number)
        if kind in wanted:
            out.append(obj)
    return out


class Scanner:
    """Scan every ``every`` steps, write the log, warn; usable from any training loop.

    Args:
        sources: tried in order; a source that raises is logged once (and recorded as a
            ``source_error`` line) and skipped from then on, the next one takes over.
        log: where records go (``None``: keep them only in :attr:`records`).
        every: scan when ``step % every == 0`` (and at the first step seen).
        watch: watched requests, ``{"allreduce": "4.2GB"}``.
        frag_warn: warn when ``frag_ratio`` exceeds this.
        forecast_within: warn when the forecast (:mod:`ms_memopt.analysis.forecast`, from this scanner's
            samples: ``largest_free`` and, as long-lived memory, ``allocated`` at each scan) says
            a watched request may stop fitting in one piece within this many steps; ``None``:
            forecasts are recorded (``watch.NAME.forecast``) but never warn.
        rank: written into every record.
        source_reason: why the first source was picked (``source="auto"``), for the first record.
        pool: the job's pool, as a mapping with at least ``kind`` and ``vmm`` (the MindSpore
            adapter passes ``PoolInfo.to_dict()``); written into every record's
            ``extra["pool"]``. Under VMM (``vmm`` true) physical memory is mapped on demand, so
            a watched request fits when the memory that can still be mapped (``free_total +
            device_free``: idle and eager-freed pages count) covers it, whatever the holes;
            the record says so in ``extra["vmm"]``.

    Raises:
        InputError: ``every <= 0``, a bad watch size, a negative ``frag_warn`` or
            ``forecast_within``, no source.
    """

    def __init__(self, sources: list[Source], *, log: ScanLog | None = None, every: int = 100,
                 watch: Mapping[str, object] | None = None, frag_warn: float | None = 3.0,
                 rank: int = 0, source_reason: str | None = None, keep: int = 1000,
                 forecast_within: int | None = None, pool: Mapping | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise InputError(f"every must be a positive integer, got {every!r}", key="every")
        if frag_warn is not None and (isinstance(frag_warn, bool) or not isinstance(frag_warn, (int, float))
                                      or frag_warn < 0):
            raise InputError(f"frag_warn must be a number >= 0 or None, got {frag_warn!r}", key="frag_warn")
        check_forecast_within(forecast_within)
        if not sources:
            raise InputError("no memory source available", key="source")
        self.sources = list(sources)
        self.log = log
        self.every = every
        self.watch = parse_watch(watch)
        self.frag_warn = frag_warn
        self.forecast_within = forecast_within
        # one sample per scan: a window is one scan interval
        self.forecasters = {name: Forecaster(size, window=every) for name, size in self.watch.items()}
        self.rank = rank
        self.source_reason = source_reason
        self.pool = dict(pool) if pool is not None else None
        self.records: list[ScanRecord] = []
        self.failed: dict[str, str] = {}
        self.scan_seconds: list[float] = []
        self._keep = keep
        self._first = True
        self._last_scanned: int | None = None

    def forecast(self) -> Forecast | None:
        """The latest forecast of the watched request that stops fitting first (``None``
        without watched requests or a forecast)."""
        made = [f.forecast() for f in self.forecasters.values()]
        made = [f for f in made if f.step is not None]
        return min(made, key=lambda f: (f.earliest_step, f.step), default=None)

    def reset_forecast(self, step: int) -> None:
        """Forget the samples before ``step`` (a compaction there: the old trend is gone)."""
        for forecaster in self.forecasters.values():
            forecaster.reset(step)

    def due(self, step: int) -> bool:
        """Whether ``step`` is a scan step."""
        return step % self.every == 0 or self._last_scanned is None

    def step(self, step: int, *, force: bool = False) -> ScanRecord | None:
        """Call after each training step; scans when due. Returns the record, or ``None``.

        Never raises for a failing source: the failure is logged once and the source skipped.
        """
        if _RECORDING:   # under `ms-memopt record`: a step event in the recorded pool log
            write_record_line(f"{RECORD_STEP} {step}")
        try:
            if not force and not self.due(step):
                return None
            return self._scan(step)
        finally:
            next_due = (step + 1) % self.every == 0
            for source in self.sources:
                if source.name not in self.failed:
                    try:
                        source.step_end(step)
                        source.arm(next_due)
                    except Exception as exc:  # same rule as read(): log once, skip
                        self._fail(source, step, exc)

    def _fail(self, source: Source, step: int, exc: Exception) -> None:
        message = f"{type(exc).__name__}: {exc}"
        self.failed[source.name] = message
        logger.warning("memory scan source %r failed at step %d and is skipped from now on: %s",
                       source.name, step, message)
        if self.log is not None:
            self._safe_write({"kind": "source_error", "step": step, "rank": self.rank,
                              "time": time.time(), "source": source.name, "error": message})

    def _scan(self, step: int) -> ScanRecord | None:
        self._last_scanned = step
        started = time.perf_counter()
        reading = source = None
        for candidate in self.sources:
            if candidate.name in self.failed:
                continue
            try:
                reading = candidate.read()
                source = candidate
                break
            except Exception as exc:  # a broken source must never stop training
                self._fail(candidate, step, exc)
        if reading is None:
            return None
        record = self._record(step, source, reading)
        self.scan_seconds.append(time.perf_counter() - started)
        record.extra["scan_seconds"] = round(self.scan_seconds[-1], 6)
        if self.log is not None:
            self._safe_write(record)
        self.records.append(record)
        if len(self.records) > self._keep:
            del self.records[: len(self.records) - self._keep]
        return record

    def _record(self, step: int, source: Source, reading: Reading) -> ScanRecord:
        vmm = bool(self.pool and self.pool.get("vmm"))
        mappable = reading.free_total + (reading.device_free or 0)
        # under VMM any free page can be mapped behind a new range: what fits is what can be mapped
        watch = check_watch(replace(reading, largest_free=mappable) if vmm else reading, self.watch)
        ratio = None if reading.largest_free is None else frag_ratio(reading.free_total, reading.largest_free)
        histogram = reading.hole_histogram
        warnings = []
        for name, result in watch.items():
            forecaster = self.forecasters.get(name)
            if forecaster is not None:
                forecaster.add(step, reading.largest_free, long_lived=reading.allocated)
                fc = forecaster.forecast()
                result["forecast"] = forecast_fields(fc, self.forecast_within)
                # "below" is the predicted-OOM warning's (or was a moment ago); the forecast's own
                # warning is a trend or a spread that reaches the request within the horizon
                if self.forecast_within is not None and fc.status != "below" and fc.warns(self.forecast_within):
                    warnings.append(f"forecast: {fc.describe(name, within=self.forecast_within)}")
            if not result["fits"]:
                warnings.append(
                    f"predicted OOM: watched request {name!r} ({format_size(result['size'])}) would not fit: "
                    f"largest free block {_fmt(reading.largest_free)}, free total {format_size(reading.free_total)}, "
                    f"device free {_fmt(reading.device_free)}")
        if ratio is not None and self.frag_warn is not None and ratio > self.frag_warn and not vmm:
            warnings.append(f"frag_ratio {ratio:.2f} > frag_warn {self.frag_warn:g} "
                            f"(free {format_size(reading.free_total)}, largest block {_fmt(reading.largest_free)})")
        for text in warnings:
            logger.warning("rank %d step %d: %s", self.rank, step, text)
        extra = dict(reading.extra)
        if self.pool is not None:
            extra["pool"] = self.pool
        if vmm:
            extra["vmm"] = {"mappable": mappable,
                            "note": "VMM pool: holes in the layout do not decide OOMs; a request fits when the "
                                    "memory that can still be mapped covers it"}
        if self._first:
            extra["source_description"] = source.describe()
            if self.source_reason:
                extra["source_reason"] = self.source_reason
            self._first = False
        return ScanRecord(step=step, rank=self.rank, time=time.time(), source=source.name,
                          reserved=reading.reserved, allocated=reading.allocated,
                          free_total=reading.free_total, largest_free=reading.largest_free,
                          frag_ratio=ratio, device_free=reading.device_free,
                          hole_histogram=histogram if histogram is not None else None,
                          watch=watch, warnings=warnings, extra=extra)

    def _safe_write(self, record) -> None:
        try:
            self.log.write(record)
        except OSError as exc:
            logger.warning("cannot write the scan log %s: %s", self.log.path, exc)

    def close(self) -> None:
        for source in self.sources:
            try:
                source.close()
            except Exception:  # closing must not fail training either
                logger.debug("closing source %s failed", source.name, exc_info=True)
        if self.log is not None:
            self.log.close()


def check_forecast_within(value, key: str = "forecast_within") -> None:
    """``None`` or an integer number of steps >= 0, else :class:`InputError` naming ``key``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise InputError(f"{key} must be a number of steps >= 0 or None, got {value!r}", key=key)


def forecast_fields(fc: Forecast, within: int | None = None) -> dict:
    """A forecast as scan records and simulation timelines carry it (steps, bytes, confidence);
    with ``within`` (steps) also ``probability``, the chance that the request stops fitting in
    one piece within them (:meth:`~ms_memopt.analysis.forecast.Forecast.probability`), and ``within``."""
    out = {"status": fc.status, "step": fc.step, "earliest_step": fc.earliest_step,
           "latest_step": fc.latest_step, "steps_left": fc.steps_left,
           "confidence": round(fc.confidence, 4), "request": fc.request}
    if within is not None:
        out["within"], out["probability"] = within, round(fc.probability(within), 4)
    return out


def _fmt(size: int | None) -> str:
    return "unknown" if size is None else format_size(size)


def histogram_of(sizes: Iterable[int]) -> dict[str, int]:
    """:func:`ms_memopt.core.metrics.hole_histogram`, re-exported for sources without a layout."""
    return hole_histogram(sizes)

"""Layout scans inside MindSpore training: ``LayoutScanCallback`` for ``Model.train``, ``Scanner``
for custom loops.

Example (``Model.train``)::

    from ms_memopt.mindspore.scan_callback import LayoutScanCallback
    model.train(epochs, dataset, callbacks=[
        LayoutScanCallback(every=100, log_dir="memlog", watch={"allreduce": "4.2GB"})])

Example (custom loop with ``ms.value_and_grad``)::

    scanner = Scanner(net, optimizer, every=100, log_dir="memlog")
    for step, (x, y) in enumerate(data, start=1):
        loss, grads = grad_fn(x, y); optimizer(grads)
        record = scanner.step(step)          # None when not a scan step
    scanner.close()

Each scan appends one JSON line to ``LOG_DIR/rank_N/scan.jsonl`` (see docs/scans.md).
Configuration errors (``every <= 0``, a bad watch size, an unknown source) raise
:class:`~ms_memopt.core.errors.InputError` in the constructor, before the first step; a source
that fails during training is logged once and skipped, never stopping training.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from mindspore.train import Callback

from ms_memopt.analysis import scan as _scan
from ms_memopt.analysis.forecast import Forecast
from ms_memopt.analysis.scan import ScanLog, ScanRecord, Source, parse_watch
from ms_memopt.core.errors import InputError
from ms_memopt.mindspore.cells import training_parts
from ms_memopt.mindspore.pool_info import detect_pool
from ms_memopt.mindspore.sources import SOURCES, DeviceMemoryAPI, make_sources

__all__ = ["LayoutScanCallback", "Scanner", "detect_rank"]

logger = logging.getLogger("ms_memopt.analysis.scan")


def detect_rank() -> int:
    """This process's rank: MindSpore's ``get_rank()`` when communication is initialised,
    else ``RANK_ID`` (set by msrun), else 0."""
    try:
        from mindspore.communication import get_rank
        return int(get_rank())
    except Exception:  # communication not initialised: single process, or before init()
        pass
    for name in ("RANK_ID", "MS_NODE_ID", "RANK"):
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 0


def _validate_source(source) -> None:
    if isinstance(source, str) and source not in SOURCES:
        raise InputError(f"unknown source {source!r}; expected one of {', '.join(SOURCES)}", key="source")


class Scanner(_scan.Scanner):
    """Layout scans for any training loop; call :meth:`step` after each optimizer step.

    Args:
        network: the Cell being trained (needed by the shadow-model source).
        optimizer: its optimizer (optional; its extra parameters count as optimizer states).
        every: scan every this many steps (> 0).
        log_dir: logs go to ``log_dir/rank_N/scan.jsonl``; ``None`` keeps records in memory.
        source: ``"auto"``, ``"device"``, ``"model"``, ``"arena"`` or :class:`Source` objects.
        watch: requests to check, ``{"allreduce": "4.2GB"}``.
        frag_warn: warn when the frag ratio exceeds this.
        forecast_within: warn (log and record) when the forecast says a watched request may
            stop fitting in one piece within this many steps (see :class:`ms_memopt.analysis.scan.Scanner`).
        rank: defaults to :func:`detect_rank`.
        capacity: device memory for the shadow model, bytes or ``"64GB"``.
        arenas: objects with ``layout()`` (ms-memopt arenas, pool mode regions).
        device_api: the device calls (fake them in tests).
        model_options / device_options: passed to the shadow / device source.
    """

    def __init__(self, network=None, optimizer=None, *, every: int = 100, log_dir: str | Path | None = "memlog",
                 source: str | Source | Iterable[Source] = "auto", watch: Mapping[str, object] | None = None,
                 frag_warn: float | None = 3.0, rank: int | None = None, capacity: int | str | None = None,
                 arenas: Sequence = (), device_api: DeviceMemoryAPI | None = None,
                 model_options: dict | None = None, device_options: dict | None = None,
                 forecast_within: int | None = None) -> None:
        _validate_source(source)
        parse_watch(watch)
        if isinstance(capacity, str):
            capacity = _scan.parse_size(capacity, key="capacity")
        rank = detect_rank() if rank is None else rank
        sources, reason = make_sources(source, network=network, optimizer=optimizer, arenas=arenas,
                                       device_api=device_api, capacity=capacity,
                                       model_options=model_options, device_options=device_options)
        log = None
        if log_dir is not None:
            log = ScanLog(Path(log_dir) / f"rank_{rank}" / _scan.SCAN_LOG_NAME)
        super().__init__(sources, log=log, every=every, watch=watch, frag_warn=frag_warn, rank=rank,
                         source_reason=reason, forecast_within=forecast_within, pool=detect_pool().to_dict())


class LayoutScanCallback(Callback):
    """``Model.train`` callback: a layout scan every ``every`` steps (see :class:`Scanner`).

    With ``stop_on_predicted_oom=True`` a scan that finds a watched request that would not fit
    calls ``run_context.request_stop()`` and logs why. With ``forecast_within=N`` a scan whose
    forecast sees a watched request stop fitting in one piece within ``N`` steps logs a warning
    with the estimated step (also in the record's ``warnings``; every record carries the
    forecast in ``watch.NAME.forecast``). :meth:`forecast` gives the latest forecast to a
    :class:`~ms_memopt.mindspore.compaction.CompactionCallback` (``when_forecast_within``).
    """

    def __init__(self, every: int = 100, log_dir: str | Path | None = "memlog", source="auto",
                 watch: Mapping[str, object] | None = None, frag_warn: float | None = 3.0,
                 stop_on_predicted_oom: bool = False, *, rank: int | None = None,
                 capacity: int | str | None = None, arenas: Sequence = (),
                 device_api: DeviceMemoryAPI | None = None, model_options: dict | None = None,
                 device_options: dict | None = None, forecast_within: int | None = None) -> None:
        super().__init__()
        # validate everything now, before training starts
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise InputError(f"every must be a positive integer, got {every!r}", key="every")
        _validate_source(source)
        parse_watch(watch)
        if frag_warn is not None and (isinstance(frag_warn, bool) or not isinstance(frag_warn, (int, float))
                                      or frag_warn < 0):
            raise InputError(f"frag_warn must be a number >= 0 or None, got {frag_warn!r}", key="frag_warn")
        _scan.check_forecast_within(forecast_within)
        if isinstance(capacity, str):
            capacity = _scan.parse_size(capacity, key="capacity")
        self._options = dict(every=every, log_dir=log_dir, source=source, watch=watch, frag_warn=frag_warn,
                             rank=rank, capacity=capacity, arenas=arenas, device_api=device_api,
                             model_options=model_options, device_options=device_options,
                             forecast_within=forecast_within)
        self.stop_on_predicted_oom = stop_on_predicted_oom
        self.scanner: Scanner | None = None
        self.stop_message: str | None = None
        self._records: list[ScanRecord] = []

    @property
    def records(self) -> list[ScanRecord]:
        """The scans of the current (or last) ``train`` call."""
        return self._records

    def forecast(self) -> Forecast | None:
        """The latest forecast of the watched request that stops fitting first (``None`` before
        training, without watched requests or without a forecast yet)."""
        return self.scanner.forecast() if self.scanner is not None else None

    def reset_forecast(self, step: int) -> None:
        """Start the forecast afresh at ``step`` (called by ``CompactionCallback`` after compacting)."""
        if self.scanner is not None:
            self.scanner.reset_forecast(step)

    def on_train_begin(self, run_context) -> None:
        if self.scanner is not None:
            return
        parts = training_parts(run_context.original_args())   # MindFormers: optimizer inside the wrapper
        try:
            self.scanner = Scanner(parts.train_network, parts.optimizer, **self._options)
            self._records = self.scanner.records
        except InputError:
            raise
        except Exception as exc:  # scans are optional: training goes on without them
            logger.warning("layout scans disabled: %s: %s", type(exc).__name__, exc)

    def on_train_step_end(self, run_context) -> None:
        if self.scanner is None:
            return
        args = run_context.original_args()
        step = int(getattr(args, "cur_step_num", 0) or 0)
        try:
            record = self.scanner.step(step)
        except Exception as exc:  # never let a scan stop training
            logger.warning("layout scan at step %d failed: %s: %s", step, type(exc).__name__, exc)
            return
        if record is not None and self.stop_on_predicted_oom and record.predicted_oom:
            failing = [f"{name} ({w['size']} B)" for name, w in record.watch.items() if not w["fits"]]
            self.stop_message = (f"ms-memopt: stopping training at step {step}: predicted OOM, watched "
                                 f"request(s) {', '.join(failing)} would not fit (largest free block "
                                 f"{record.largest_free} B, free total {record.free_total} B, device free "
                                 f"{record.device_free} B); diagnose it with `ms-memopt doctor` on a recording of "
                                 "this run (`ms-memopt record`, or the pool.log of `ms-memopt run`)")
            logger.error(self.stop_message)
            run_context.request_stop()

    def on_train_end(self, run_context) -> None:
        if self.scanner is not None:
            self.scanner.close()
            self.scanner = None     # a later train() call opens the log again (appending)

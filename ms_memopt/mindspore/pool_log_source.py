"""Scan source: the real MindSpore pool of this process, from its own log.

The capture (:mod:`ms_memopt.mindspore.poolcapture`, started before ``import mindspore``: ``ms-memopt
run`` and ``make demo`` do it on CPU) gives the pool's blocks and live buffers as MindSpore
logged them; a scan synchronises MindSpore's launch pipeline first, so every op queued before
the scan has reached the pool.

Example:
    >>> from ms_memopt.mindspore import poolcapture
    >>> poolcapture.start("out/pool.log")        # before import mindspore     # doctest: +SKIP
    >>> LayoutScanCallback(every=10, source="pool-log")                          # doctest: +SKIP
"""
from __future__ import annotations

from ms_memopt.analysis.scan import Reading, Source
from ms_memopt.core.layout import Layout
from ms_memopt.mindspore import poolcapture
from ms_memopt.mindspore.poolcapture import PoolLogCapture

__all__ = ["PoolLogSource", "wait_for_queued_ops"]


def wait_for_queued_ops() -> None:
    """Let MindSpore's PyNative launch pipeline finish what it queued: those ops have not
    reached the pool (nor its log) yet. ``mindspore.runtime.synchronize()`` refuses CPU (it
    logs an error and returns), so this uses the PyNative executor's own ``sync``, the call
    MindSpore makes before it reads a tensor back."""
    try:
        from mindspore.graph.api import _pynative_executor
    except ImportError:      # other MindSpore releases keep it in mindspore.common.api
        from mindspore.common.api import _pynative_executor
    _pynative_executor.sync()


class PoolLogSource(Source):
    """Scans of the real pool, from this process's pool log (see the module docstring)."""

    name = "pool-log"

    def __init__(self, capture: PoolLogCapture | None = None) -> None:
        capture = capture or poolcapture.active()
        if capture is None:
            raise ValueError(f"the real pool's log is not available: {poolcapture.unavailable_reason()}")
        self.capture = capture

    def describe(self) -> str:
        return (f"pool-log: the real MindSpore pool ({self.capture.parser.pool}), followed live from its "
                f"VLOG_v={poolcapture.VLOG_LEVEL} log in {self.capture.path}")

    def layout(self) -> Layout:
        wait_for_queued_ops()
        self.capture.poll()
        return self.capture.parser.layout()

    def step_end(self, step: int) -> None:
        self.capture.poll()      # keep up, and pass MindSpore's other stderr lines on promptly

    def read(self) -> Reading:
        layout = self.layout()
        if not layout.segments:
            raise RuntimeError("the pool log shows no block yet")
        parser = self.capture.parser
        meta = parser.meta()
        return Reading.from_layout(layout, live_buffers=len(parser.live), pool_lines=meta["pool_lines"],
                                   skipped_lines=meta["skipped_lines"],
                                   peak_used=meta["counters"].get("peak_used"))

"""The real MindSpore pool of this very process, followed live from its log.

MindSpore's pool logs every call when ``VLOG_v=12906`` is set before ``import mindspore``
(:mod:`ms_memopt.io.traces.ms_pool_log`). :func:`start` turns that on for the current process and
sends the C++ side of stderr (file descriptor 2) to a file; Python's ``sys.stderr`` keeps going
to the terminal. :meth:`PoolLogCapture.poll` reads what was appended since the last call,
feeds the pool lines to a :class:`~ms_memopt.io.traces.ms_pool_log.PoolLogParser` (which keeps the
real pool's blocks and live buffers) and forwards every other line to the terminal, so
MindSpore's own warnings still show (at the next poll rather than at once).
:class:`ms_memopt.mindspore.pool_log_source.PoolLogSource` makes that a scan source: free
total, largest free block and fragmentation from the real buffers.

Why a file and not a pipe: MindSpore writes the line while holding its pool lock, possibly
while holding the GIL; a pipe whose reader is a Python thread could fill up and stall the
writer. A file never blocks. The file is also a complete pool log: ``ms-memopt replay`` reads it.

It cannot work when MindSpore is already imported (the VLOG level is read at import), or under
``ms-memopt record`` (which reads this process's stderr itself): :func:`start` then returns
``None`` and scans use the shadow model.

Example:
    >>> capture = start("out/pool.log")      # before import mindspore   # doctest: +SKIP
    >>> import mindspore                                                 # doctest: +SKIP
    >>> ...; capture.poll(); capture.parser.layout()                     # doctest: +SKIP
"""
from __future__ import annotations

import atexit
import io
import os
import sys
from pathlib import Path

from ms_memopt.io.traces.ms_pool_log import LOG_NAME, PoolLogParser

__all__ = ["PoolLogCapture", "start", "active", "unavailable_reason", "VLOG_LEVEL", "LOG_NAME"]

VLOG_LEVEL = "12906"      # VL_RUNTIME_FRAMEWORK_MEMORY
_NOISE = "[V12906]"       # the pool's other lines (merges, block usage): not forwarded
_active: "PoolLogCapture | None" = None
_why_not = "no capture started (ms_memopt.mindspore.poolcapture.start must run before import mindspore)"


class PoolLogCapture:
    """The C++ stderr of this process redirected to ``path`` and parsed on demand."""

    def __init__(self, path: Path, saved_fd: int, terminal, original_stderr) -> None:
        self.path = path
        self.parser = PoolLogParser(pid=os.getpid(), source=str(path))
        self.events = 0
        self._saved_fd = saved_fd
        self._terminal = terminal            # writes to the real stderr: where other lines go
        self._original_stderr = original_stderr
        self._handle = open(path, "rb")
        self._partial = b""
        self._closed = False

    def poll(self) -> int:
        """Parse what was logged since the last call; returns the number of new events."""
        if self._closed:
            return 0
        data = self._partial + self._handle.read()
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        new = 0
        forward = []
        for raw in data[:cut].splitlines():
            line = raw.decode("utf-8", errors="replace")
            events = self.parser.feed(line)
            if events:
                new += len(events)
            elif _NOISE not in line:
                forward.append(line)
        if forward:
            try:
                self._terminal.write("\n".join(forward) + "\n")
                self._terminal.flush()
            except (OSError, ValueError):     # the terminal went away: the lines stay in the file
                pass
        self.events += new
        return new

    def stop(self) -> None:
        """Read the rest, give file descriptor 2 back to the terminal, keep the log file."""
        global _active
        if self._closed:
            return
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        self.poll()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        if sys.stderr is self._terminal:
            sys.stderr = self._original_stderr
        try:
            self._terminal.close()
        except (OSError, ValueError):
            pass
        self._handle.close()
        self._closed = True
        if _active is self:
            _active = None


def start(path: str | Path) -> PoolLogCapture | None:
    """Turn on MindSpore's pool log for this process and follow it; ``None`` when it cannot be
    had (MindSpore already imported, ``ms-memopt record`` running, no file descriptor 2);
    :func:`unavailable_reason` says why. Idempotent: a second call returns the active capture.
    """
    global _active, _why_not
    if _active is not None:
        return _active
    if "mindspore" in sys.modules:
        _why_not = "MindSpore was imported before the pool log was switched on (VLOG_v is read at import)"
        return None
    if os.environ.get("MS_MEMOPT_RECORD"):
        _why_not = "ms-memopt record reads this process's pool log itself"
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError) as exc:
        _why_not = f"no stderr to redirect ({exc})"
        return None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    original = sys.stderr
    # Python's own stderr keeps writing to the terminal through the saved descriptor
    terminal = io.TextIOWrapper(io.FileIO(os.dup(saved), "w"), encoding="utf-8", errors="backslashreplace",
                                line_buffering=True)
    sys.stderr = terminal
    os.environ["VLOG_v"] = VLOG_LEVEL
    _active = PoolLogCapture(path, saved, terminal, original)
    atexit.register(_active.stop)
    return _active


def active() -> PoolLogCapture | None:
    """The capture of this process, if one was started."""
    return _active


def unavailable_reason() -> str:
    """Why there is no capture (for the scan log's source line)."""
    return _why_not

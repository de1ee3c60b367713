"""Progress of long commands on stderr: a tqdm bar on a terminal, a plain line now and then in a file.

Every command that can run longer than a few seconds (``simulate``, ``sweep``, ``doctor``'s replays,
reading a large job) shows its progress through :func:`progress_bar`, so they all behave alike:

* stderr is a terminal: tqdm's bar, redrawn in place and erased when done (``leave=False``);
* stderr is a file or a pipe (a long run under ``nohup`` or ``2> log``): one complete line at most
  every ``file_interval`` seconds (default 30), so the log shows the run is alive and how far it got,
  without tqdm's carriage returns;
* ``enabled=False`` (``--json``, ``--no-progress``) or tqdm's own ``TQDM_DISABLE=1``: nothing.

Example:
    >>> with progress_bar(total=3, desc="replaying", unit="setting", enabled=False) as bar:
    ...     for _ in range(3):
    ...         bar.update(1)
"""
from __future__ import annotations

import os
import sys
from typing import IO

__all__ = ["FILE_INTERVAL", "progress_bar"]

#: seconds between two progress lines when stderr is not a terminal
FILE_INTERVAL = 30.0


class _Lines:
    """A stream for tqdm that turns its in-place redraws (``"\\r" + status``) into whole lines."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        status = text.replace("\r", "").rstrip()
        if status:
            self.stream.write(status + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(total: float | None, desc: str, unit: str = "it", *, enabled: bool = True,
                 stream: IO[str] | None = None, file_interval: float = FILE_INTERVAL, **kwargs):
    """A ``tqdm`` bar on ``stream`` (default stderr) as described in the module docstring.

    Args:
        total: units to do (``None``: unknown; tqdm then shows a count and a rate, no time left).
        desc: what is being done (``"simulate"``, ``"replaying"``).
        unit: what one unit is (``"step"``, ``"rank"``).
        enabled: ``False`` gives a bar that prints nothing (it still counts).
        file_interval: seconds between lines when ``stream`` is not a terminal.
        kwargs: passed to tqdm (``unit_scale``, ``postfix`` ...).

    Returns:
        a tqdm instance (a context manager; call ``close()`` when not used as one).
    """
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    disabled = not enabled or os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes")
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):    # a closed or odd stream (pytest's capture)
        tty = False
    if tty:
        return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=disabled, leave=False,
                    dynamic_ncols=True, **kwargs)
    # a file: a line at most every file_interval seconds (tqdm checks the clock after miniters updates)
    return tqdm(total=total, desc=desc, unit=unit, file=_Lines(stream), disable=disabled, leave=False,
                mininterval=file_interval, maxinterval=file_interval, miniters=1, ncols=100, ascii=True,
                **kwargs)

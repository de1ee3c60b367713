"""A run's own pool log, replayed once where the run finishes; its summary is a small JSON file.

A CPU run (``ms-memopt run``, ``make demo``) logs MindSpore's pool calls to ``OUT/pool.log``.
The run replays that log through the ``mindspore-bestfit`` model when it ends and writes what the
replay found to ``OUT/pool_log_replay.json`` (:data:`SUMMARY_NAME`); the report
(:mod:`ms_memopt.report.build`) only reads that file, it never replays.

The summary: ``{"log": "pool.log", "log_bytes": n, "allocator": "mindspore-bestfit", "events": n,
"allocs": n, "address_match": 0..1 or null, "final_layout_match": true/false/null}``, or
``{"log": ..., "log_bytes": n, "error": "..."}`` when the log could not be read. ``log_bytes`` is
the log's size when it was replayed (MindSpore may log a few more lines as the process ends).
A new capture truncates ``pool.log`` and the run that made it rewrites the summary, so the two
always describe the same run.

Example:
    >>> summary = write_summary("out/run")          # doctest: +SKIP
    >>> summary["address_match"]                    # doctest: +SKIP
    1.0
"""
from __future__ import annotations

import json
from pathlib import Path

from ms_memopt.allocators import create
from ms_memopt.core.errors import InputError
from ms_memopt.replay.replay import replay
from ms_memopt.io.traces import load_trace
from ms_memopt.io.traces.ms_pool_log import LOG_NAME

__all__ = ["ALLOCATOR", "SUMMARY_NAME", "read_summary", "summarize", "write_summary"]

#: the summary's file name, next to the run's ``run.json``
SUMMARY_NAME = "pool_log_replay.json"
#: the model of MindSpore's CPU pool (``DynamicMemPoolBestFit``)
ALLOCATOR = "mindspore-bestfit"


def summarize(log: str | Path) -> dict:
    """Replay the pool log at ``log`` once and return its summary (module docstring)."""
    log = Path(log)
    out: dict = {"log": log.name, "log_bytes": log.stat().st_size}
    try:
        trace = load_trace(log)
    except InputError as exc:
        out["error"] = str(exc)
        return out
    result = replay(trace, create(ALLOCATOR), sample_every=0)
    out.update(allocator=ALLOCATOR, events=result.events, allocs=result.allocs,
               address_match=result.address_match, final_layout_match=result.final_layout_match)
    return out


def write_summary(directory: str | Path) -> dict | None:
    """Replay ``directory/pool.log`` and write ``directory/pool_log_replay.json``; ``None`` (and
    nothing written) when the directory has no pool log."""
    root = Path(directory)
    log = root / LOG_NAME
    if not log.is_file():
        return None
    summary = summarize(log)
    (root / SUMMARY_NAME).write_text(json.dumps(summary) + "\n", encoding="utf-8")
    return summary


def read_summary(directory: str | Path) -> dict | None:
    """The summary of ``directory/pool.log`` written by :func:`write_summary`; ``None`` when there
    is none (or no pool log) or it is unreadable."""
    root = Path(directory)
    path, log = root / SUMMARY_NAME, root / LOG_NAME
    if not path.is_file() or not log.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None

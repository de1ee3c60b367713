"""``ms-memopt record [--out FILE.jsonl] -- COMMAND ...``: record the real MindSpore pool of a run.

Runs ``COMMAND`` with ``VLOG_v=12906`` (MindSpore's pool log, docs/traces.md) and reads its
stderr as it comes: pool lines become the project's JSONL events (real addresses, blocks as
``segment_alloc`` events, ``step`` events when the run has a ``LayoutScanCallback``), written
line by line so a killed run leaves a readable file; every other stderr line is passed through.
The header's ``meta`` names the pool (``DynamicMemPoolBestFit`` on CPU), the command, and the
pool counters last logged. ``ms-memopt replay FILE.jsonl`` then replays it through the model of
that pool.

The recorded run is slower: MindSpore formats one ~300-byte line per pool call (docs/traces.md
gives the measured slowdown). Exit code: the command's own (128 + N when a signal N ended it;
127 when it cannot be started); 2 for bad arguments.

Example:
    ms-memopt record --out mlp.jsonl -- python train.py --steps 10
    ms-memopt replay mlp.jsonl
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from ms_memopt.core.errors import InputError

__all__ = ["add_parser", "run", "record"]

_NOISE = "[V12906]"    # the pool's other log lines (merges, block usage): not passed through


def add_parser(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``ms-memopt record``."""
    parser.add_argument("--out", default="memopt-record.jsonl", metavar="FILE.jsonl",
                        help="event file to write (default: memopt-record.jsonl)")
    parser.add_argument("--raw", default=None, metavar="FILE",
                        help="also keep the raw pool log lines and step marks (the reader reads it too)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the run to record")


def run(args: argparse.Namespace) -> int:
    """Run the command; returns its exit code."""
    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise InputError("expected a command to record after --, e.g. ms-memopt record -- python train.py",
                         key="COMMAND")
    return record(command, args.out, raw=args.raw, progress=not args.no_progress)


#: longest stderr line taken whole (a longer one is read in pieces: never all at once)
_MAX_LINE = 1 << 20


class _Sink:
    """A file the recording writes (events or raw lines): a write that fails closes it and is kept,
    to be reported at the end; the job's output is drained whatever happens to the file."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.error: OSError | None = None

    def guard(self, action, *args, **kwargs):
        if self.error is not None:
            return None
        try:
            return action(*args, **kwargs)
        except OSError as exc:
            self.error = exc
            return None


def record(command: list[str], out: str | Path, *, raw: str | Path | None = None, progress: bool = True) -> int:
    """Run ``command`` with the pool log on and write its events to ``out``; returns its exit code.

    The command's stderr is always read to its end, whatever happens to the files written (a
    directory, a full disk): a write error closes that file, is reported when the command ends,
    and makes the exit code non-zero (the command's own when it failed, else 2). A first Ctrl-C
    reaches the command too and the recording keeps draining until the command ends; a second one
    kills it.
    """
    from tqdm import tqdm

    from ms_memopt.core.events import EventWriter
    from ms_memopt.io.traces.ms_pool_log import PoolLogParser

    env = dict(os.environ, VLOG_v="12906", MS_MEMOPT_RECORD="1")
    try:
        proc = subprocess.Popen(command, stderr=subprocess.PIPE, env=env)
    except OSError as exc:
        print(f"ms-memopt record: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    parser = PoolLogParser(source=str(out))
    events_sink, raw_sink = _Sink(str(out)), _Sink(str(raw) if raw else "")
    writer: EventWriter | None = None
    raw_file = raw_sink.guard(open, raw, "w", encoding="utf-8") if raw else None
    started = time.perf_counter()
    bar = tqdm(total=None, unit=" events", desc="recording", file=sys.stderr, disable=not progress or None,
               mininterval=0.5, dynamic_ncols=True)

    def take(chunk: bytes) -> None:
        nonlocal writer
        line = chunk.decode("utf-8", errors="replace").rstrip("\r\n")
        events = parser.feed(line)
        if events:
            if writer is None and events_sink.error is None:   # the first pool line says which pool this is
                writer = events_sink.guard(EventWriter, out, meta={"pool": parser.pool, "source": "ms-memopt record",
                                                                   "command": command}, flush_every=512)
            if writer is not None and events_sink.error is None:
                events_sink.guard(writer.write_all, events)
            bar.update(len(events))
        if raw_file is not None and (events or _NOISE in line):   # pool lines and step/mark lines
            raw_sink.guard(raw_file.write, line + "\n")
        if not events and _NOISE not in line:
            try:
                bar.write(line, file=sys.stderr)
            except (OSError, ValueError):      # our own stderr gone: keep draining the job's
                pass

    interrupts = 0
    while True:
        try:
            for chunk in iter(lambda: proc.stderr.readline(_MAX_LINE), b""):
                take(chunk)
            break
        except KeyboardInterrupt:   # the command got the same Ctrl-C: drain until it ends; twice: kill it
            interrupts += 1
            if interrupts > 1:
                proc.kill()
    code = proc.wait()
    proc.stderr.close()      # read to its end above; closed here, not left to the garbage collector
    bar.close()
    if raw_file is not None:
        raw_sink.guard(raw_file.close)
    if writer is not None:
        events_sink.guard(writer.close)
        if events_sink.error is None:
            events_sink.guard(_rewrite_header, Path(out), parser.meta())
    seconds = time.perf_counter() - started
    meta = parser.meta()
    failed = [sink for sink in (events_sink, raw_sink) if sink.error is not None]
    for sink in failed:
        print(f"ms-memopt record: error: {sink.name}: cannot write it: {sink.error.strerror or sink.error}; "
              "the command's output was still read to its end", file=sys.stderr)
    if writer is None and not failed:
        print(f"ms-memopt record: no MindSpore pool line in the command's stderr; nothing written to {out} "
              "(does it import mindspore and run tensors on the CPU or Ascend?)", file=sys.stderr)
    elif writer is not None and events_sink.error is None:
        print(f"ms-memopt record: {meta['pool_lines']:,} pool lines -> {out} in {seconds:.1f} s"
              + (f"; skipped {meta['skipped_lines']} torn lines" if meta["skipped_lines"] else ""),
              file=sys.stderr)
    code = code if code >= 0 else 128 - code
    return code if code or not failed else 2


def _rewrite_header(path: Path, pool_log: dict) -> None:
    """Put the final counts (what the reader skipped, the last pool counters) into the header:
    the file is copied behind a new header line in chunks (a long recording is gigabytes)."""
    import json
    import shutil

    staged = path.with_name(path.name + ".header")
    with open(path, "rb") as handle, open(staged, "wb") as copy:
        header = json.loads(handle.readline(_MAX_LINE))
        header.setdefault("meta", {})["pool_log"] = pool_log
        copy.write(json.dumps(header).encode() + b"\n")
        shutil.copyfileobj(handle, copy, 1 << 20)
    os.replace(staged, path)

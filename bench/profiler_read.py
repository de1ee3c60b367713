"""Reading and replaying the Ascend profiler's memory output of a long run.

Generates a rank's profiler folder as torch_npu's profiler writes it (``operator_memory.csv`` and
``memory_record.csv`` in the writer's exact text format: times as ns with the decimal point moved
and a trailing TAB, ``Size(KB)``, totals in MB, CRLF; ms_memopt.io.traces.ascend_profiler.writer)
from the seeded synthetic training trace (ms_memopt.io.traces.synthetic) with ``--rows`` tensors
(default 10**6), one microsecond per event, the first ten tensors allocated before the capture.
Then times, in this process:

* ``read``: ``load_trace(folder)`` (detection, the CSV streamed, rows merged into time-sorted
  events, the recorded totals checked at every row);
* ``replay``: the events through the model the reader picked (``recorded_allocator``), sampling off;
* ``streamed``: ``load_trace(folder, stream=True)`` replayed (what ``ms-memopt replay`` does for a
  folder over 64 MiB): the file read twice, the events made as the model takes them; timed first,
  so the process's peak memory then is the stream's.

Prints a table (wall seconds, and CPU seconds of this process, which a busy machine skews less),
then as the last line one JSON object: ``{"rows", "events", "read_s", "replay_s", "total_s",
"read_cpu_s", "replay_cpu_s", "streamed_s", "streamed_cpu_s", "streamed_peak_rss_mb", "whole_peak_rss_mb",
"rows_per_s", "allocated_max_diff", "file_mb", "allocator", "target_s"}``.
Target (issue 34): seconds for 10**6 rows; ``allocated_max_diff`` must be 0.

Usage: python bench/profiler_read.py [--rows N] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_memopt.allocators import create
from ms_memopt.core.events import Event
from ms_memopt.io.traces import load_trace
from ms_memopt.io.traces.ascend_profiler.writer import write_profiler_output
from ms_memopt.io.traces.synthetic import synthetic_trace
from ms_memopt.replay.replay import recorded_allocator, replay

T0 = 1736408883694624810     # ns: a real profiler clock value
TARGET_S = 10.0


def _run_events(rows: int) -> tuple[list[Event], dict[int, int]]:
    """A synthetic run with ``rows`` allocations; the first weights become pre-capture tensors."""
    trace = synthetic_trace(2 * rows + rows // 10, seed=0)
    events, initial, allocs = [], {}, 0
    for index, event in enumerate(trace.events):
        if event.action not in ("alloc", "free"):
            continue
        time_ns = T0 + 1000 * index
        if event.action == "alloc":
            if allocs >= rows:
                continue
            if index < 2000 and len(initial) < 10:
                initial[event.id] = event.size      # allocated before the capture began: no row
                continue
            allocs += 1
            events.append(Event("alloc", id=event.id, size=event.size, time=time_ns, tag="aten::empty_strided"))
        else:
            events.append(Event("free", id=event.id, time=time_ns))
    return events, initial


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="tensors (operator_memory rows)")
    parser.add_argument("--keep", metavar="DIR", default=None,
                        help="write the folder here and keep it (a folder already there of that many rows is reused)")
    parser.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate_only:          # in a process of its own, so the timed process's memory is the reader's
        events, initial = _run_events(args.rows)
        write_profiler_output(Path(args.keep), events, initial=initial)
        return 0

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="profiler_read_"))
    try:
        started = time.perf_counter()
        folder = root / "rank0_ascend_pt"
        stamp = root / f"rows_{args.rows}"
        if not (args.keep and stamp.exists()):
            subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--keep", str(root), "--generate-only"],
                           check=True)
            stamp.touch()
        out_dir = folder / "ASCEND_PROFILER_OUTPUT"
        file_mb = sum(p.stat().st_size for p in out_dir.iterdir()) / 2**20
        generated = time.perf_counter() - started

        # streamed first: the process's peak memory then is the stream's (it only grows after)
        started, cpu = time.perf_counter(), time.process_time()
        streamed = load_trace(folder, stream=True)
        chosen = recorded_allocator(streamed)
        streamed_result = replay(streamed, create(chosen.name, **chosen.options), sample_every=0)
        stream_s, stream_cpu = time.perf_counter() - started, time.process_time() - cpu
        stream_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        del streamed

        started, cpu = time.perf_counter(), time.process_time()
        trace = load_trace(folder)
        read_s, read_cpu = time.perf_counter() - started, time.process_time() - cpu
        recorded = trace.meta["recorded"]
        allocator = recorded_allocator(trace)
        model = create(allocator.name, **allocator.options)
        started, cpu = time.perf_counter(), time.process_time()
        result = replay(trace, model, sample_every=0)
        replay_s, replay_cpu = time.perf_counter() - started, time.process_time() - cpu
        whole_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    rows = recorded["rows"]
    total = read_s + replay_s
    print(f"profiler folder of {rows:,} operator_memory rows ({file_mb:.0f} MiB of CSV, generated in {generated:.1f} s)")
    print(f"{'step':<10}{'seconds':>10}{'CPU s':>10}{'rows/s':>14}")
    print(f"{'read':<10}{read_s:>10.2f}{read_cpu:>10.2f}{rows / read_s:>14,.0f}")
    print(f"{'replay':<10}{replay_s:>10.2f}{replay_cpu:>10.2f}{rows / replay_s:>14,.0f}")
    print(f"{'total':<10}{total:>10.2f}{read_cpu + replay_cpu:>10.2f}{rows / total:>14,.0f}   "
          f"(process peak {whole_rss:,.0f} MiB)")
    print(f"{'streamed':<10}{stream_s:>10.2f}{stream_cpu:>10.2f}{rows / stream_s:>14,.0f}   "
          f"(read twice and replayed; process peak {stream_rss:,.0f} MiB; same peaks: "
          f"{streamed_result.peak_allocated == result.peak_allocated})")
    print(f"events {len(trace.events):,} through {result.allocator} ({allocator.why}); allocated curve off by "
          f"{recorded['allocated_max_diff']} B at most; recorded peak allocated {recorded['peak_allocated']:,} B, "
          f"model {result.peak_allocated:,} B")
    print(json.dumps({"rows": rows, "events": len(trace.events), "read_s": round(read_s, 3),
                      "replay_s": round(replay_s, 3), "total_s": round(total, 3),
                      "read_cpu_s": round(read_cpu, 3), "replay_cpu_s": round(replay_cpu, 3),
                      "streamed_s": round(stream_s, 3), "streamed_cpu_s": round(stream_cpu, 3),
                      "streamed_peak_rss_mb": round(stream_rss), "whole_peak_rss_mb": round(whole_rss),
                      "rows_per_s": round(rows / total), "allocated_max_diff": recorded["allocated_max_diff"],
                      "file_mb": round(file_mb, 1), "allocator": result.allocator, "target_s": TARGET_S}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

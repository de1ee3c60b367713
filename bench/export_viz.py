"""Benchmark: what ``simulate --export-memory-viz`` costs, against the same run without it (issue 44).

Runs ``ms-memopt simulate RECIPE --steps N --ranks 1 --policy baseline`` twice, each in a child
process (its own peak RSS, read from ``wait4``): without an export, then with
``--export-memory-viz`` (and ``--export-max-entries M`` when given). Target: 200 steps of the
100B rank export in at most 400 MB. Prints a table, then as the last line one JSON object:
{"steps", "allocator", "seconds", "rss_mb", "export_seconds", "export_rss_mb", "file_mb",
"entries", "time_ratio", "rss_ratio"}.

Usage: python bench/export_viz.py [--steps 200] [--recipe PATH] [--allocator NAME] [--max-entries M]
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(argv: list[str]) -> tuple[float, float]:
    """``argv`` run as a child: its wall seconds and peak RSS (MB)."""
    started = time.perf_counter()
    child = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _pid, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    err = child.stderr.read().decode(errors="replace")
    child.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{err}")
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--recipe", default="recipes/dense_100b_1024x910c.yaml")
    parser.add_argument("--allocator", default=None, help="default: the recipe's")
    parser.add_argument("--max-entries", type=int, default=None, help="--export-max-entries of the export run")
    args = parser.parse_args()

    base = [sys.executable, "-m", "ms_memopt", "simulate", args.recipe, "--steps", str(args.steps), "--ranks", "1",
            "--policy", "baseline", "--json", "--workers", "1"]
    if args.allocator:
        base += ["--allocator", args.allocator]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "export.pickle"
        seconds, rss = run(base)
        extra = ["--export-max-entries", str(args.max_entries)] if args.max_entries else []
        export_seconds, export_rss = run(base + ["--export-memory-viz", str(path), *extra])
        size = path.stat().st_size
        with open(path, "rb") as handle:
            entries = len(pickle.load(handle)["device_traces"][0])
    figures = {"steps": args.steps, "allocator": args.allocator, "max_entries": args.max_entries,
               "seconds": round(seconds, 2), "rss_mb": round(rss, 1), "export_seconds": round(export_seconds, 2),
               "export_rss_mb": round(export_rss, 1), "file_mb": round(size / 2**20, 1), "entries": entries,
               "time_ratio": round(export_seconds / seconds, 2), "rss_ratio": round(export_rss / rss, 2)}
    print(f"{'run':<22} {'seconds':>8} {'peak RSS':>10}")
    print(f"{'without export':<22} {seconds:>8.2f} {rss:>7.0f} MB")
    print(f"{'--export-memory-viz':<22} {export_seconds:>8.2f} {export_rss:>7.0f} MB   "
          f"({figures['file_mb']} MB, {entries:,} trace entries)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

"""Reading a big PyTorch-format snapshot: replay and doctor against a bare ``pickle.load`` (issue 43).

The snapshot is made here (:func:`write_big_snapshot`): a seeded synthetic training trace
(ms_memopt.io.traces.synthetic) placed by the PyTorch caching-allocator model, written as PyTorch
writes ``torch.cuda.memory._dump_snapshot()``: ``segments`` with their blocks, one device trace of
``segment_alloc`` / ``alloc`` / ``free_requested`` / ``free_completed`` entries (``addr``, ``size``,
``stream``, ``frames``: the format before ``time_us``), ``allocator_settings``. The default, 1.2M trace entries,
is 51 MB (the issue's file: 46 MB).

Timed in one run, each against the floor, a bare ``pickle.load`` of the same file in this process:

* ``scan``: the pickle nesting guard (``pickle_nesting``), compiled and its pure-Python reference;
* ``replay``: ``ms-memopt replay SNAPSHOT --json`` (a subprocess, start-up included);
* ``doctor``: ``ms-memopt doctor SNAPSHOT --capacity 100MiB --json``.

Each command's CPU seconds (its workers' included) are measured too, against the load's CPU
seconds: on a machine others keep busy the wall-clock ratios say more about them than about us.

Prints a table (seconds, ratio to the bare load, the same in CPU seconds), then as the last line one
JSON object: ``{"entries", "bytes", "load_s", "load_cpu_s", "scan_s", "scan_reference_s", "replay_s",
"replay_cpu_s", "doctor_s", "doctor_cpu_s", "replay_ratio", "replay_cpu_ratio", "doctor_ratio",
"doctor_cpu_ratio", "targets": {"replay": 2.5, "doctor": 6.0}, "load_average"}``.

Usage: python bench/big_snapshot.py [--entries 1200000] [--keep PATH] [--skip-doctor] [--no-reference]
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ms_memopt.allocators import create  # noqa: E402
from ms_memopt.io.traces.synthetic import synthetic_trace  # noqa: E402
from ms_memopt.replay.replay import placed_events  # noqa: E402

TARGETS = {"replay": 2.5, "doctor": 6.0}
#: trace entries per synthetic event (an alloc is one entry, a free two: requested and completed)
_ENTRIES_PER_EVENT = 1.45
_FRAMES = {"alloc": [{"filename": "train.py", "line": 42, "name": "forward"}],
           "free": [{"filename": "train.py", "line": 57, "name": "backward"}]}


def torch_snapshot(entries: int, *, seed: int = 0) -> dict:
    """A PyTorch-format snapshot dict with about ``entries`` trace entries (builtin types only)."""
    trace = synthetic_trace(int(entries / _ENTRIES_PER_EVENT), seed=seed)
    events, result = placed_events(trace, create("torch"), segments=True)
    out: list[dict] = []
    for event in events:
        base = {"addr": event.addr, "size": int(event.size), "stream": 0}
        if event.action == "segment_alloc":
            out.append({"action": "segment_alloc", **base, "frames": []})
        elif event.action == "alloc":
            out.append({"action": "alloc", **base, "frames": _FRAMES["alloc"]})
        elif event.action == "free":
            out.append({"action": "free_requested", **base, "frames": _FRAMES["free"]})
            out.append({"action": "free_completed", **base, "frames": _FRAMES["free"]})
        if len(out) >= entries:
            break
    segments = []
    for seg in result.final_layout.segments:
        blocks = [{"address": b.addr, "size": b.size, "requested_size": b.size if b.live else 0,
                   "state": "active_allocated" if b.live else "inactive", "frames": []} for b in seg.blocks]
        live = sum(b.size for b in seg.blocks if b.live)
        segments.append({"device": 0, "address": seg.addr, "total_size": seg.size, "allocated_size": live,
                         "active_size": live, "requested_size": live, "stream": 0,
                         "segment_type": "small" if seg.pool == "small" else "large",
                         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks})
    return {"segments": segments, "device_traces": [out], "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}


def write_big_snapshot(path: str | Path, entries: int = 1_200_000, *, seed: int = 0) -> int:
    """Write :func:`torch_snapshot` to ``path`` (pickle protocol 4, as ``torch.save`` would); its
    trace entry count."""
    data = torch_snapshot(entries, seed=seed)
    with open(path, "wb") as handle:
        pickle.dump(data, handle, protocol=4)
    return len(data["device_traces"][0])


def _timed(function) -> float:
    """Wall seconds of ``function()``."""
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (and of the workers they waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _command(*args: str) -> tuple[float, float]:
    """(wall, CPU) seconds of ``ms-memopt ARGS`` in a subprocess (it must exit 0); the CPU seconds
    count its workers too, and say what it costs whatever else the machine runs."""
    started, cpu = time.perf_counter(), _children_cpu()
    subprocess.run([sys.executable, "-m", "ms_memopt", *args], check=True, stdout=subprocess.DEVNULL,
                   cwd=ROOT, env={**os.environ, "TQDM_DISABLE": "1"})
    return time.perf_counter() - started, _children_cpu() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_200_000)
    parser.add_argument("--keep", help="write the snapshot here and keep it (reused when it exists)")
    parser.add_argument("--skip-doctor", action="store_true")
    parser.add_argument("--no-reference", action="store_true", help="skip the pure-Python scan")
    args = parser.parse_args()
    from ms_memopt.io.traces import torch_snapshot as reader

    folder = tempfile.TemporaryDirectory()
    path = Path(args.keep) if args.keep else Path(folder.name) / "big.pickle"
    if not path.exists():
        write_big_snapshot(path, args.entries)
    data = path.read_bytes()
    with open(path, "rb") as handle:
        started, cpu = time.perf_counter(), time.process_time()
        snapshot = pickle.load(handle)
        load, load_cpu = time.perf_counter() - started, time.process_time() - cpu
    entries = len(snapshot["device_traces"][0])
    del snapshot
    figures = {"entries": entries, "bytes": len(data), "load_s": load, "load_cpu_s": load_cpu,
               "scan_s": _timed(lambda: reader.pickle_nesting(data)),
               "scan_reference_s": None if args.no_reference else _timed(lambda: reader.nesting_reference(data))}
    figures["replay_s"], figures["replay_cpu_s"] = _command("replay", str(path), "--json")
    if not args.skip_doctor:
        figures["doctor_s"], figures["doctor_cpu_s"] = _command("doctor", str(path), "--capacity", "100MiB", "--json")
    print(f"{'what':<24}{'seconds':>10}{'x load':>10}{'CPU s':>10}{'x load CPU':>12}")
    for key in ("load", "scan", "scan_reference", "replay", "doctor"):
        if figures.get(f"{key}_s") is not None:
            wall, cpu = figures[f"{key}_s"], figures.get(f"{key}_cpu_s")
            cpu_text = f"{cpu:>10.2f}{cpu / load_cpu:>12.2f}" if cpu is not None else ""
            print(f"{key:<24}{wall:>10.2f}{wall / load:>10.2f}{cpu_text}")
    for key in ("replay", "doctor"):
        if f"{key}_s" in figures:
            figures[f"{key}_ratio"] = figures[f"{key}_s"] / load
            figures[f"{key}_cpu_ratio"] = figures[f"{key}_cpu_s"] / load_cpu
    figures["targets"] = TARGETS
    figures["load_average"] = os.getloadavg()[0]
    print(f"{entries} entries, {len(data) / 1e6:.1f} MB; load average {figures['load_average']:.2f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

"""Replay throughput: events per second of every allocator model on every trace.

Traces: a seeded synthetic trace of 1,000,000 events (ms_memopt.io.traces.synthetic) and the shared
recorded traces in ../shared/data when present (PyTorch snapshots, msMemScope, placement
instances). Models: every entry of ms_memopt.allocators.MODELS that imports (missing ones are
noted and skipped). Replays run with ``sample_every=0`` so only the model's work is timed.

Every model is timed as ``create()`` makes it (the compiled fast path where there is one,
ms_memopt.allocators.fast) and as the pure-Python reference (``fast=False``) in the same run.

Prints a table (thousands of events per second: wall clock, then per CPU second of this
process, which a busy machine skews less; ratio to the reference), then as the last line one
JSON object: ``{"events_per_s": {model: figure on the synthetic trace}, "by_trace": {trace:
{model: ...}}, "reference_by_trace": ..., "ratio_by_trace": ..., "cpu_events_per_s_by_trace":
..., "snapshot": {model: figure on tinyllama_qlora.pickle}, "events": n, "target": 1000000}``.
Target (issue 17): >= 1,000,000 events/s on every model on the 3.2 MB public snapshot.

Usage: python bench/replay.py [--events N] [--models mindspore,torch]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_memopt.allocators import MODELS, create  # noqa: E402
from ms_memopt.allocators.fast import AVAILABLE, FAST_MODELS  # noqa: E402
from ms_memopt.core.errors import InputError  # noqa: E402
from ms_memopt.replay.replay import replay  # noqa: E402
from ms_memopt.io.traces import load_trace  # noqa: E402
from ms_memopt.io.traces.synthetic import synthetic_trace  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SHARED_TRACES = [
    "traces/torch/tinyllama_qlora.pickle", "traces/torch/cs336_small_warm.pickle",
    "traces/msmemscope/baseline.csv", "dsa/minimalloc/A.1048576.csv", "dsa/minimalloc/input.12.csv",
    "dsa/somas/resnet50.csv", "dsa/somas/tiny_bert.csv", "dsa/somas/bert_base.csv",
]
TARGET = 1_000_000
SNAPSHOT = "tinyllama_qlora.pickle"


# models that cannot be built from a capacity alone: not timed here
NEEDS_OPTIONS = {"pool": "needs the region sizes of a pool-mode plan"}


def _models(wanted: list[str] | None, notes: list[str]) -> list[str]:
    names = []
    for name in wanted or list(MODELS):
        if name not in MODELS:
            notes.append(f"unknown model {name!r} skipped")
            continue
        if name in NEEDS_OPTIONS:
            notes.append(f"model {name!r} {NEEDS_OPTIONS[name]}; skipped")
            continue
        names.append(name)
    return names


def _traces(n_events: int, notes: list[str]):
    started = time.perf_counter()
    trace = synthetic_trace(n_events, seed=0)
    notes.append(f"synthetic trace built in {time.perf_counter() - started:.1f} s")
    yield f"synthetic {n_events:,}", trace
    del trace
    for relative in SHARED_TRACES:
        path = SHARED / relative
        if not path.exists():
            notes.append(f"{relative}: not present; skipped")
            continue
        try:
            yield Path(relative).name, load_trace(path)
        except InputError as exc:
            notes.append(f"{relative}: {exc}; skipped")


def _throughput(trace, name: str, repeats: int, fast: bool) -> tuple[float, float]:
    """Best wall-clock and best CPU-time events/s over ``repeats`` replays."""
    wall = cpu = 0.0
    for _ in range(repeats):
        result = replay(trace, create(name, fast=fast), sample_every=0)
        wall, cpu = max(wall, result.events_per_s), max(cpu, result.cpu_events_per_s)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="synthetic trace length")
    parser.add_argument("--models", default=None, help="comma-separated model names (default: all)")
    args = parser.parse_args(argv)
    notes: list[str] = []
    models = _models(args.models.split(",") if args.models else None, notes)
    if not AVAILABLE:
        notes.append("compiled fast path not built (pip install -e .): every model runs pure Python")
    by_trace: dict[str, dict[str, float | None]] = {}
    reference: dict[str, dict[str, float | None]] = {}
    cpu: dict[str, dict[str, float | None]] = {}
    failures: dict[tuple[str, str], list[str]] = {}
    snapshot: dict[str, float | None] = {}
    for label, trace in _traces(args.events, notes):
        key = f"{label} ({len(trace.events):,} ev)"
        row, ref_row, cpu_row = by_trace.setdefault(key, {}), reference.setdefault(key, {}), cpu.setdefault(key, {})
        # short traces are timed several times (best of), the big one once
        repeats = 1 if len(trace.events) >= 100_000 else 5
        for name in models:
            try:
                ref_row[name], _ = _throughput(trace, name, repeats, fast=False)
                if AVAILABLE and name in FAST_MODELS:
                    row[name], cpu_row[name] = _throughput(trace, name, repeats, fast=True)
                else:
                    row[name], cpu_row[name] = _throughput(trace, name, repeats, fast=False)
            except Exception as exc:  # a model failing on one trace must not hide the others
                failures.setdefault((name, f"{type(exc).__name__}: {exc}"[:160]), []).append(label)
                row[name] = ref_row[name] = cpu_row[name] = None
        if label == SNAPSHOT:
            snapshot = row
    ratio = {k: {m: (None if by_trace[k][m] is None or not reference[k][m] else round(by_trace[k][m] / reference[k][m], 2))
                 for m in models} for k in by_trace}

    width = max([len(k) for k in by_trace] + [10])
    print("thousands of events/s: wall clock / per CPU second (ratio to the pure-Python reference, same run)")
    print(f"{'trace':<{width}}  " + "  ".join(f"{m:>26}" for m in models))
    for label, row in by_trace.items():
        cells = ["{:>26}".format("-" if row.get(m) is None else
                                 f"{row[m] / 1000:,.0f} / {cpu[label][m] / 1000:,.0f} (x{ratio[label][m]})")
                 for m in models]
        print(f"{label:<{width}}  " + "  ".join(cells))
    for name in models:
        if snapshot.get(name) is not None:
            verdict = "meets" if snapshot[name] >= TARGET else "BELOW"
            print(f"{name}: {snapshot[name]:,.0f} events/s on {SNAPSHOT}, {verdict} the {TARGET:,} target")
    for (name, message), labels in failures.items():
        notes.append(f"{name} failed on {', '.join(labels)}: {message}")
    for note in notes:
        print(f"note: {note}")
    synthetic = next(iter(by_trace.values()), {})
    print(json.dumps({"events_per_s": synthetic, "by_trace": by_trace, "reference_by_trace": reference,
                      "ratio_by_trace": ratio, "cpu_events_per_s_by_trace": cpu, "snapshot": snapshot,
                      "events": args.events, "target": TARGET}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

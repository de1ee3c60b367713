"""Replay throughput: events per second of every allocator model on every trace.

Traces: a seeded synthetic trace of 1,000,000 events (ms_memopt.traces.synthetic) and the shared
recorded traces in ../shared/data when present (PyTorch snapshots, msMemScope, placement
instances). Models: every entry of ms_memopt.allocators.MODELS that imports (missing ones are
noted and skipped). Replays run with ``sample_every=0`` so only the model's work is timed.

Prints a table (thousands of events per second), then as the last line one JSON object:
``{"events_per_s": {model: figure on the synthetic trace}, "by_trace": {trace: {model: ...}},
"events": n, "target": 300000}``. Target: >= 300,000 events/s for ``torch`` and ``mindspore``.

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
from ms_memopt.errors import InputError  # noqa: E402
from ms_memopt.replay import replay  # noqa: E402
from ms_memopt.traces import load_trace  # noqa: E402
from ms_memopt.traces.synthetic import synthetic_trace  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SHARED_TRACES = [
    "traces/torch/tinyllama_qlora.pickle", "traces/torch/cs336_small_warm.pickle",
    "traces/msmemscope/baseline.csv", "dsa/minimalloc/A.1048576.csv", "dsa/minimalloc/input.12.csv",
    "dsa/somas/resnet50.csv", "dsa/somas/tiny_bert.csv", "dsa/somas/bert_base.csv",
]
TARGET = 300_000


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


def _throughput(trace, name: str, repeats: int) -> float:
    best = 0.0
    for _ in range(repeats):
        result = replay(trace, create(name), sample_every=0)
        best = max(best, result.events_per_s)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="synthetic trace length")
    parser.add_argument("--models", default=None, help="comma-separated model names (default: all)")
    args = parser.parse_args(argv)
    notes: list[str] = []
    models = _models(args.models.split(",") if args.models else None, notes)
    by_trace: dict[str, dict[str, float | None]] = {}
    failures: dict[tuple[str, str], list[str]] = {}
    for label, trace in _traces(args.events, notes):
        row: dict[str, float | None] = {}
        # short traces are timed several times (best of), the big one once
        repeats = 1 if len(trace.events) >= 100_000 else 5
        for name in models:
            try:
                row[name] = _throughput(trace, name, repeats)
            except Exception as exc:  # a model failing on one trace must not hide the others
                failures.setdefault((name, f"{type(exc).__name__}: {exc}"[:160]), []).append(label)
                row[name] = None
        by_trace[f"{label} ({len(trace.events):,} ev)"] = row

    width = max([len(k) for k in by_trace] + [10])
    print(f"{'trace':<{width}}  " + "  ".join(f"{m:>16}" for m in models))
    for label, row in by_trace.items():
        cells = ["{:>16}".format("-" if row.get(m) is None else f"{row[m] / 1000:,.0f}k ev/s") for m in models]
        print(f"{label:<{width}}  " + "  ".join(cells))
    synthetic = next(iter(by_trace.values()), {})
    for name in ("torch", "mindspore"):
        if synthetic.get(name) is not None:
            verdict = "meets" if synthetic[name] >= TARGET else "BELOW"
            print(f"{name}: {synthetic[name]:,.0f} events/s on the synthetic trace, {verdict} the {TARGET:,} target")
    for (name, message), labels in failures.items():
        notes.append(f"{name} failed on {', '.join(labels)}: {message}")
    for note in notes:
        print(f"note: {note}")
    print(json.dumps({"events_per_s": synthetic, "by_trace": by_trace, "events": args.events, "target": TARGET}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

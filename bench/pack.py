"""Static planner benchmark: arena / capacity or / lower bound, and seconds, per instance (issue 17).

Instances:
* generated strips (:func:`ms_memopt.analysis.planner.generate.cut_strip`, the structure of MiniMalloc's
  challenging set: a 1 MiB x 1M-step strip cut into buffers on a 1 KiB grid), always run:
  target "fits 1,048,576 within 60 s";
* MiniMalloc's challenging ``A.1048576.csv`` from ../shared/data/dsa (skipped when absent), and
  any ``*.csv`` in ``--extra DIR`` (the rest of the set, kept out of the repository): same target;
* MindSpore SOMAS exports from ../shared/data/dsa/somas: target ratio <= 1.001 of the lower
  bound, packed with the defaults of ``ms-memopt pack`` (10 s limit, stop when stalled); and
  again with 60 s and no stall cut (``stall60`` rows): target the lower bound itself.

Baseline, measured in the same run: greedy by size (largest first, best-fitting gap), the
classic heuristic. ``ratio`` is arena / capacity for capacity instances and arena / lower bound
for SOMAS ones; ``gap`` is how far the arena could still be above the optimum (vs the best proven
lower bound). ``fit s`` is the wall time until the first placement within the capacity (the
call then goes on improving below it until it stalls, which ``seconds`` includes); the load
average is printed at the start and the end. Prints a table, then one JSON line:
``{"instances": {name: {...}}, "summary": {...}}``.
Run: ``PYTHONPATH=. python bench/pack.py [--extra DIR] [--time-limit 60]``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_memopt.analysis.planner import lower_bound, pack  # noqa: E402
from ms_memopt.analysis.planner import _native  # noqa: E402
from ms_memopt.analysis.planner.generate import cut_strip  # noqa: E402
from ms_memopt.analysis.planner.greedy import greedy_place  # noqa: E402
from ms_memopt.core.placement import arena_of  # noqa: E402
from ms_memopt.io.traces.instances import read_instance  # noqa: E402

DSA = Path(__file__).resolve().parents[2] / "shared" / "data" / "dsa"
CAPACITY = 1_048_576
STRIPS = [(seed, 150 + 40 * (seed % 4), 0.05 * (seed % 3)) for seed in range(8)]  # seed, pieces, drop


def _cases(extra: Path | None):
    """(name, buffers, capacity or None, target) for every instance available here."""
    for seed, pieces, drop in STRIPS:
        inst = cut_strip(seed, pieces, drop=drop)
        yield f"strip/{seed}-{pieces}-{drop:.2f}", inst.buffers, inst.capacity, "fits, <=60s"
    a = DSA / "minimalloc" / "A.1048576.csv"
    if a.exists():
        yield "minimalloc/A", read_instance(a), CAPACITY, "fits, <=60s"
    else:
        print(f"minimalloc/A skipped: {a} is absent")
    if extra is not None:
        for path in sorted(extra.glob("*.csv")):
            if path.name.startswith("A."):
                continue  # the shared copy above
            yield f"aside/{path.stem.split('.')[0]}", read_instance(path), CAPACITY, "fits, <=60s"
    for name in ("resnet50", "tiny_bert", "bert_base"):
        path = DSA / "somas" / f"{name}.csv"
        if path.exists():
            buffers = read_instance(path)
            yield f"somas/{name}", buffers, None, "<=1.001 x bound"
            # the same plan given 60 s without a stall cut: does the search reach the bound?
            yield f"somas/{name} stall60", buffers, None, "= bound"
        else:
            print(f"somas/{name} skipped: {path} is absent")


def _load() -> float | None:
    """1-minute load average (the machine is shared: wall seconds depend on it)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", type=Path, help="more capacity-1048576 instance CSVs (kept aside)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per capacity instance")
    args = parser.parse_args(argv)
    engine = "native" if _native.library() is not None else f"python ({_native.unavailable_reason()})"
    print(f"search engine: {engine}; load average (1 min) at the start: {_load()}")
    header = (f"{'instance':<24} {'buffers':>7} {'vs':>5} {'ratio':>9} {'greedy':>7} {'gap':>9} "
              f"{'fit s':>7} {'seconds':>8} {'cpu s':>7} {'greedy s':>8} {'ok':>3}  stopped / method / target")
    print(header)
    print("-" * len(header))
    results: dict[str, dict] = {}
    for name, buffers, capacity, target in _cases(args.extra):
        bound = lower_bound(buffers)
        start = time.perf_counter()
        baseline = arena_of(buffers, greedy_place(buffers, order="size", fit="best"))
        greedy_seconds = time.perf_counter() - start
        cpu = time.process_time()
        if capacity is not None:
            solution = pack(buffers, capacity=capacity, time_limit=args.time_limit)
            reference, vs = capacity, "cap"
            ok = bool(solution.fits) and solution.fit_seconds <= 60
        elif name.endswith("stall60"):
            solution = pack(buffers, time_limit=60, stall=60)
            reference, vs = bound, "bound"
            ok = solution.arena == bound
        else:
            solution = pack(buffers)  # the command's defaults: 10 s, stop when stalled
            reference, vs = bound, "bound"
            ok = solution.arena <= 1.001 * bound
        cpu = time.process_time() - cpu
        entry = {
            "buffers": len(buffers),
            "capacity": capacity,
            "lower_bound": bound,
            "proven_bound": solution.best_bound,
            "arena": solution.arena,
            "ratio": round(solution.arena / reference, 7),
            "greedy_ratio": round(baseline / reference, 7),
            "vs_greedy": round(solution.arena / baseline, 7),
            "gap": solution.gap,
            "optimal": solution.optimal,
            "seconds": round(solution.seconds, 3),
            "fit_seconds": None if solution.fit_seconds is None else round(solution.fit_seconds, 3),
            "cpu_seconds": round(cpu, 3),
            "greedy_seconds": round(greedy_seconds, 3),
            "valid": solution.valid,
            "met": ok and solution.valid,
            "stopped": solution.stopped,
            "method": solution.method,
        }
        results[name] = entry
        fit = "-" if solution.fit_seconds is None else f"{solution.fit_seconds:.2f}"
        print(f"{name:<24} {len(buffers):>7} {vs:>5} {entry['ratio']:>9.6f} {entry['greedy_ratio']:>7.4f} "
              f"{solution.gap:>9.2e} {fit:>7} {solution.seconds:>8.2f} {cpu:>7.2f} {greedy_seconds:>8.3f} "
              f"{'yes' if entry['met'] else 'NO':>3}  {solution.stopped or '-'} / {solution.method} / {target}")
    met = [e["met"] for e in results.values()]
    load = _load()
    print(f"load average (1 min) at the end: {load}")
    summary = {"instances": len(results), "met": sum(met), "engine": engine.split()[0], "load_average": load,
               "max_seconds": max((e["seconds"] for e in results.values()), default=0.0)}
    print(json.dumps({"instances": results, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

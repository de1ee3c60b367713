"""Static planner benchmark: arena / lower bound and seconds per instance (issue 7).

Instances (read from ../shared/data/dsa, never copied into the repository):
* MindSpore SOMAS exports (resnet50, tiny_bert, bert_base): target ratio <= 1.001 in <= 2 s;
  packed with ``gap=0.001`` (stop once within 0.1 % of the peak-live lower bound) and
  ``time_limit=2``.
* MiniMalloc's challenging ``A.1048576.csv``: must fit capacity 1,048,576 (= its lower bound)
  within 60 s; ``input.12.csv``: solved optimally.

Baseline measured in the same run: greedy by size (largest first, best-fitting gap), the
classic heuristic. Prints a table, then one JSON line:
``{"instances": {name: {"ratio", "seconds", "cpu_seconds", "baseline_ratio", ...}}}``.
Run: ``PYTHONPATH=. python bench/pack.py``.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_memopt.planner import lower_bound, pack  # noqa: E402
from ms_memopt.planner.greedy import greedy_place  # noqa: E402
from ms_memopt.planner.problem import arena_of  # noqa: E402
from ms_memopt.traces.instances import read_instance  # noqa: E402

DSA = Path(__file__).resolve().parents[2] / "shared" / "data" / "dsa"

# name -> (relative path, pack keyword arguments, target description)
CASES = {
    "somas/resnet50": ("somas/resnet50.csv", dict(time_limit=2, gap=0.001), "ratio<=1.001, <=2s"),
    "somas/tiny_bert": ("somas/tiny_bert.csv", dict(time_limit=2, gap=0.001), "ratio<=1.001, <=2s"),
    "somas/bert_base": ("somas/bert_base.csv", dict(time_limit=2, gap=0.001), "ratio<=1.001, <=2s"),
    "minimalloc/A.1048576": ("minimalloc/A.1048576.csv", dict(capacity=1_048_576, time_limit=60),
                             "fits 1048576, <=60s"),
    "minimalloc/input.12": ("minimalloc/input.12.csv", dict(time_limit=10), "optimal"),
}


def main() -> int:
    results: dict[str, dict] = {}
    header = f"{'instance':<22} {'buffers':>7} {'lower bound':>13} {'arena':>13} {'ratio':>9} " \
             f"{'greedy-size':>11} {'seconds':>8} {'cpu s':>6} {'valid':>5}  method / target"
    print(header)
    print("-" * len(header))
    for name, (relative, kwargs, target) in CASES.items():
        path = DSA / relative
        if not path.exists():
            print(f"{name:<22} skipped: {path} is absent")
            continue
        buffers = read_instance(path)
        bound = lower_bound(buffers)
        baseline = arena_of(buffers, greedy_place(buffers, order="size", fit="best"))
        cpu = time.process_time()
        solution = pack(buffers, **kwargs)
        cpu = time.process_time() - cpu
        entry = {
            "ratio": round(solution.ratio, 6),
            "seconds": round(solution.seconds, 3),
            "cpu_seconds": round(cpu, 3),
            "baseline_ratio": round(baseline / bound, 6) if bound else 1.0,
            "buffers": len(buffers),
            "arena": solution.arena,
            "lower_bound": bound,
            "valid": solution.valid,
            "optimal": solution.optimal,
            "method": solution.method,
        }
        if solution.fits is not None:
            entry["fits"] = solution.fits
        results[name] = entry
        extra = "" if solution.fits is None else (" fits" if solution.fits else " DOES NOT FIT")
        print(f"{name:<22} {len(buffers):>7} {bound:>13} {solution.arena:>13} {solution.ratio:>9.5f} "
              f"{entry['baseline_ratio']:>11.4f} {solution.seconds:>8.3f} {cpu:>6.2f} "
              f"{'yes' if solution.valid else 'NO':>5}  {solution.method}{extra} / {target}")
    print(json.dumps({"instances": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

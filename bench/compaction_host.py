"""A compaction's host work per live tensor (``memopt.timing.compaction_tensor_seconds``).

``live_compact`` (``ms_memopt.mindspore.compaction``, the real relocation on MindSpore's pool)
of N Parameters of 256 B each, N = 64, 256 and 1024: at that size the copies cost nothing, so
the slope of the median time over N is the host work per tensor (allocate the new storage,
copy, re-point the Parameter, release the old, and the recompile flag), and the intercept is
the fixed part (the synchronizations). Prints a table and one JSON object as the last line.

Usage:
    python bench/compaction_host.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def _median_seconds(fn, repeats: int) -> float:
    fn()            # warm-up: first-call kernel builds
    return float(np.median(timeit.repeat(fn, number=1, repeat=repeats)))


def per_tensor_seconds(counts=(64, 256, 1024), repeats: int = 7) -> dict:
    """The host seconds of ``live_compact`` per tensor (least-squares slope over ``counts``) and
    its fixed part (the intercept), with each count's median."""
    import mindspore
    from mindspore import Parameter, Tensor

    from ms_memopt.mindspore.compaction import live_compact

    mindspore.set_device("CPU")
    medians = {}
    for n in counts:
        params = [Parameter(Tensor(np.full(64, i, np.float32)), name=f"p{n}_{i}") for i in range(n)]
        medians[n] = _median_seconds(lambda: live_compact(params, verify=False), repeats)
    slope, intercept = np.polyfit(list(medians), list(medians.values()), 1)
    return {"per_tensor_seconds": float(slope), "fixed_seconds": float(intercept),
            "medians": {str(n): t for n, t in medians.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    figures = per_tensor_seconds(repeats=args.repeats)
    for n, t in figures["medians"].items():
        print(f"live_compact of {n:>5} Parameters of 256 B: {t * 1e3:8.2f} ms")
    print(f"-> host work per tensor {figures['per_tensor_seconds'] * 1e6:.1f} µs, "
          f"fixed {figures['fixed_seconds'] * 1e3:.2f} ms  (load {os.getloadavg()[0]:.1f})")
    print(json.dumps(dict(figures, load=os.getloadavg()[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

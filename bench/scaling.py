"""Benchmark: rank streams of a job on one process, on all cores, and on Dask's and Ray's local modes.

Runs the same job (default: 8 rank streams of the 100B recipe's first stage, 60 steps, every
policy) four ways in one run, so the ratios compare like with like on a shared machine:

* ``one process``: every stream in turn in this process (``--executor local --workers 1``);
* ``local processes``: one worker process per core (the default executor);
* ``dask local``: Dask distributed's ``LocalCluster``, one single-threaded worker process per
  core (``--executor dask`` with no address) — the engine path a cluster would run;
* ``ray local``: Ray's local mode, ``ray.init("local", num_cpus=workers)`` (``--executor ray``
  with no address); its start-up and shutdown are in the figure, as a user pays them.

Either engine is skipped when it is not installed (or with ``--no-dask`` / ``--no-ray``).
Checks that every way gives identical results (seconds aside). Prints a table, then as the
last line one JSON object: ``{"seconds": {...}, "speedup_all_cores": one/local,
"dask_vs_local": dask/local, "ray_vs_local": ray/local, "identical": true, ...}``.

Usage: python bench/scaling.py [--streams 8] [--steps 60] [--workers N] [--recipe PATH] [--no-dask] [--no-ray]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ms_memopt.config.recipe import load_recipe
from ms_memopt.simulation.executors import default_workers
from ms_memopt.simulation.spec import job_from_recipe
from ms_memopt.simulation.job import reproducible_figures, simulate_jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "dense_100b_1024x910c.yaml"))
    parser.add_argument("--streams", type=int, default=8, help="rank streams of the first stage")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workers", type=int, default=None, help="default: every core")
    parser.add_argument("--no-dask", action="store_true", help="skip the Dask local cluster")
    parser.add_argument("--no-ray", action="store_true", help="skip Ray's local mode")
    args = parser.parse_args()
    workers = args.workers or default_workers()
    recipe = load_recipe(args.recipe)
    job = job_from_recipe(recipe, ranks=args.streams, stages=[0], steps=args.steps)
    ways = [("one process", dict(executor="local", workers=1)),
            ("local processes", dict(executor="local", workers=workers))]
    if not args.no_dask and importlib.util.find_spec("distributed") is not None:
        ways.append(("dask local", dict(executor="dask", workers=workers)))
    if not args.no_ray and importlib.util.find_spec("ray") is not None:
        ways.append(("ray local", dict(executor="ray", workers=workers)))
    seconds, figures = {}, {}
    for name, kw in ways:
        started = time.perf_counter()
        results = simulate_jobs([job], **kw)
        seconds[name] = time.perf_counter() - started
        figures[name] = reproducible_figures(results)
        print(f"# {name}: {seconds[name]:.1f} s", file=sys.stderr, flush=True)
    identical = all(f == figures["one process"] for f in figures.values())
    base = seconds["local processes"]
    print(f"{len(job.streams)} rank streams x {args.steps} steps x {len(job.policies)} policies, "
          f"{workers} workers (cores available: {default_workers()})")
    print(f"{'way':<16} {'seconds':>8} {'vs local processes':>19}")
    for name, s in seconds.items():
        print(f"{name:<16} {s:>8.1f} {s / base:>19.2f}")
    print(f"identical results: {identical}")
    out = {"streams": len(job.streams), "steps": args.steps, "policies": list(job.policies), "workers": workers,
           "seconds": {k: round(v, 2) for k, v in seconds.items()},
           "speedup_all_cores": round(seconds["one process"] / base, 3),
           "dask_vs_local": round(seconds["dask local"] / base, 3) if "dask local" in seconds else None,
           "ray_vs_local": round(seconds["ray local"] / base, 3) if "ray local" in seconds else None,
           "identical": identical}
    print(json.dumps(out))
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()

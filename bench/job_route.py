"""The job route against the single-stream engine split over the cores (issue 43).

Floor: one rank stream of the recipe's job (its first stream: stage 0, 1000 steps, every policy, in
lock step), simulated in this process as bench/simulate.py does, times the job's streams, divided by
the cores. Measured: the README's headline, ``ms-memopt simulate RECIPE --steps N --stages 0 --out
DIR`` (a subprocess: start-up, every stream on the local workers, the shown rank, timeline, layouts
and report files), in the same run. Target: at most 1.5x the floor.

On a machine others keep busy, one process gets a core while two share what is left: the *shared
floor* is the wall time of one stream run in as many processes at once as there are cores, times the
streams over the cores (what the cores give in parallel in this run), and ``shared_ratio`` the job
against it.

Prints a table, then as the last line one JSON object: ``{"streams", "cores", "steps", "stream_s",
"stream_cpu_s", "floor_s", "job_s", "ratio", "concurrent_stream_s", "shared_floor_s", "shared_ratio",
"target": 1.5, "load_average"}``.

Usage: python bench/job_route.py [--steps 1000] [--recipe recipes/dense_100b_1024x910c.yaml]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ms_memopt.config.recipe import load_recipe  # noqa: E402
from ms_memopt.simulation.executors import default_workers  # noqa: E402
from ms_memopt.simulation.job import simulate_jobs  # noqa: E402
from ms_memopt.simulation.spec import job_from_recipe  # noqa: E402

TARGET = 1.5


def one_stream_seconds(recipe_path: str, steps: int) -> tuple[float, float, int]:
    """(wall, CPU) seconds of the job's first rank stream in this process, and the job's stream count."""
    recipe = load_recipe(recipe_path)
    job = job_from_recipe(recipe, seed=recipe.memopt.workload.seed, stages=[0], steps=steps)
    single = replace(job, streams=job.streams[:1])
    started, cpu = time.perf_counter(), time.process_time()
    simulate_jobs([single], workers=1)
    return time.perf_counter() - started, time.process_time() - cpu, len(job.streams)


def concurrent_stream_seconds(recipe_path: str, steps: int, processes: int) -> float:
    """The slowest of ``processes`` processes simulating the job's first rank stream at once (this
    script with ``--one-stream``; each times its own simulation, start-up left out), in wall seconds:
    what the cores give in parallel right now, others' load included."""
    running = [subprocess.Popen([sys.executable, __file__, "--one-stream", "--steps", str(steps), "--recipe",
                                 recipe_path], stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    seconds = []
    for process in running:
        out, _ = process.communicate()
        if process.returncode != 0:
            raise SystemExit("a --one-stream process failed")
        seconds.append(float(out.split()[-1]))
    return max(seconds)


def job_seconds(recipe_path: str, steps: int, out: Path) -> float:
    """Wall seconds of ``ms-memopt simulate RECIPE --steps N --stages 0 --out OUT`` (it must exit 0)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ms_memopt", "simulate", recipe_path, "--steps", str(steps), "--stages",
                    "0", "--out", str(out)], check=True, stdout=subprocess.DEVNULL, cwd=ROOT,
                   env={**os.environ, "TQDM_DISABLE": "1"})
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "dense_100b_1024x910c.yaml"))
    parser.add_argument("--one-stream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    stream_s, stream_cpu_s, streams = one_stream_seconds(args.recipe, args.steps)
    if args.one_stream:
        print(stream_s)
        return
    cores = default_workers()
    floor = stream_s * streams / cores
    concurrent_s = concurrent_stream_seconds(args.recipe, args.steps, cores)
    shared_floor = concurrent_s * streams / cores
    with tempfile.TemporaryDirectory() as folder:
        job_s = job_seconds(args.recipe, args.steps, Path(folder) / "sim")
    figures = {"streams": streams, "cores": cores, "steps": args.steps, "stream_s": stream_s,
               "stream_cpu_s": stream_cpu_s, "floor_s": floor, "job_s": job_s, "ratio": job_s / floor,
               "concurrent_stream_s": concurrent_s, "shared_floor_s": shared_floor,
               "shared_ratio": job_s / shared_floor,
               "target": TARGET, "load_average": os.getloadavg()[0]}
    print(f"{'what':<40}{'seconds':>10}")
    print(f"{'one stream (this process)':<40}{stream_s:>10.1f}")
    print(f"{f'floor: x {streams} streams / {cores} cores':<40}{floor:>10.1f}")
    print(f"{f'{cores} streams at once, one a process':<40}{concurrent_s:>10.1f}")
    print(f"{f'shared floor: that x {streams} / {cores}':<40}{shared_floor:>10.1f}")
    print(f"{'ms-memopt simulate ... --out':<40}{job_s:>10.1f}")
    print(f"ratio {figures['ratio']:.2f} (target {TARGET}), {figures['shared_ratio']:.2f} against the shared floor; "
          f"load average {figures['load_average']:.2f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

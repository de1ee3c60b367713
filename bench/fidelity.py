"""Fidelity of the MindSpore pool models against the real CPU pool, and the cost of recording.

Each workload in ``bench/workloads/`` runs twice, alternating: plain, then under
``ms-memopt record`` (``VLOG_v=12906``). The recording is replayed through
``mindspore-bestfit`` (``DynamicMemPoolBestFit``'s multimap tie rule) and ``mindspore``
(``AbstractDynamicMemPool``'s address tie rule); the table gives the address match, whether
the final layout is identical, ``slowdown`` = recorded wall time / plain wall time, and
``cpu_slowdown`` = the same for the CPU time of the processes (whole process, import and
compile included, the recorder's own parsing too; on a shared machine the CPU ratio is the
steadier one). Last line: one JSON object.

Usage:
    python bench/fidelity.py                  # all workloads, default steps
    python bench/fidelity.py --steps 10 --keep out/fidelity   # keep the recordings
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from ms_memopt.allocators import create  # noqa: E402
from ms_memopt.core.events import read_jsonl  # noqa: E402
from ms_memopt.replay.replay import replay  # noqa: E402
from ms_memopt.io.traces.ms_pool_log import recorded_final_layout  # noqa: E402

# name -> (command after python, default steps); the steps give ~100k events in all
WORKLOADS = {
    "mlp_pynative": (["bench/workloads/mlp_pynative.py"], 60),
    "jit_function": (["bench/workloads/jit_function.py"], 60),
    "gpt_model_train": (["bench/workloads/gpt_model_train.py"], 40),
    "gpt_varying_seq": (["bench/workloads/gpt_varying_seq.py"], 40),
    # --no-pool-log: the plain run must not log the pool itself (the recorded one cannot anyway)
    "demo_run_varying_seq": (["-m", "ms_memopt", "run", "recipes/demo_cpu.yaml", "--no-progress",
                              "--no-report", "--no-pool-log", "--out", "{tmp}/run"], None),
}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("VLOG_v", None)
    return env


def _command(name: str, steps: int | None, tmp: str) -> list[str]:
    args, default = WORKLOADS[name]
    args = [a.replace("{tmp}", tmp) for a in args]
    steps = steps or default
    if default is None:
        return [sys.executable, *args] + (["--steps", str(steps)] if steps else [])
    return [sys.executable, *args, str(steps)]


def _timed(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child processes): on a shared machine the CPU time is
    the steadier figure (waiting for a core does not count)."""
    t0 = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(command, cwd=_REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return time.perf_counter() - t0, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="steps per workload (default: each one's)")
    parser.add_argument("--only", nargs="*", default=None, choices=list(WORKLOADS), help="workloads to run")
    parser.add_argument("--keep", default=None, help="keep the recordings in this directory")
    args = parser.parse_args(argv)
    out_dir = Path(args.keep or tempfile.mkdtemp(prefix="fidelity-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only or WORKLOADS:
        with tempfile.TemporaryDirectory() as tmp:
            command = _command(name, args.steps, tmp)
            plain, plain_cpu = _timed(command)
        with tempfile.TemporaryDirectory() as tmp:
            events = out_dir / f"{name}.jsonl"
            recorded, recorded_cpu = _timed([sys.executable, "-m", "ms_memopt", "record", "--no-progress", "--out", str(events),
                               "--", *_command(name, args.steps, tmp)])
        trace = read_jsonl(events)
        trace.final = recorded_final_layout(trace.events)
        row = {"workload": name, "events": len(trace.events),
               "allocs": sum(e.action == "alloc" for e in trace.events),
               "skipped_lines": trace.meta.get("pool_log", {}).get("skipped_lines"),
               "plain_s": round(plain, 2), "recorded_s": round(recorded, 2),
               "plain_cpu_s": round(plain_cpu, 2), "recorded_cpu_s": round(recorded_cpu, 2),
               "slowdown": round(recorded / plain, 3), "cpu_slowdown": round(recorded_cpu / plain_cpu, 3)}
        for model in ("mindspore-bestfit", "mindspore"):
            result = replay(trace, create(model))
            row[model] = {"address_match": result.address_match, "final_layout_match": result.final_layout_match,
                          "frag_ratio_max": result.frag_ratio_max}
        rows.append(row)
        print(f"{name:22s} {row['events']:>8,} events {row['allocs']:>7,} allocs  "
              f"bestfit {100 * row['mindspore-bestfit']['address_match']:6.2f}% "
              f"{'same' if row['mindspore-bestfit']['final_layout_match'] else 'DIFF'}  "
              f"address-rule {100 * row['mindspore']['address_match']:6.2f}% "
              f"{'same' if row['mindspore']['final_layout_match'] else 'diff'}  "
              f"slowdown wall {row['slowdown']:.2f}x ({plain:.1f} s -> {recorded:.1f} s), CPU "
              f"{row['cpu_slowdown']:.2f}x ({plain_cpu:.1f} s -> {recorded_cpu:.1f} s)", flush=True)
    total = sum(r["events"] for r in rows)
    allocs = sum(r["allocs"] for r in rows)
    matched = sum(r["allocs"] * r["mindspore-bestfit"]["address_match"] for r in rows)
    summary = {"events": total, "allocs": allocs, "bestfit_address_match": matched / allocs if allocs else None,
               "bestfit_final_layouts_identical": all(r["mindspore-bestfit"]["final_layout_match"] for r in rows),
               "slowdown": {r["workload"]: r["slowdown"] for r in rows},
               "cpu_slowdown": {r["workload"]: r["cpu_slowdown"] for r in rows}, "rows": rows,
               "recordings": str(out_dir)}
    print(f"total {total:,} events, {allocs:,} allocations; mindspore-bestfit address match "
          f"{100 * summary['bestfit_address_match']:.3f}%")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

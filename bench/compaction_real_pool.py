"""What CompactionCallback does to the real CPU pool, measured from a recording.

Records ``ms-memopt run`` of the demo recipe (the demo GPT, a new sequence length each step)
under ``ms-memopt record`` with ``CompactionCallback`` every ``--every`` steps and no frag
gate; the callback marks each compaction in the recording (``compaction_begin`` /
``compaction_end``). For every compaction it prints the real pool just before and just after:
live buffers (count, bytes), free total, largest free block and frag ratio, and what the
compaction itself did to the pool (allocations and frees inside the window, and how many of
its allocations are still live after it: the tensors it put into the pool). Last line: one
JSON object.

Usage:
    python bench/compaction_real_pool.py [--steps 20] [--every 5] [--keep out/compaction]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

import yaml  # noqa: E402

from ms_memopt.core.events import read_jsonl  # noqa: E402
from ms_memopt.core.metrics import measure  # noqa: E402
from ms_memopt.core.units import format_size  # noqa: E402
from ms_memopt.io.traces.ms_pool_log import recorded_final_layout  # noqa: E402


def _state(events) -> dict:
    layout = recorded_final_layout(events)
    m = measure(layout)
    live = list(layout.live_blocks())
    return {"live_buffers": len(live), "allocated": m.allocated, "free_total": m.free_total,
            "largest_free": m.largest_free, "frag_ratio": m.frag_ratio,
            "largest_live": sorted((b.size for b in live), reverse=True)[:5]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--keep", default=None, help="keep the recording and the run here")
    args = parser.parse_args(argv)
    work = Path(args.keep or tempfile.mkdtemp(prefix="compaction-real-"))
    work.mkdir(parents=True, exist_ok=True)
    recipe = yaml.safe_load((_REPO / "recipes" / "demo_cpu.yaml").read_text())
    recipe["memopt"]["compact_every"] = args.every
    recipe["memopt"].pop("compact_when_frag_above", None)
    recipe_path = work / "demo_compact.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe))
    events_path = work / "recording.jsonl"
    env = dict(os.environ, PYTHONPATH=str(_REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "ms_memopt", "record", "--no-progress", "--out", str(events_path),
                           "--", sys.executable, "-m", "ms_memopt", "run", str(recipe_path), "--steps",
                           str(args.steps), "--no-progress", "--no-report", "--out", str(work / "run")],
                          cwd=_REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"recording failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    events = read_jsonl(events_path).events
    rows = []
    begin = None
    for index, event in enumerate(events):
        if event.action != "mark":
            continue
        if event.tag == "compaction_begin":
            begin = index
        elif event.tag == "compaction_end" and begin is not None:
            window = events[begin + 1:index]
            made = {e.id: e.size for e in window if e.action == "alloc"}
            freed = [e.id for e in window if e.action == "free"]
            still = {i for i in made if i not in set(freed)}
            step = next((e.step for e in reversed(events[:begin]) if e.action == "step"), None)
            rows.append({"step": step, "before": _state(events[:begin]), "after": _state(events[:index]),
                         "window_allocs": len(made), "window_alloc_bytes": sum(made.values()),
                         "window_frees": len(freed), "left_live_in_pool": len(still),
                         "left_live_bytes": sum(made[i] for i in still)})
            begin = None
    print(f"demo GPT on the real CPU pool, {args.steps} steps, CompactionCallback every {args.every} "
          f"({len(events):,} recorded events)")
    print(f"{'step':>5} {'live bufs':>10} {'allocated':>11} {'free':>11} {'largest':>11} {'frag':>8}   "
          f"{'in-window allocs/frees':>22} {'left in pool':>14}")
    for r in rows:
        for when in ("before", "after"):
            s = r[when]
            frag = "n/a" if s["frag_ratio"] is None else f"{s['frag_ratio']:.5f}"
            tail = (f"{r['window_allocs']:>10} / {r['window_frees']:<10} "
                    f"{r['left_live_in_pool']:>4} ({format_size(r['left_live_bytes'])})") if when == "after" else ""
            print(f"{r['step'] if when == 'before' else '':>5} {s['live_buffers']:>10} {format_size(s['allocated']):>11} "
                  f"{format_size(s['free_total']):>11} {format_size(s['largest_free']):>11} {frag:>8}   {tail}")
    print(json.dumps({"steps": args.steps, "every": args.every, "events": len(events), "compactions": rows,
                      "recording": str(events_path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

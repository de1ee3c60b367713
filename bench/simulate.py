"""Benchmark: 1000 steps of the 100B recipe under all three policies, one seed.

Target (issue 3): at most 60 s on the project machine (2 shared cores). Prints a table, then
as the last line one JSON object: {"seconds", "events_per_s", ...}.

Usage: python bench/simulate.py [--steps 1000] [--seed 0] [--recipe PATH]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ms_memopt.recipe import load_recipe  # noqa: E402
from ms_memopt.simulate import POLICIES, config_from_recipe, simulate  # noqa: E402
from ms_memopt.workload import spec_from_recipe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "dense_100b_1024x910c.yaml"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    recipe = load_recipe(args.recipe)
    spec = spec_from_recipe(recipe)
    cfg = config_from_recipe(recipe, steps=args.steps, seed=args.seed)
    started = time.perf_counter()
    results = simulate(spec, cfg, policies=POLICIES, seeds=[args.seed])
    seconds = time.perf_counter() - started
    events = sum(s.seeds[0].events for s in results.values())
    print(f"{'policy':<9} {'oom_step':>8} {'steps run':>9} {'events':>10} {'seconds':>8}")
    for policy, summary in results.items():
        r = summary.seeds[0]
        run = r.oom_step if r.oom_step is not None else args.steps
        print(f"{policy:<9} {str(r.oom_step or '-'):>8} {run:>9} {r.events:>10} {r.seconds:>8.1f}")
    print(f"total {seconds:.1f} s for {events} events (target: <= 60 s)")
    print(json.dumps({"seconds": round(seconds, 2), "events_per_s": round(events / seconds),
                      "steps": args.steps, "seed": args.seed, "events": events,
                      "oom_step": {p: s.seeds[0].oom_step for p, s in results.items()}}))


if __name__ == "__main__":
    main()

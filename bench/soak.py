"""Soak (issue 9): a 10,000-step simulation of the 100B recipe in bounded memory.

Runs the ``pool`` policy (which never dies, so all steps run) and the ``baseline`` policy
until its OOM, streaming the timeline to a temporary file, and prints the process's resident
memory (RSS) against the step count. Memory must stay flat: events are generated per step
and dropped, samples go to the file, nothing accumulates per step.

Last line: one JSON object {"steps", "rss_mib": {step: MiB}, "peak_rss_mib": {step: MiB},
"rss_growth_mib", "seconds"}.

The allocator is set up as the recipe's ``memopt.allocator`` says (``--allocator-option``
overrides it; see docs/simulation.md).

Usage: python bench/soak.py [--steps 10000] [--every 1000] [--allocator-option KEY=VALUE]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ms_memopt.config.recipe import load_recipe
from ms_memopt.simulation.spec import config_from_recipe
from ms_memopt.simulation.simulate import simulate
from ms_memopt.simulation.spec import spec_from_recipe


def _rss_mib(field: str = "VmRSS") -> float:
    """Resident memory of this process (``VmRSS``) or its peak so far (``VmHWM``), MiB."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "dense_100b_1024x910c.yaml"))
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--allocator-option", action="append", default=None, metavar="KEY=VALUE")
    args = parser.parse_args()
    from ms_memopt.allocators.options import parse_allocator_options
    recipe = load_recipe(args.recipe)
    spec = spec_from_recipe(recipe)
    cfg = config_from_recipe(recipe, steps=args.steps)
    cfg.allocator_options.update(parse_allocator_options(cfg.allocator, args.allocator_option or []))
    rss: dict[int, float] = {0: _rss_mib()}
    peak: dict[int, float] = {0: _rss_mib("VmHWM")}

    def on_step(step: int) -> None:
        if step % args.every == 0:
            rss[step] = _rss_mib()
            peak[step] = _rss_mib("VmHWM")

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        with open(Path(tmp) / "timeline.jsonl", "w", encoding="utf-8") as timeline:
            results = simulate(spec, cfg, policies=("baseline", "pool"), seeds=[0],
                               timeline=timeline, on_step=on_step)
        timeline_bytes = (Path(tmp) / "timeline.jsonl").stat().st_size
    seconds = time.perf_counter() - started
    print(f"{'step':>6} {'RSS (MiB)':>10} {'peak RSS (MiB)':>15}")
    for step, mib in rss.items():
        print(f"{step:>6} {mib:>10.1f} {peak[step]:>15.1f}")
    for policy, summary in results.items():
        r = summary.seeds[0]
        print(f"{policy}: oom_step {r.oom_step}, events {r.events}")
    first = rss.get(args.every, rss[0])
    growth = max(rss.values()) - first
    print(f"RSS growth after step {args.every}: {growth:.1f} MiB; timeline {timeline_bytes / 2**20:.1f} MiB on disk; "
          f"{seconds:.0f} s")
    print(json.dumps({"steps": args.steps, "rss_mib": {str(k): round(v, 1) for k, v in rss.items()},
                      "peak_rss_mib": {str(k): round(v, 1) for k, v in peak.items()},
                      "rss_growth_mib": round(growth, 1), "seconds": round(seconds, 1),
                      "events": sum(s.seeds[0].events for s in results.values())}))


if __name__ == "__main__":
    main()

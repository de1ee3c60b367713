"""Benchmark: 1000 steps of the 100B recipe under all three policies, one seed.

Target (issue 17): at most 10 s in one process. The run is made twice in the same process: with
the allocator models as ``create()`` makes them (the compiled fast path where there is one,
ms_memopt.allocators.fast) and with the pure-Python reference models (``fast=False``); both
must give the same results. Prints a table, then as the last line one JSON object:
{"seconds", "cpu_seconds", "reference_seconds", "reference_cpu_seconds", "ratio", "events_per_s", ...}
(``cpu_seconds``: this process's CPU time, which a busy machine skews less than the wall clock).

Usage: python bench/simulate.py [--steps 1000] [--seed 0] [--recipe PATH] [--parts]

``--parts`` splits the CPU seconds of one lock-step run (compiled models) into event generation
and each policy's share (where the time goes; docs/simulation.md) and prints one JSON line.

``--study`` runs the study of docs/simulation.md instead (10 seeds x 3 policies, controls,
ablation, sensitivity; two worker processes) and prints its tables and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ms_memopt.config.recipe import load_recipe
from ms_memopt.simulation.simulate import POLICIES, simulate
from ms_memopt.simulation.spec import config_from_recipe
from ms_memopt.simulation.spec import spec_from_recipe

GiB = 2**30


def _options(items, allocator: str = "mindspore"):
    """``--allocator-option`` items, typed per option of the recipe's allocator model."""
    from ms_memopt.allocators.options import parse_allocator_options
    return parse_allocator_options(allocator, items)


def _one(job):
    """Worker: one (label, spec, cfg, policies, seed) -> (label, seed, {policy: result dict})."""
    label, spec, cfg, policies, seed = job
    out = simulate(spec, cfg, policies=policies, seeds=[seed])
    return label, seed, {p: s.seeds[0].to_dict() for p, s in out.items()}


def _median(values):
    ooms = [v for v in values if v is not None]
    if 2 * len(ooms) < len(values):
        return None
    padded = sorted(ooms) + [float("inf")] * (len(values) - len(ooms))
    med = statistics.median(padded)
    return None if med == float("inf") else med


def study(args) -> None:
    from dataclasses import replace

    recipe = load_recipe(args.recipe)
    spec = spec_from_recipe(recipe)
    cfg = config_from_recipe(recipe, steps=args.steps)
    cfg.allocator_options.update(args.options)
    print(f"allocator {cfg.allocator} {cfg.allocator_options}, capacity {cfg.capacity / GiB:.0f} GiB, "
          f"{args.steps} steps, seeds 0..{args.seeds - 1}")
    seeds = list(range(args.seeds))
    few = seeds[:3]
    policies = tuple(args.policy.split(","))
    jobs = [("main", spec, cfg, policies, s) for s in seeds]
    if args.main_only:
        return _run_jobs(jobs, args)
    jobs += [("control: all off", replace(spec, enabled=False), cfg, ("baseline",), 0)]
    bounded = replace(spec, seq_buckets=(2048, 4096, 6144, 8192), cache_max_shapes=64)
    jobs += [("control: bounded", bounded, cfg, ("baseline",), s) for s in seeds]
    for mech in ("dynamic_seq", "shape_cache", "extra_allocs", "comm_jitter"):
        jobs += [(f"ablation: no {mech}", spec.without(mech), cfg, ("baseline",), s) for s in seeds]
    more_cap = replace(cfg, capacity=cfg.capacity + 8 * GiB)
    jobs += [("sensitivity: capacity +8 GiB", spec, more_cap, ("baseline",), s) for s in few]
    jobs += [("sensitivity: seq_align / 2", replace(spec, seq_align=max(1, spec.seq_align // 2)), cfg,
              ("baseline",), s) for s in few]
    jobs += [("sensitivity: micro_batches x 1.5", replace(spec, micro_batches=spec.micro_batches * 3 // 2),
              cfg, ("baseline",), s) for s in few]
    jobs += [("sensitivity: reference", spec, cfg, ("baseline",), s) for s in few]
    return _run_jobs(jobs, args)


def _run_jobs(jobs, args) -> None:
    from concurrent.futures import ProcessPoolExecutor

    started = time.perf_counter()
    rows: dict[str, dict[str, list]] = {}
    from concurrent.futures import as_completed

    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(_one, job) for job in jobs]
        for future in as_completed(futures):
            label, seed, result = future.result()
            for policy, r in result.items():
                rows.setdefault(f"{label} [{policy}]", []).append(r)
                # progress on stderr: one line per finished run
                print(f"# {time.perf_counter() - started:6.0f} s  {label} [{policy}] seed {seed}: "
                      f"oom_step {r['oom_step']} {r['oom_kind'] or ''} "
                      f"free@oom {((r['free_total_at_oom'] or 0) / GiB):.1f} GiB, "
                      f"used@oom {((r['allocated_at_oom'] or 0) / GiB):.1f} GiB, peak "
                      f"{r['peak_allocated'] / GiB:.1f} GiB, compactions {r['compactions']}, "
                      f"frag_after {r['frag_after_compaction']}, region_frag {r['region_frag_max']}",
                      file=sys.stderr, flush=True)
    for runs in rows.values():
        runs.sort(key=lambda r: r["seed"])
    table = {}
    print(f"{'run':<48} {'seeds':>5} {'OOMs':>4} {'median':>7} {'min':>5} {'max':>5} {'kinds':<18} "
          f"{'free@oom GiB':>12} {'used@oom':>8} {'peak GiB':>8} {'frag_max':>8} {'frag_after_c':>12} {'region_frag':>11}")
    for name, runs in rows.items():
        steps = [r["oom_step"] for r in runs]
        ooms = [x for x in steps if x is not None]
        kinds = sorted({r["oom_kind"] for r in runs if r["oom_kind"]})
        free = [r["free_total_at_oom"] / GiB for r in runs if r["free_total_at_oom"] is not None]
        used = [r["allocated_at_oom"] / GiB for r in runs if r["allocated_at_oom"] is not None]
        fam = [r["frag_after_compaction"] for r in runs if r["frag_after_compaction"] is not None]
        reg = [r["region_frag_max"] for r in runs if r["region_frag_max"] is not None]
        fmax = [r["frag_ratio_max"] for r in runs if r["frag_ratio_max"] is not None]
        entry = {"seeds": len(runs), "ooms": len(ooms), "oom_steps": steps, "median_oom_step": _median(steps),
                 "oom_kinds": kinds, "free_total_at_oom_gib": [round(f, 1) for f in free],
                 "allocated_at_oom_gib": [round(u, 1) for u in used],
                 "peak_allocated_gib": round(max(r["peak_allocated"] for r in runs) / GiB, 1),
                 "frag_ratio_max": round(max(fmax), 2) if fmax else None,
                 "frag_after_compaction_max": round(max(fam), 3) if fam else None,
                 "frag_after_compaction_segment_max": max((r["frag_after_compaction_segment_max"] or 0) for r in runs),
                 "largest_free_after_compaction_min_gib": min(((r["largest_free_after_compaction_min"] or 0) / GiB
                                                              for r in runs), default=None),
                 "compactions": [r["compactions"] for r in runs],
                 "region_frag_max": round(max(reg), 3) if reg else None,
                 "largest_free_by_window_gib_seed0": [round(x / GiB, 2) for x in runs[0]["largest_free_by_window"]]}
        table[name] = entry
        print(f"{name:<48} {len(runs):>5} {len(ooms):>4} {entry['median_oom_step']!s:>7} "
              f"{min(ooms, default='-')!s:>5} {max(ooms, default='-')!s:>5} {','.join(kinds) or '-':<18} "
              f"{(f'{min(free):.1f}-{max(free):.1f}' if free else '-'):>12} "
              f"{(f'{statistics.median(used):.1f}' if used else '-'):>8} {entry['peak_allocated_gib']:>8} "
              f"{entry['frag_ratio_max']!s:>8} {entry['frag_after_compaction_max']!s:>12} "
              f"{entry['region_frag_max']!s:>11}")
    seconds = time.perf_counter() - started
    print(f"study: {len(jobs)} jobs, {seconds:.0f} s")
    print(json.dumps({"seconds": round(seconds, 1), "steps": args.steps, "study": table}))


def parts(args) -> None:
    """CPU seconds (this process) of one lock-step run: generation, each policy's feed."""
    from ms_memopt.simulation.simulate import _Run
    from ms_memopt.workload.step import StepWorkload

    recipe = load_recipe(args.recipe)
    spec = spec_from_recipe(recipe)
    cfg = config_from_recipe(recipe, steps=args.steps, seed=args.seed)
    cfg.allocator_options.update(args.options)
    clock = time.process_time
    started = clock()
    runs = [_Run(spec, policy, cfg, args.seed, None) for policy in POLICIES]
    gen = StepWorkload(spec, args.seed)
    cpu = dict.fromkeys(POLICIES, 0.0)
    generation = 0.0
    alive = runs
    for step in range(args.steps + 1):
        if not alive:
            break
        t = clock()
        batch = gen.step_rows(step) if step else gen.prologue_rows()
        generation += clock() - t
        still = []
        for run in alive:
            t = clock()
            if run.feed(step, batch):
                still.append(run)
            cpu[run.result.policy] += clock() - t
        alive = still
    total = clock() - started
    print(json.dumps({"cpu_seconds": round(total, 2), "generation": round(generation, 2),
                      **{p: round(v, 2) for p, v in cpu.items()},
                      "oom_step": {r.result.policy: r.result.oom_step for r in runs},
                      "pool_evictions": getattr(runs[POLICIES.index("pool")].model, "evictions", None)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "dense_100b_1024x910c.yaml"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allocator-option", action="append", default=None, metavar="KEY=VALUE",
                        help="allocator option overriding the recipe's memopt.allocator (see docs/simulation.md)")
    parser.add_argument("--study", action="store_true", help="run the docs/simulation.md study")
    parser.add_argument("--seeds", type=int, default=10, help="seeds of the study")
    parser.add_argument("--policy", default=",".join(POLICIES), help="study: policies of the main runs")
    parser.add_argument("--main-only", action="store_true", help="study: only the 3 policies x seeds")
    parser.add_argument("--workers", type=int, default=2, help="worker processes of the study")
    parser.add_argument("--parts", action="store_true", help="CPU seconds of generation and of each policy")
    args = parser.parse_args()
    args.options = _options(args.allocator_option or [])
    if args.study:
        study(args)
        return
    if args.parts:
        parts(args)
        return
    recipe = load_recipe(args.recipe)
    spec = spec_from_recipe(recipe)
    cfg = config_from_recipe(recipe, steps=args.steps, seed=args.seed)
    cfg.allocator_options.update(args.options)
    timings, outcomes = {}, {}
    for label, fast in (("reference", False), ("fast", None)):
        cfg.allocator_options["fast"] = fast
        started, cpu_started = time.perf_counter(), time.process_time()
        results = simulate(spec, cfg, policies=POLICIES, seeds=[args.seed])
        timings[label] = (time.perf_counter() - started, time.process_time() - cpu_started)
        outcomes[label] = {p: {k: v for k, v in s.seeds[0].to_dict().items() if k != "seconds"}
                           for p, s in results.items()}
    seconds, cpu_seconds = timings["fast"]
    ref_seconds, ref_cpu = timings["reference"]
    same = outcomes["fast"] == outcomes["reference"]
    events = sum(s.seeds[0].events for s in results.values())
    print(f"{'policy':<9} {'oom_step':>8} {'steps run':>9} {'events':>10} {'seconds':>8}")
    for policy, summary in results.items():
        r = summary.seeds[0]
        run = r.oom_step if r.oom_step is not None else args.steps
        print(f"{policy:<9} {r.oom_step or '-'!s:>8} {run:>9} {r.events:>10} {r.seconds:>8.1f}")
    print(f"total {seconds:.1f} s ({cpu_seconds:.1f} s CPU) for {events} events (target: <= 10 s); pure-Python "
          f"reference {ref_seconds:.1f} s ({ref_cpu:.1f} s CPU) in the same run: ratio {seconds / ref_seconds:.2f} "
          f"({cpu_seconds / ref_cpu:.2f} CPU); results {'identical' if same else 'DIFFER'}")
    print(json.dumps({"seconds": round(seconds, 2), "cpu_seconds": round(cpu_seconds, 2),
                      "reference_seconds": round(ref_seconds, 2), "reference_cpu_seconds": round(ref_cpu, 2),
                      "ratio": round(seconds / ref_seconds, 3), "cpu_ratio": round(cpu_seconds / ref_cpu, 3),
                      "identical_results": same, "events_per_s": round(events / seconds),
                      "steps": args.steps, "seed": args.seed, "events": events,
                      "oom_step": {p: s.seeds[0].oom_step for p, s in results.items()}}))


if __name__ == "__main__":
    main()

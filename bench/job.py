"""The job-level study of docs/simulation.md: the 100B job dies at its first rank.

Every run is a *job*: the 16 data-parallel rank streams of the first pipeline stage (the
fullest under 1F1B: 82.4 GiB planned; every OOM of the job happens there) plus, in the main
runs, one stream of each later stage (74.0 GiB down to 39.8 GiB) to show they survive. The job
OOM step is the earliest over its ranks; a policy saves the job only if every rank survives.

* ``--calibrate``: baseline only, job seeds 0..N-1 (``--job-seeds``): the job OOM steps the
  recipe's calibration aims at the field report's step 437.
* ``--study``: the main runs (job seed 0 under baseline, compact and pool; job seeds 1..N-1
  under the baseline; one stream of each later stage under every policy), the controls (every mechanism off:
  one stream, since every stream of a stage is then the same; bounded variation), the ablation
  (one mechanism off) and the sensitivity checks (capacity +8 GiB, ``seq_align`` halved, 1.5x
  micro-batches) at job level (job seed 0).

Prints a table, then as the last line one JSON object with every run's job figures.

Usage: python bench/job.py --calibrate [--job-seeds 3] [--steps 1000]
       python bench/job.py --study [--job-seeds 3] [--steps 1000] [--workers N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ms_memopt.config.recipe import load_recipe
from ms_memopt.simulation.spec import JobSpec, job_from_recipe, rank_streams
from ms_memopt.simulation.job import median_job_oom_step, simulate_jobs

GiB = 2**30


def _job(recipe, seed: int, steps: int, policies, label: str, *, later_stages: bool = False,
         spec_change=None, cfg_change=None) -> JobSpec:
    """The first stage's 16 streams (and one stream of each later stage), with a variant applied
    to every stage's workload (``spec_change``) or to the simulator settings (``cfg_change``)."""
    job = job_from_recipe(recipe, policies=policies, seed=seed, steps=steps, label=label)
    streams = rank_streams(recipe, seed=seed, stages=[0])
    if later_stages:
        later = list(range(1, recipe.parallel.pipeline_stage))
        picked = rank_streams(recipe, seed=seed, stages=later, ranks=len(later))
        streams += picked
    job.streams = streams
    if spec_change is not None:
        job.specs = {stage: spec_change(spec) for stage, spec in job.specs.items()}
    if cfg_change is not None:
        job.cfg = cfg_change(job.cfg)
    return job


def _row(job: JobSpec, result) -> dict:
    d = result.to_dict(rank_results=False)
    first = d["first_rank"] or {}
    dist = d["distribution"]
    stage0 = dist["by_stage"].get("0", {})
    return {"run": job.label, "policy": result.policy, "job_seed": job.seed, "ranks": d["ranks"],
            "job_oom_step": d["job_oom_step"], "job_oom_rank": d["job_oom_rank"], "job_oom_stage": d["job_oom_stage"],
            "oom_ranks": dist["oom_ranks"], "stage0_oom_steps": sorted(
                o.result.oom_step for o in result.outcomes if o.stream.stage == 0 and o.result.oom_step is not None),
            "stage0_median": stage0.get("oom_step_median"),
            "later_stage_ooms": sum(1 for o in result.outcomes if o.stream.stage > 0 and o.result.oom_step is not None),
            "oom_kind": first.get("oom_kind"), "oom_tag": first.get("oom_tag"),
            "free_total_at_oom_gib": round(first["free_total_at_oom"] / GiB, 1) if first.get("free_total_at_oom") else None,
            "allocated_at_oom_gib": round(first["allocated_at_oom"] / GiB, 1) if first.get("allocated_at_oom") else None,
            "largest_free_min_gib": round(first["largest_free_min"] / GiB, 2) if first.get("largest_free_min") else None,
            "compactions": first.get("compactions"),
            "min_largest_free_over_ranks_gib": round(min(o.result.largest_free_min or 0 for o in result.outcomes) / GiB, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "dense_100b_1024x910c.yaml"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--job-seeds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--executor", default="local")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--calibrate", action="store_true")
    mode.add_argument("--study", action="store_true")
    parser.add_argument("--parts", default="main,calibration,later,controls,ablation,sensitivity",
                        help="--study: which parts to run")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe)
    seeds = list(range(args.job_seeds))
    jobs: list[JobSpec] = []
    if args.calibrate:
        jobs += [_job(recipe, s, args.steps, ("baseline",), "calibration") for s in seeds]
    else:
        parts = set(args.parts.split(","))
        # main: job seed 0 under every policy; calibration: the other job seeds under the
        # baseline; later: one stream of each later stage under every policy
        if "main" in parts:
            jobs.append(_job(recipe, 0, args.steps, ("baseline", "compact", "pool"), "main"))
        if "calibration" in parts:
            jobs += [_job(recipe, s, args.steps, ("baseline",), "main") for s in seeds[1:]]
        if "later" in parts:
            later = _job(recipe, 0, args.steps, ("baseline", "compact", "pool"), "later stages", later_stages=True)
            later.streams = [s for s in later.streams if s.stage > 0]
            jobs.append(later)
        if "controls" in parts:
            off = _job(recipe, 0, args.steps, ("baseline",), "control: all off",
                       spec_change=lambda sp: replace(sp, enabled=False))
            off.streams = off.streams[:1]     # with every mechanism off the seed changes nothing
            jobs.append(off)
            jobs.append(_job(recipe, 0, args.steps, ("baseline",), "control: bounded",
                             spec_change=lambda sp: replace(sp, seq_buckets=(2048, 4096, 6144, 8192),
                                                            cache_max_shapes=64)))
        if "ablation" in parts:
            for mech in ("dynamic_seq", "shape_cache", "extra_allocs", "comm_jitter"):
                jobs.append(_job(recipe, 0, args.steps, ("baseline",), f"ablation: no {mech}",
                                 spec_change=lambda sp, m=mech: sp.without(m)))
        if "sensitivity" in parts:
            jobs.append(_job(recipe, 0, args.steps, ("baseline",), "sensitivity: capacity +8 GiB",
                             cfg_change=lambda c: replace(c, capacity=c.capacity + 8 * GiB)))
            jobs.append(_job(recipe, 0, args.steps, ("baseline",), "sensitivity: seq_align / 2",
                             spec_change=lambda sp: replace(sp, seq_align=max(1, sp.seq_align // 2))))
            jobs.append(_job(recipe, 0, args.steps, ("baseline",), "sensitivity: micro_batches x 1.5",
                             spec_change=lambda sp: replace(sp, micro_batches=sp.micro_batches * 3 // 2)))
    total = sum(len(j.streams) for j in jobs)
    started = time.perf_counter()

    def on_stream(done: int, of: int) -> None:
        print(f"# {time.perf_counter() - started:6.0f} s  {done}/{of} rank streams", file=sys.stderr, flush=True)

    results = simulate_jobs(jobs, executor=args.executor, workers=args.workers, on_stream=on_stream)
    seconds = time.perf_counter() - started
    rows = [_row(job, res[p]) for job, res in zip(jobs, results) for p in job.policies]
    print(f"{recipe.source}: {args.steps} steps, {total} rank streams in {len(jobs)} jobs, {seconds:.0f} s")
    print(f"{'run':<34} {'policy':<9} {'seed':>4} {'ranks':>5} {'job_oom':>7} {'rank':>5} {'oom/ranks':>9} "
          f"{'stage-0 median':>14} {'later':>5} {'kind':<13} {'free@oom':>8} {'used@oom':>8}  stage-0 OOM steps")
    for r in rows:
        print(f"{r['run']:<34} {r['policy']:<9} {r['job_seed']:>4} {r['ranks']:>5} {str(r['job_oom_step'] or '-'):>7} "
              f"{str(r['job_oom_rank'] if r['job_oom_rank'] is not None else '-'):>5} "
              f"{r['oom_ranks']:>4}/{r['ranks']:<4} {str(r['stage0_median'] or '-'):>14} {r['later_stage_ooms']:>5} "
              f"{(r['oom_kind'] or '-'):<13} {str(r['free_total_at_oom_gib'] or '-'):>8} "
              f"{str(r['allocated_at_oom_gib'] or '-'):>8}  {r['stage0_oom_steps']}")
    summary = {}
    for label in dict.fromkeys(j.label for j in jobs):
        for policy in ("baseline", "compact", "pool"):
            per_seed = [res[policy] for job, res in zip(jobs, results) if job.label == label and policy in res]
            if per_seed:
                steps = [r.job_oom_step for r in per_seed]
                summary[f"{label} [{policy}]"] = {
                    "job_oom_steps": steps, "median_job_oom_step": median_job_oom_step(per_seed),
                    "saved_jobs": sum(s is None for s in steps), "jobs": len(steps)}
    for name, s in summary.items():
        dead = [x for x in s["job_oom_steps"] if x is not None]
        print(f"{name:<46} job OOM steps {s['job_oom_steps']} median {s['median_job_oom_step']} "
              f"(mean of the dead {statistics.mean(dead):.0f})" if dead else
              f"{name:<46} every job survives {args.steps} steps ({s['jobs']} jobs)")
    print(json.dumps({"seconds": round(seconds, 1), "steps": args.steps, "rank_streams": total,
                      "summary": summary, "rows": rows}))


if __name__ == "__main__":
    main()

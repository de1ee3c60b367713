"""``make demo``: train the CPU demo, simulate the 100B / 910C job, plan it, write one report.

``python -m ms_memopt.demo --out out/demo`` runs, in order:

1. ``ms-memopt run recipes/demo_cpu.yaml`` on CPU (MindSpore) into ``OUT/run``;
2. the 100B recipe's per-card plan (``ms-memopt plan``) into ``OUT/plan``;
3. the 100B recipe's simulation into ``OUT/simulation``: the 16 rank streams of the first
   pipeline stage under the baseline (``--sim-steps`` steps, on local processes) find the rank
   the job dies at; that rank is then simulated under the baseline, compaction and pool-mode
   policies (``--seeds`` job seeds, modest so that the whole demo takes a few minutes on 2
   cores), with the pool layout just before the watched AllReduce request at a few steps and
   at an OOM (the memory map), collected from that same run by a hook;
4. ``ms-memopt doctor`` on the log of a MindSpore CPU run that dies of fragmentation, made then
   (:mod:`ms_memopt.mindspore.crash_demo`; with ``--skip-run`` the one kept in tests/data) into ``OUT/crash``;
5. ``OUT/report.md``: the reports of :func:`ms_memopt.report.build.build_report` under one
   heading, with every figure and the time each part took.

Example:
    python -m ms_memopt.demo --out out/demo
    python -m ms_memopt.demo --out /tmp/demo --sim-steps 200 --seeds 1 --skip-run
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from ms_memopt.analysis.estimate import estimate
from ms_memopt.config.recipe import Recipe, load_recipe
from ms_memopt.core.errors import InputError
from ms_memopt.core.units import format_size
from ms_memopt.simulation.simulate import POLICIES, simulate
from ms_memopt.simulation.spec import config_from_recipe
from ms_memopt.simulation.snapshots import LayoutCollector
from ms_memopt.simulation.spec import spec_from_recipe
from ms_memopt.io.layouts import write_layouts
from ms_memopt.report.build import build_report

__all__ = ["main"]

_REPO = Path(__file__).resolve().parents[1]
CPU_RECIPE = _REPO / "recipes" / "demo_cpu.yaml"
BIG_RECIPE = _REPO / "recipes" / "dense_100b_1024x910c.yaml"


def _section(markdown: str, folder: str) -> list[str]:
    """A sub-report, headings one level down and figure paths relative to the demo's report."""
    lines = []
    for line in markdown.splitlines():
        if line.startswith("#"):
            line = "#" + line
        line = re.sub(r"\]\(([^)/]+\.png)\)", rf"]({folder}/\1)", line)
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ms_memopt.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/demo", help="output directory (default: out/demo)")
    parser.add_argument("--sim-steps", type=int, default=500, help="simulated steps (default: 500)")
    parser.add_argument("--seeds", type=int, default=1, help="simulation seeds (default: 1)")
    parser.add_argument("--run-steps", type=int, default=None, help="training steps (default: the recipe's)")
    parser.add_argument("--skip-run", action="store_true", help="no MindSpore training (simulation and plan only)")
    args = parser.parse_args(argv)
    try:
        return _demo(args)
    except InputError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2


def _demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    parts: list[tuple[str, str]] = []

    if not args.skip_run:
        print(f"[1/3] training {CPU_RECIPE.name} on CPU (MindSpore) ...", flush=True)
        t0 = time.perf_counter()
        from ms_memopt.cli.run_cmd import host_memory_check

        recipe = load_recipe(CPU_RECIPE)
        check = host_memory_check(recipe)
        if not check.fits:
            raise InputError(f"needs {format_size(check.needed)}, {format_size(check.available)} available",
                             source=str(CPU_RECIPE))
        from ms_memopt.mindspore import poolcapture
        run_dir = out / "run"
        poolcapture.start(run_dir / poolcapture.LOG_NAME)   # scans of the real CPU pool: before MindSpore

        from ms_memopt.mindspore.standalone import (
            run_standalone,  # MindSpore is imported only here
        )

        result = run_standalone(recipe, run_dir, device="cpu", steps=args.run_steps, progress=sys.stderr.isatty())
        (run_dir / "plan.json").write_text(json.dumps(estimate(recipe).to_dict()), encoding="utf-8")
        build_report(run_dir, title=f"Training {CPU_RECIPE.name} on CPU")
        timings["train (MindSpore, CPU)"] = time.perf_counter() - t0
        parts.append(("run", f"Training {CPU_RECIPE.name} on CPU"))
        print(f"      loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} in {len(result.losses)} steps, "
              f"{timings['train (MindSpore, CPU)']:.0f} s", flush=True)

        print("      learning the GPT's step template from its own pool log, simulating it where it fragments ...",
              flush=True)
        t0 = time.perf_counter()
        learned = _learned_model(run_dir, out / "learned", min(args.sim_steps, 200))
        timings["learned template: learn + simulate"] = time.perf_counter() - t0
        if learned is not None:
            parts.append(("learned", "The CPU GPT's own steps, learned from its recording"))

    print(f"[2/3] planning {BIG_RECIPE.name} ...", flush=True)
    t0 = time.perf_counter()
    big = load_recipe(BIG_RECIPE)
    plan_dir = out / "plan"
    plan_dir.mkdir(parents=True, exist_ok=True)
    (plan_dir / "plan.json").write_text(json.dumps(estimate(big).to_dict()), encoding="utf-8")
    build_report(plan_dir, title=f"Plan of {BIG_RECIPE.name}")
    timings["plan"] = time.perf_counter() - t0
    parts.append(("plan", f"Plan of {BIG_RECIPE.name}"))

    print(f"[3/3] simulating {BIG_RECIPE.name}: {args.sim_steps} steps x {args.seeds} seed(s) x 3 policies ...",
          flush=True)
    t0 = time.perf_counter()
    sim_dir = out / "simulation"
    sim_dir.mkdir(parents=True, exist_ok=True)
    scans = big.memopt.scan_every
    # the memory map: a few steps early on (the layout settles within a few hundred steps) and
    # any OOM, taken by the same simulation run
    streams = _first_ranks(big, args.sim_steps, args.seeds)
    collector = LayoutCollector([s for s in (1, scans, 2 * scans) if s <= args.sim_steps], seed=streams[0].seed)
    _simulate(big, sim_dir, args.sim_steps, streams, collector)
    timings["simulate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_layouts(sim_dir / "layouts.jsonl", collector.snapshots())
    build_report(sim_dir, title=f"Simulation of {BIG_RECIPE.name}",
                 memory_map_title=f"{BIG_RECIPE.name}: the pool just before the watched AllReduce request")
    timings["memory map + report"] = time.perf_counter() - t0
    parts.append(("simulation", f"Simulation of {BIG_RECIPE.name}"))

    t0 = time.perf_counter()
    if _crash_doctor(out / "crash", real=not args.skip_run):     # doctor on a failed run's log
        timings["doctor on a failed run's log"] = time.perf_counter() - t0
        parts.append(("crash", "doctor on a failed run's log"))

    total = time.perf_counter() - started
    lines = ["# ms-memopt demo", "",
             "What `make demo` did on this machine (after the install), and how long each part took:", ""]
    lines += ["| part | seconds |", "|---|---|"]
    lines += [f"| {name} | {sec:.1f} |" for name, sec in timings.items()]
    lines += [f"| **total** | **{total:.1f}** |", ""]
    for folder, _ in parts:
        lines += _section((out / folder / "report.md").read_text(encoding="utf-8"), folder)
        lines.append("")
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"report: {report} ({total:.0f} s)")
    return 0


def _crash_doctor(out: Path, *, real: bool) -> bool:
    """``ms-memopt doctor`` on the log of a run that died of fragmentation: a real MindSpore CPU OOM
    made now (:mod:`ms_memopt.mindspore.crash_demo`), or without MindSpore the one kept in tests/data."""
    from ms_memopt.cli.doctor_logs_cmd import write_log_report
    from ms_memopt.doctor.crash_logs import diagnose_log

    kept = _REPO / "tests" / "data" / "crash_logs" / "ms2.10_cpu_fragmentation_glog1.log"
    print("[+] doctor on a failed run's log: " + ("a MindSpore CPU run that dies of fragmentation ..." if real
                                                  else f"{kept.name} ..."), flush=True)
    if real:
        from ms_memopt.mindspore.crash_demo import run_crash

        log = run_crash(out)
    elif kept.is_file():
        log = kept
    else:
        return False
    diagnosis = diagnose_log(log)
    if not diagnosis.reports:
        print(f"      no OOM in {log} (the run did not fail as planned)", flush=True)
        return False
    write_log_report(diagnosis, out)
    print(f"      {log}: {diagnosis.verdict.text}", flush=True)
    if diagnosis.remedies:
        print(f"      first remedy: {diagnosis.remedies[0].line}", flush=True)
    return True


def _learned_model(run_dir: Path, out: Path, steps: int) -> Path | None:
    """Learn the trained GPT's step template from the run's pool log (``run`` marks each step
    with its ``seq`` and ``batch``), then simulate that model's own steps, their lengths drawn
    by the demo recipe's rule, on the recorded pool's model (``mindspore-bestfit``) under the
    three policies, at the largest capacity (a step of 2% of the peak reserved) where the
    baseline dies of fragmentation and another policy survives (else the largest where the
    baseline dies): the report shows its timeline and memory map. The allocations ``learn``
    recognises as MindSpore's own leak (CPU PyNative op arguments never freed) are left out:
    the model's memory is simulated, not the runtime's."""
    import copy

    from ms_memopt.config.recipe import recipe_from_dict
    from ms_memopt.templates.template import learn_files, save_template
    from ms_memopt.io.traces.ms_pool_log import LOG_NAME
    from ms_memopt.io.yamltext import parse_yaml

    out.mkdir(parents=True, exist_ok=True)
    try:
        template = learn_files([run_dir / LOG_NAME])
    except InputError as exc:       # a run without marks (an old MindSpore, --no-pool-log): say so
        print(f"      no template: {exc}", flush=True)
        return None
    path = out / "demo_gpt.template.json"
    save_template(template, path)
    data = copy.deepcopy(parse_yaml(CPU_RECIPE.read_text(encoding="utf-8"), source=str(CPU_RECIPE)))
    data["memopt"]["workload"]["template"] = str(path.resolve())
    data["memopt"]["workload"]["steps"] = steps
    # blocks scaled to the learned model (2 MiB in use): the recipe's 1 MiB blocks are half of
    # it, so every capacity between 2 and 3 blocks is one outcome and nothing in between shows
    data["memopt"]["allocator"] = {"name": "mindspore_bestfit", "pregrow": False, "increase_size": "128KiB"}

    def recipe_at(capacity: int | None) -> Recipe:
        data["memopt"]["device"]["hbm"] = capacity if capacity is not None else 2**40
        return recipe_from_dict(copy.deepcopy(data), source=f"{CPU_RECIPE} + {path.name}")

    def runs(capacity: int | None, policies=POLICIES) -> dict:
        r = recipe_at(capacity)
        return {p: s.seeds[0] for p, s in simulate(spec_from_recipe(r), config_from_recipe(r),
                                                   policies=policies).items()}

    free = runs(None, ("baseline",))["baseline"]
    # the largest capacity where the baseline dies of fragmentation and another policy saves it:
    # what kills it there is the holes, not memory in use; else the largest where it dies at all
    chosen = dies = saver = None
    for share in range(100, 0, -2):
        capacity = free.peak_reserved * share // 100
        if capacity < free.peak_allocated:
            break
        at = runs(capacity)
        if at["baseline"].oom_step is not None and at["baseline"].oom_kind == "fragmentation":
            dies = dies or capacity
            saver = next((p for p, r in at.items() if p != "baseline" and r.oom_step is None), None)
            if saver:
                chosen = capacity
                break
    chosen = chosen or dies
    recipe = recipe_at(chosen)
    leak = _runtime_leak(template)
    print(f"      template: {template.positions} positions ({template.exact} exact), dims "
          f"{', '.join(template.dims)}; unbounded peak {format_size(free.peak_allocated)} allocated, "
          f"{format_size(free.peak_reserved)} reserved over {steps} steps; "
          + (f"capacity {format_size(chosen)}, where the baseline dies of fragmentation"
             + (f" and {saver} saves it" if saver else "") if chosen else
             "no capacity above the peak kills the baseline by fragmentation"), flush=True)
    if leak:
        print(f"      left out: MindSpore's own leak, {leak['allocs']} allocations a step "
              f"({format_size(leak['pool_bytes'])} a step in the pool; op arguments CPU PyNative never frees, "
              "recognised by learn; simulate --keep-runtime-leak keeps them)", flush=True)
    scans = recipe.memopt.scan_every
    collector = LayoutCollector([s for s in (1, scans, 2 * scans) if s <= steps], seed=recipe.memopt.workload.seed)
    cfg = config_from_recipe(recipe)
    with open(out / "timeline.jsonl", "w", encoding="utf-8") as timeline:
        results = simulate(spec_from_recipe(recipe), cfg, policies=POLICIES, timeline=timeline, on_watch=collector)
    (out / "summary.json").write_text(json.dumps({p: [r.to_dict() for r in s.seeds] for p, s in results.items()}),
                                      encoding="utf-8")
    for policy, s in results.items():
        r = s.seeds[0]
        print(f"      {policy:<9} OOM step {r.oom_step}" + (f" ({r.oom_kind})" if r.oom_step else ""), flush=True)
    deaths = {s.seeds[0].oom_step for s in results.values()}
    if chosen and len(deaths) == 1 and None not in deaths:
        grow = (free.peak_allocated - _peak_after(recipe_at(None), 20)) / max(1, steps - 20)
        print(f"      every policy dies at the same step: this model's memory in use grows "
              f"{format_size(int(grow))} a step (allocations never freed, as recorded), so growth, not the "
              f"holes, decides where it dies", flush=True)
    write_layouts(out / "layouts.jsonl", collector.snapshots())
    build_report(out, title="The CPU GPT's own steps (a template learned from its recording)",
                 memory_map_title="the learned GPT: the pool just before each step's largest request")
    return path


def _runtime_leak(template) -> dict | None:
    """What ``learn`` recognised as MindSpore's own leak in a repeat step (``None``: nothing)."""
    part = template.classes.get("repeat") or next(iter(template.classes.values()), {})
    return part.get("runtime_kept")


def _peak_after(recipe: Recipe, steps: int) -> int:
    """Peak bytes allocated by the baseline over the first ``steps`` steps of ``recipe``."""
    return simulate(spec_from_recipe(recipe), config_from_recipe(recipe, steps=steps),
                    policies=("baseline",))["baseline"].seeds[0].peak_allocated


def _first_ranks(recipe: Recipe, steps: int, seeds: int) -> list:
    """Per job seed, the rank stream the job dies at (every OOM of the 100B job is on the first
    pipeline stage), or the closest call when it survives ``steps``."""
    from ms_memopt.simulation.spec import job_from_recipe
    from ms_memopt.simulation.job import simulate_jobs

    jobs = [job_from_recipe(recipe, policies=("baseline",), seed=seed, stages=[0], steps=steps)
            for seed in range(seeds)]
    streams = []
    for job, result in zip(jobs, simulate_jobs(jobs)):
        first = result["baseline"].closest
        print(f"      job seed {job.seed}: {len(job.streams)} ranks of stage 0, the job "
              + (f"dies at step {first.result.oom_step}" if result["baseline"].first else f"survives {steps} steps")
              + f" (rank {first.stream.rank}, stream seed {first.stream.seed})", flush=True)
        streams.append(first.stream)
    return streams


def _simulate(recipe: Recipe, sim_dir: Path, steps: int, streams: list, on_watch=None) -> dict:
    """Run the simulator's policies on the given rank streams (one stage's workload each);
    returns ``policy -> [per-stream result dicts]``."""
    cfg = config_from_recipe(recipe, steps=steps)
    spec = spec_from_recipe(recipe, stage=streams[0].stage)
    with open(sim_dir / "timeline.jsonl", "w", encoding="utf-8") as timeline:
        results = simulate(spec, cfg, policies=POLICIES, seeds=[s.seed for s in streams], timeline=timeline,
                           on_watch=on_watch)
    summary = {policy: [r.to_dict() for r in s.seeds] for policy, s in results.items()}
    (sim_dir / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    for policy, s in results.items():
        ooms = [r.oom_step for r in s.seeds]
        print(f"      {policy:<9} OOM steps of the job's first rank: {ooms}", flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(main())

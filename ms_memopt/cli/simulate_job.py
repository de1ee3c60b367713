"""The job route of ``simulate`` and ``sweep``: a recipe's job simulated under the chosen policies and printed.

``simulate RECIPE`` and ``simulate T.template.json`` (whose one-card recipe comes from
:func:`~ms_memopt.templates.workload.recipe_for_template`) both end in :func:`run_jobs`; ``sweep`` shares
the job options (:func:`add_job_arguments`) and their parsing.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ms_memopt.core.errors import InputError
from ms_memopt.core.units import format_size

#: rank-steps (steps x simulated ranks x policies x seeds) simulated without --max-work: a step of the
#: demo recipe takes ~1 ms, one of the 100B recipe ~20 ms, so 10**7 is minutes to hours, not days
MAX_WORK = 10_000_000

__all__ = ["MAX_WORK", "check_work", "add_job_arguments", "configure_job", "compact_rule", "dash", "judged_figures", "parse_policies", "parse_stages", "run_jobs"]


def add_job_arguments(parser) -> None:
    """The options of a job simulation, shared by ``simulate`` and ``sweep``."""
    from ms_memopt.simulation.executors import EXECUTORS

    parser.add_argument("--steps", type=int, default=None, help="steps to simulate (default: memopt.workload.steps)")
    parser.add_argument("--policy", default="baseline,compact,pool",
                        help="comma-separated policies: baseline, compact, pool")
    parser.add_argument("--allocator", default=None, help="allocator model (default: memopt.allocator.name)")
    parser.add_argument("--allocator-option", action="append", default=[], metavar="KEY=VALUE",
                        help="allocator model option, e.g. pregrow=true or increase_size=8GiB (repeatable)")
    parser.add_argument("--seed", type=int, default=None, help="the job seed (default: memopt.workload.seed)")
    parser.add_argument("--ranks", type=int, default=None, metavar="N",
                        help="simulate a sample of N rank streams (default: every stage x data-parallel group)")
    parser.add_argument("--stages", default=None, metavar="S,S",
                        help="only these pipeline stages, e.g. 0 or 0,1 (default: all)")
    parser.add_argument("--executor", default="local", choices=EXECUTORS,
                        help="where rank streams run: local processes (default), a Dask or a Ray cluster")
    parser.add_argument("--address", default=None,
                        help="the cluster for --executor dask|ray (default: the engine's local mode)")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes for local runs (default: every core)")
    parser.add_argument("--max-work", type=int, default=MAX_WORK, metavar="N",
                        help=f"refuse a job of more than N rank-steps (steps x ranks x policies x seeds; "
                             f"default {MAX_WORK:,}, about an hour on one core): the work is stated first")
    parser.add_argument("--compact-every", type=int, default=None, metavar="N",
                        help="the compact policy also compacts after the optimizer every N steps (default: "
                             "memopt.compact_every; a template's one-card job: only when a scan warns)")
    parser.add_argument("--compact-trigger", default=None, metavar="forecast|margin",
                        help="what makes the compact policy compact at a scan: the forecast warns within a scan "
                             "interval (forecast), or the largest hole before the watched request falls below 1.5x "
                             "it (margin); default: memopt.compact_trigger, else forecast")


def _check_counts(args) -> None:
    if args.steps is not None and args.steps < 1:
        raise InputError(f"expected a positive number of steps, got {args.steps}", key="--steps")
    if args.seeds is not None and args.seeds < 1:
        raise InputError(f"expected a positive number of seeds, got {args.seeds}", key="--seeds")
    if getattr(args, "seed", None) is not None and not 0 <= args.seed < 2**63:
        raise InputError(f"expected a seed from 0 to 2**63 - 1, got {args.seed}", key="--seed")


def check_work(job, seeds: int, args, *, unit: str = "seeds") -> int:
    """State the work a job asks for (steps x simulated ranks x policies x seeds, on stderr unless
    ``--json``) and refuse more than ``--max-work`` rank-steps before anything is simulated:
    ``--steps 10**12`` ran silently forever, ``--seeds 1000000`` built a million jobs first."""
    import sys

    steps, ranks, policies = job.cfg.steps, max(1, len(job.streams)), max(1, len(job.policies))
    work = steps * ranks * policies * seeds
    limit = getattr(args, "max_work", MAX_WORK)
    statement = (f"{steps:,} steps x {ranks:,} simulated ranks x {policies} policies x {seeds:,} {unit} "
                 f"= {work:,} rank-steps")
    if limit is not None and work > limit:
        raise InputError(f"{statement}: more than {limit:,}; lower --steps, --seeds, --ranks or --policy, or "
                         f"raise --max-work", key="--max-work")
    if not getattr(args, "json", False):
        print(f"simulating {statement}", file=sys.stderr)
    return work


def run_jobs(recipe, args, *, priced: bool = True) -> int:
    """Simulate ``recipe``'s job under ``args``' policies and print it (the recipe route; a bare
    template's one-card recipe, :func:`~ms_memopt.templates.workload.recipe_for_template`,
    comes here too with ``priced=False``: it has no model whose FLOPs the time model could price)."""
    from ms_memopt.simulation.job import ShowRank, simulate_jobs
    from ms_memopt.simulation.spec import job_from_recipe
    from ms_memopt.simulation.simulate import POLICIES

    from ms_memopt.io.traces.memory_viz import check_max_entries

    policies = parse_policies(args.policy, POLICIES)
    _check_counts(args)
    check_max_entries(getattr(args, "export_max_entries", None), args.export_memory_viz)
    seeds = range(args.seeds) if args.seeds else [recipe.memopt.workload.seed if args.seed is None
                                                   else args.seed]

    def job_of(seed: int):
        return configure_job(job_from_recipe(recipe, policies=policies, seed=seed, ranks=args.ranks,
                                             stages=parse_stages(args.stages), steps=args.steps), recipe, args)

    jobs = [job_of(seeds[0])]
    check_work(jobs[0], len(seeds), args)       # before the other seeds' jobs are built
    jobs += [job_of(seed) for seed in seeds[1:]]
    cfg = jobs[0].cfg

    out_dir = Path(args.out) if args.out else None
    timeline = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        timeline = open(out_dir / "timeline.jsonl", "w", encoding="utf-8")
    viz_paths = _viz_paths(args.export_memory_viz, jobs[0].policies) if args.export_memory_viz else {}
    for path in viz_paths.values():     # not a FIFO (it waits for a reader), not the recipe itself
        from ms_memopt.core.outputs import check_output_file

        check_output_file(path, key="--export-memory-viz", inputs=[args.recipe])
    show = None
    if out_dir is not None or viz_paths:        # the rank shown; its events are recorded after the job
        # its layouts are collected in the background while the report draws the timeline
        show = ShowRank(layouts=out_dir is not None, background=True)
    try:
        results = simulate_jobs(jobs, executor=args.executor, address=args.address, workers=args.workers,
                                progress=not args.json, timeline=timeline, show=show)
    finally:
        if timeline is not None:
            timeline.close()
    first = next(iter(results[0].values()))
    try:
        return _report_jobs(recipe, args, jobs, results, show, out_dir, viz_paths, policies, priced)
    finally:
        if first.view is not None:
            first.view.close()      # an error or Ctrl-C before the report waited for it


def _report_jobs(recipe, args, jobs, results, show, out_dir, viz_paths, policies, priced) -> int:
    """:func:`run_jobs` once the ranks have run: the files of ``--out``, the shown rank's
    ``--export-memory-viz``, the table or ``--json``; the exit code."""
    from ms_memopt.simulation.job import median_job_oom_step

    first = next(iter(results[0].values()))
    cfg = jobs[0].cfg
    if out_dir is not None and priced:
        _write_timing(out_dir / "timing.json", results[0])
    bound = _bound(recipe, jobs[0], results[0], policies)
    if show is not None:
        _write_shown_rank(jobs[0], first.view, out_dir, viz_paths, args, results[0],
                          bound=bound[1] if bound else "")

    if args.json:
        out = {"recipe": str(args.recipe), "steps": cfg.steps, "allocator": cfg.allocator,
               "allocator_options": cfg.allocator_options, "capacity": cfg.capacity,
               "scan_every": cfg.scan_every, "compact_every": cfg.compact_every,
               "compact_trigger": cfg.compact_trigger,
               "executor": args.executor, "ranks": len(jobs[0].streams), "policies": {},
               **({"placement_need": {**bound[0].to_dict(), "says": bound[1]}} if bound else {})}
        for policy in policies:
            per_seed = [job[policy] for job in results]
            if args.seeds:
                out["policies"][policy] = {"policy": policy, "median_job_oom_step": median_job_oom_step(per_seed),
                                           "seeds": [r.to_dict() for r in per_seed]}
            else:
                out["policies"][policy] = per_seed[0].to_dict()
            if not priced:
                _unpriced(out["policies"][policy])
        print(json.dumps(out))
    else:
        _print_table(results, policies, cfg, bool(args.seeds), priced=priced)
        if bound:
            print(f"bound: {bound[1]}")
    any_oom = any(job[p].job_oom_step is not None for job in results for p in policies)
    return 1 if (args.fail_on_oom and any_oom) else 0


def _bound(recipe, job, results: dict, policies) -> tuple | None:
    """The best placement of a learned template's own steps on the shown stream
    (:mod:`ms_memopt.simulation.bound`) and what it says of the card, when a card is set; a
    hand-made recipe's step is not a recording's, so it gets none. ``(PlacementNeed, sentence)``."""
    if not recipe.memopt.workload.template or job.cfg.capacity is None:
        return None
    from ms_memopt.simulation.bound import bound_sentence, placement_need
    from ms_memopt.templates.workload import UNBOUNDED

    if job.cfg.capacity >= UNBOUNDED:
        return None
    stream = job.streams[0]
    need = placement_need(job.specs[stream.stage], job.cfg.steps, seed=stream.seed)
    return need, bound_sentence(need, job.cfg.capacity, {p: results[p].job_oom_step for p in policies})


def parse_policies(text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """``--policy a,b``: the named policies, or an :class:`InputError` naming ``--policy``."""
    policies = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in policies if p not in known]
    if bad or not policies:
        raise InputError(f"unknown policy {', '.join(bad) or '(none)'}; expected some of {', '.join(known)}",
                         key="--policy")
    return policies


def parse_stages(text: str | None) -> list[int] | None:
    """``--stages 0,1``: pipeline stage numbers (checked against the recipe later)."""
    if text is None:
        return None
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise InputError(f"expected comma-separated stage numbers, got {text!r}", key="--stages") from None


def configure_job(job, recipe, args):
    """Apply ``--allocator``, ``--allocator-option``, ``--compact-every`` and ``--compact-trigger`` to a job's
    simulator settings."""
    from ms_memopt.allocators import MODELS
    from ms_memopt.allocators.options import parse_allocator_options
    from ms_memopt.simulation.simulate import COMPACT_TRIGGERS

    cfg = job.cfg
    every = getattr(args, "compact_every", None)
    if every is not None:
        if every < 1:
            raise InputError(f"expected a positive number of steps, got {every}", key="--compact-every")
        cfg.compact_every = every
    trigger = getattr(args, "compact_trigger", None)
    if trigger is not None:
        if trigger not in COMPACT_TRIGGERS:
            raise InputError(f"unknown compact trigger {trigger!r}; expected one of {', '.join(COMPACT_TRIGGERS)}",
                             key="--compact-trigger")
        cfg.compact_trigger = trigger
    if args.allocator:
        if args.allocator == "pool":
            raise InputError("pool mode is the `pool` policy, with regions from the plan: use --policy pool; "
                             "--allocator names the model of baseline and compact", key="--allocator")
        if args.allocator not in MODELS:
            raise InputError(f"unknown allocator {args.allocator!r}; expected one of {', '.join(MODELS)}",
                             key="--allocator")
        if args.allocator != recipe.memopt.allocator.name:
            cfg.allocator_options = {}
        cfg.allocator = args.allocator
    cfg.allocator_options.update(parse_allocator_options(cfg.allocator, args.allocator_option))
    return job


def _write_shown_rank(job, view, out_dir: Path | None, viz_paths: dict[str, Path], args, results=None,
                      bound: str = "") -> None:
    """What the job kept of the rank it is judged by (its first failing rank, or the closest call;
    :class:`~ms_memopt.simulation.job.ShowRank`): ``--out`` gets ``layouts.jsonl`` (its pool at each
    policy's OOM or worst moment), ``simulation.json`` (that rank, the heading and the printed
    table's figures: :mod:`ms_memopt.report.simulation_info`) and the report built from them, the
    one ``ms-memopt report DIR`` writes too; ``--export-memory-viz`` its placed events, naming the
    allocator model that placed them."""
    stream = view.stream if view is not None else job.streams[0]
    name = Path(args.recipe).name
    if out_dir is not None:
        from ms_memopt.report.build import build_report
        from ms_memopt.report.simulation_info import SimulationInfo, write_simulation_info
        from ms_memopt.io.layouts import write_layouts
        where = f"rank {stream.rank} (stage {stream.stage}, seed {stream.seed})"
        write_simulation_info(out_dir, SimulationInfo(
            title=f"Simulation of {name}: {job.cfg.steps} steps, {len(job.streams)} rank streams",
            recipe=str(args.recipe), steps=job.cfg.steps, ranks=len(job.streams), job_seed=job.seed,
            shown={"rank": stream.rank, "stage": stream.stage, "seed": stream.seed,
                   "policy": job.policies[0]},
            memory_map_title=f"{name}, {where}: the pool at each policy's OOM, or its worst moment",
            policies={policy: judged_figures(result) for policy, result in (results or {}).items()}, bound=bound))

        def layouts_ready() -> None:
            """The layouts, once the shown rank's run in the background has collected them."""
            write_layouts(out_dir / "layouts.jsonl", view.wait().snapshots if view is not None else [])

        build_report(out_dir, layouts_ready=layouts_ready)
    if viz_paths:
        _export_shown_rank(job, stream, viz_paths, args)


def _export_shown_rank(job, stream, viz_paths: dict[str, Path], args) -> None:
    """The shown rank simulated once more with its placed events streamed into one memory snapshot
    per policy (:class:`~ms_memopt.replay.viz_export.SnapshotSink`: the segments the model took and
    gave back, the newest ``--export-max-entries`` entries), naming the allocator model that placed them."""
    from ms_memopt.replay.viz_export import SnapshotSink
    from ms_memopt.simulation.job import record_placed
    from ms_memopt.simulation.pool_sizing import pool_for_workload

    cfg = job.cfg
    options = {k: v for k, v in cfg.allocator_options.items() if k != "fast"}
    sinks = {}
    for policy, path in viz_paths.items():
        pool = None
        if policy == "pool":            # pool mode's regions from the plan; its rings follow the marks
            try:
                pool = pool_for_workload(job.pool_specs[stream.stage] if job.pool_specs is not None
                                         else job.specs[stream.stage], capacity=cfg.capacity, fast=False)
            except InputError:
                print(f"memory viz ({policy}): not written, the policy did not run on rank {stream.rank}",
                      file=sys.stderr)
                continue
        sinks[policy] = SnapshotSink(path, cfg.allocator if pool is None else "pool", capacity=cfg.capacity,
                                     options=cfg.allocator_options,
                                     model=pool, follow=pool is None,
                                     max_entries=getattr(args, "export_max_entries", None))
    try:
        runs = record_placed(job, stream, sinks)
    except BaseException:
        for sink in sinks.values():
            sink.abort()
        raise
    for policy, sink in sinks.items():
        if runs[policy].final is None:
            sink.abort()
            print(f"memory viz ({policy}): not written, the policy did not run on rank {stream.rank}", file=sys.stderr)
            continue
        # the model that placed the events (pool mode's own placements are replayed through the
        # job's model: pool mode needs its regions from the plan)
        sink.close(runs[policy].final, recorded_by={
            "source": "ms-memopt simulate", "allocator": cfg.allocator, "allocator_options": options,
            "policy": policy, "recipe": str(args.recipe), "rank": stream.rank, "stage": stream.stage,
            "seed": stream.seed, "job_seed": job.seed, "steps": cfg.steps, "capacity": cfg.capacity,
            "entries": sink.writer.entries})
        print(f"memory viz ({policy}, rank {stream.rank}, seed {stream.seed}, allocator {cfg.allocator}): "
              f"{viz_paths[policy]}", file=sys.stderr)


def judged_figures(result) -> dict:
    """The figures of one policy's row in simulate's table, and in its report
    (:data:`ms_memopt.report.simulation_info.COLUMNS`; sizes in bytes): the job's OOM step, the
    rank it is judged by (:attr:`~ms_memopt.simulation.job.JobResult.closest`) and that rank's
    own figures, and the OOM steps over all ranks."""
    d, judged = result.distribution(), result.closest
    r = judged.result if judged else None
    failed = result.first is not None
    return {"seed": result.seed, "ranks": d["ranks"], "job_oom_step": result.job_oom_step,
            "rank": judged.stream.rank if judged else None, "stage": judged.stream.stage if judged else None,
            "rank_seed": judged.stream.seed if judged else None, "rank_failed": failed,
            "oom_kind": r.oom_kind if r else None, "free_total_at_oom": r.free_total_at_oom if r else None,
            "oom_ranks": d["oom_ranks"], "oom_step_median": d["oom_step_median"],
            "largest_free_min": r.largest_free_min if r else None, "frag_ratio_max": r.frag_ratio_max if r else None,
            "compactions": r.compactions if r else 0, "peak_allocated": r.peak_allocated if r else None,
            "compactions_all_ranks": sum(o.result.compactions for o in result.outcomes)}


def _write_timing(path: Path, results) -> None:
    """The first job seed's time model figures per policy (read by ``ms-memopt report``):
    ``timing``, the job's ``step_seconds``, each rank's ``rank_step_median`` and the cards' CV at
    a step (``card_cv``)."""
    policies = {}
    for policy, job in results.items():
        figures = job.timing_figures()
        policies[policy] = {"timing": None} if figures is None else {
            "timing": figures[0], "step_seconds": figures[1]["step_seconds"],
            "rank_step_median": figures[1]["rank_step_median"], "card_cv": figures[1]["card_cv"]}
    path.write_text(json.dumps({"policies": policies}) + "\n", encoding="utf-8")


def _viz_paths(path: str, policies: tuple[str, ...]) -> dict[str, Path]:
    """Policy -> snapshot file: ``path`` itself for one policy, ``stem.<policy>.suffix`` for several."""
    path = Path(path)
    if len(policies) == 1:
        return {policies[0]: path}
    suffix = path.suffix or ".pickle"
    return {policy: path.with_name(f"{path.stem if path.suffix else path.name}.{policy}{suffix}")
            for policy in policies}


def dash(value) -> str:
    """A table cell: ``-`` for ``None`` (0 is a step like any other)."""
    return "-" if value is None else str(value)


#: why a bare template's run has no time model (``simulate --json``'s ``timing_note``)
UNPRICED = ("a template records no model FLOPs: name it in a recipe (memopt.workload.template) for the time model")


def _unpriced(figures: dict) -> None:
    """Drop the time model's figures from a policy's (or its seeds') ``--json`` object."""
    for entry in [figures, *figures.get("seeds", [])]:
        if "timing" in entry:
            entry.pop("timing_detail", None)
            entry["timing"] = None
            entry["timing_note"] = UNPRICED


def _print_table(results, policies, cfg, many: bool, *, priced: bool = True) -> None:
    print(f"{cfg.steps} steps, allocator {cfg.allocator} {cfg.allocator_options or ''}, "
          f"capacity {format_size(cfg.capacity)}, scan every {cfg.scan_every}; {compact_rule(cfg)}")
    print(f"{'policy':<9} {'seed':>4} {'ranks':>5} {'job_oom':>7} {'rank':>5} {'stage':>5} {'oom_kind':<13} "
          f"{'free@oom':>10} {'oom_ranks':>9} {'median':>7} {'lf_min':>10} {'frag_max':>8} {'compactions':>11} "
          f"{'peak':>10}")
    judged = {}
    for policy in policies:
        for job in results:
            f = judged_figures(job[policy])
            judged.setdefault(policy, f)
            failed = f["rank_failed"]
            frag = "-" if f["frag_ratio_max"] is None else f"{f['frag_ratio_max']:.2f}"
            print(f"{policy:<9} {f['seed']:>4} {f['ranks']:>5} {dash(f['job_oom_step']):>7} "
                  f"{(f['rank'] if failed else '-')!s:>5} {(f['stage'] if failed else '-')!s:>5} "
                  f"{(f['oom_kind'] or '-'):<13} {format_size(f['free_total_at_oom']):>10} {f['oom_ranks']:>9} "
                  f"{dash(f['oom_step_median']):>7} {format_size(f['largest_free_min']):>10} {frag:>8} "
                  f"{f['compactions']:>11} {format_size(f['peak_allocated']):>10}")
        if many:
            from ms_memopt.simulation.job import median_job_oom_step
            print(f"{policy:<9} median job_oom_step: {median_job_oom_step([job[policy] for job in results])}")
    shown = "; ".join(f"{p}: rank {f['rank']}, stream seed {f['rank_seed']}" for p, f in judged.items()
                      if f["rank"] is not None)
    print(f"  rank..peak: the rank the job is judged by, its first failing rank ('-': every rank survived, the figures "
          f"are the closest call's) [{shown}]")
    print("  median: the median OOM step over all ranks (a survivor counts as later; '-': fewer than half fail); "
          "lf_min, frag_max: that rank's smallest largest-free block and worst frag ratio (docs/simulation.md)")
    if priced:
        _print_timing(results, policies)
    else:
        print(f"time model: not priced ({UNPRICED})")


def compact_rule(cfg) -> str:
    """When the ``compact`` policy compacts, in words: its cadence, and the scans that warn."""
    if cfg.compact_trigger == "forecast":
        warned = f"at a scan whose forecast sees the watched request stop fitting within {cfg.forecast_horizon} steps"
    else:
        warned = (f"at a scan after the largest hole before the watched request fell below "
                  f"{1 + cfg.watch_margin:g}x it")
    every = f"every {cfg.compact_every} steps and " if cfg.compact_every else ""
    return f"compact policy: compacts {every}{warned}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _print_timing(results, policies) -> None:
    """The time model's figures per policy (ms_memopt.simulation.timing): the job's step, MFU, lost time."""
    print(f"{'policy':<9} {'seed':>4} {'step_med':>9} {'step_p99':>9} {'step_cv':>8} {'mfu':>7} "
          f"{'mem_stall':>9} {'compaction':>10}")
    for policy in policies:
        for job in results:
            t = job[policy].timing()
            if t is None:
                print(f"{policy:<9} {job[policy].seed:>4} (no completed step)")
                continue
            print(f"{policy:<9} {job[policy].seed:>4} {t['step_seconds_median']:>8.4g}s {t['step_seconds_p99']:>8.4g}s "
                  f"{_pct(t['step_cv']):>8} {_pct(t['mfu']):>7} {_pct(t['memory_stall_share']):>9} "
                  f"{_pct(t['compaction_pause_share']):>10}")

"""``ms-memopt sweep RECIPE --set KEY=V1,V2 [--set ...]``: the job simulation over a grid.

Every combination of the ``--set`` values is a recipe (validated as any recipe; a bad key or
value exits 2 naming it), simulated as a job (``ms-memopt simulate``'s options: ``--ranks``,
``--stages``, ``--steps``, ``--policy``, ``--executor``/``--address`` ...). All grid points'
rank streams run in one pool. Writes ``sweep.csv``, ``sweep.json`` (the rows and the settings)
and ``sweep.png`` (job OOM step per policy over the grid) into ``--out`` (default
``out/sweep``); prints the table, or with ``--json`` one JSON object. Exit code 0, or 1 with
``--fail-on-oom`` when some point's job dies under some policy. While it runs, a bar on stderr
shows the steps and rank streams done and the time left, and each finished grid point's rows are
appended to ``sweep.partial.jsonl`` (removed once the whole grid is written); Ctrl-C stops the
workers, keeps that file and exits 130.
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(parser) -> None:
    from ms_memopt.cli.simulate_job import add_job_arguments

    parser.add_argument("recipe", help="recipe YAML (MindFormers keys + memopt section)")
    parser.add_argument("--set", action="append", default=[], required=True, metavar="KEY=V1,V2",
                        help="a recipe key and its values, e.g. memopt.device.hbm=64GB,96GB,128GB (repeatable: "
                             "the grid is every combination)")
    add_job_arguments(parser)
    parser.add_argument("--out", default="out/sweep", help="directory for sweep.csv, sweep.json, sweep.png")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--fail-on-oom", action="store_true", help="exit 1 when a job dies at some point")


def run(args) -> int:
    from ms_memopt.core.errors import InputError
    from ms_memopt.simulation.spec import job_from_recipe
    from ms_memopt.simulation.job import simulate_jobs
    from ms_memopt.report.plots import plot_sweep
    from ms_memopt.simulation.simulate import POLICIES
    from ms_memopt.simulation.sweep import parse_settings, sweep_recipes, sweep_rows
    from ms_memopt.cli.simulate_job import check_work, configure_job, parse_policies, parse_stages

    policies = parse_policies(args.policy, POLICIES)
    if args.steps is not None and args.steps < 1:
        raise InputError(f"expected a positive number of steps, got {args.steps}", key="--steps")
    grid = parse_settings(args.set)
    points = sweep_recipes(args.recipe, grid)
    stages = parse_stages(args.stages)

    def job_of(p):
        return configure_job(job_from_recipe(p.recipe, policies=policies, seed=args.seed, ranks=args.ranks,
                                             stages=stages, steps=args.steps, label=p.label), p.recipe, args)

    jobs = [job_of(points[0])]
    check_work(jobs[0], len(points), args, unit="grid points")     # before the other points' jobs are built
    jobs += [job_of(p) for p in points[1:]]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = _PartialRows(out_dir / "sweep.partial.jsonl")
    try:
        results = simulate_jobs(jobs, executor=args.executor, address=args.address, workers=args.workers,
                                progress=not args.json,
                                on_job=lambda j, result: partial.write(sweep_rows([points[j]], [result])))
    except KeyboardInterrupt:
        partial.close()
        print(f"ms-memopt sweep: interrupted; {partial.points} of {len(points)} grid points finished, their rows "
              f"are in {partial.path}", file=sys.stderr)
        return 130
    partial.close()
    rows = sweep_rows(points, results)
    keys = list(grid)
    with open(out_dir / "sweep.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
    doc = {"recipe": str(args.recipe), "grid": grid, "policies": list(policies),
           "steps": jobs[0].cfg.steps, "executor": args.executor, "rows": rows}
    (out_dir / "sweep.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    partial.path.unlink(missing_ok=True)     # the whole grid is in sweep.csv and sweep.json now
    plot_sweep(rows, keys, out_dir / "sweep.png", title=f"{Path(args.recipe).name}: job OOM step per policy")
    if args.json:
        print(json.dumps(doc))
    else:
        _print_rows(rows, keys)
        print(f"wrote {out_dir / 'sweep.csv'}, {out_dir / 'sweep.json'}, {out_dir / 'sweep.png'}", file=sys.stderr)
    died = any(r["job_oom_step"] is not None for r in rows)
    return 1 if (args.fail_on_oom and died) else 0


class _PartialRows:
    """``sweep.partial.jsonl``: the rows of each grid point as soon as its job finishes (one JSON
    object per line, flushed), so an interrupted or killed sweep keeps what it computed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle = open(path, "w", encoding="utf-8")
        self.points = 0

    def write(self, rows: list[dict]) -> None:
        for row in rows:
            self.handle.write(json.dumps(row) + "\n")
        self.handle.flush()
        self.points += 1

    def close(self) -> None:
        self.handle.close()


def _print_rows(rows: list[dict], keys: list[str]) -> None:
    from ms_memopt.cli.simulate_job import dash

    names = [k.rsplit(".", 1)[-1] for k in keys]
    widths = [max(len(n), 8) for n in names]
    print(" ".join(f"{n:<{w}}" for n, w in zip(names, widths))
          + f" {'policy':<9} {'ranks':>5} {'job_oom':>7} {'rank':>5} {'stage':>5} {'oom_ranks':>9}"
            f" {'step_med':>9} {'mfu':>6}")
    for r in rows:
        print(" ".join(f"{str(r[k]):<{w}}" for k, w in zip(keys, widths))
              + f" {r['policy']:<9} {r['ranks']:>5} {dash(r['job_oom_step']):>7} "
                f"{'-' if r['job_oom_rank'] is None else r['job_oom_rank']!s:>5} "
                f"{'-' if r['job_oom_stage'] is None else r['job_oom_stage']!s:>5} {r['oom_ranks']:>9}"
                f" {'-' if r['step_seconds_median'] is None else format(r['step_seconds_median'], '.3f') + 's':>9}"
                f" {'-' if r['mfu'] is None else format(100 * r['mfu'], '.1f') + '%':>6}")

"""``ms-memopt report DIR``: plots and a markdown summary from a run's or a simulation's logs.

Merges every rank's scan log (``rank_N/scan.jsonl``): per step the worst and the median frag
ratio and which rank is worst, printed as a table (or one JSON object with ``--json``). Then
writes ``DIR/report.md`` with the figures the directory's logs allow (see
:func:`ms_memopt.report.build.build_report`): the fragmentation timeline, the memory map from
``layouts.jsonl``, the region budget bars from ``plan.json`` (or ``--plan RECIPE``), a run's
loss curve. ``--no-plots`` prints the merged table only.

Exit codes: 0 ok; 2 not a directory, nothing to report on, or a malformed log.

Example:
    ms-memopt report out/run
    ms-memopt report out/sim --plan recipes/dense_100b_1024x910c.yaml
"""
from __future__ import annotations

import argparse
import json

from ms_memopt.core.errors import InputError
from ms_memopt.core.units import format_size
from ms_memopt.report.merge import find_scan_logs, merge_ranks

__all__ = ["add_parser", "run"]


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="a run's or a simulation's output directory (rank_N/scan.jsonl, "
                                          "timeline.jsonl, train.jsonl, layouts.jsonl, plan.json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plan", metavar="RECIPE", help="draw the region budget of this recipe's plan")
    parser.add_argument("--no-plots", action="store_true", help="only merge the ranks' scan logs (not with --plan)")
    parser.add_argument("--title", help="the report's heading")


def _fmt(value, kind: str) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if kind == "ratio" else format_size(value)


def run(args: argparse.Namespace) -> int:
    if args.no_plots and args.plan:
        # the plan only feeds the region budget figure; silently dropping it would hide a mistake
        raise InputError("draws the region budget figure, which --no-plots turns off; "
                         "drop one of them", key="--plan")
    # without scan logs the report can still draw a run's or a simulation's other logs
    merged = (merge_ranks(args.directory, progress=not args.json)
              if args.no_plots or find_scan_logs(args.directory) else None)
    report = None
    if not args.no_plots:
        from ms_memopt.report.build import build_report

        plan = None
        if args.plan:
            from ms_memopt.analysis.estimate import estimate
            from ms_memopt.config.recipe import load_recipe

            plan = estimate(load_recipe(args.plan)).to_dict()
        report = build_report(args.directory, title=args.title, plan=plan)
    if args.json:
        out = merged.to_dict() if merged is not None else {"directory": str(args.directory)}
        if report is not None:
            out["report"] = str(report)
            out["figures"] = sorted(p.name for p in report.parent.glob("*.png"))
        print(json.dumps(out))
        return 0
    if merged is not None:
        print(f"{merged.directory}: ranks {merged.ranks}, {len(merged.steps)} scanned steps")
        print(f"{'step':>8} {'ranks':>5} {'frag max':>9} {'frag med':>9} {'worst':>5} {'min largest':>12} "
              f"{'watch fail':>10}")
        for row in merged.steps:
            print(f"{row.step:>8} {row.ranks:>5} {_fmt(row.frag_max, 'ratio'):>9} {_fmt(row.frag_median, 'ratio'):>9} "
                  f"{'-' if row.worst_rank is None else row.worst_rank:>5} {_fmt(row.largest_free_min, 'size'):>12} "
                  f"{row.watch_failures:>10}")
        for err in merged.source_errors:
            print(f"rank {err['rank']} step {err.get('step')}: source {err.get('source')!r} failed: {err.get('error')}")
    if report is not None:
        figures = ", ".join(sorted(p.name for p in report.parent.glob("*.png")))
        print(f"report: {report} (figures: {figures or 'none'})")
    return 0

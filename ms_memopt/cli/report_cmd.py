"""``ms-memopt report DIR``: merge a run's per-rank scan logs (per step: max and median frag
ratio, which rank is worst). Minimal for now: a table, or one JSON object with ``--json``;
plots come later."""
from __future__ import annotations

import argparse
import json

from ..report_merge import merge_ranks
from ..units import format_size

__all__ = ["add_parser", "run"]


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="a run's log directory (holding rank_N/scan.jsonl)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _fmt(value, kind: str) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if kind == "ratio" else format_size(value)


def run(args: argparse.Namespace) -> int:
    merged = merge_ranks(args.directory)
    if args.json:
        print(json.dumps(merged.to_dict()))
        return 0
    print(f"{merged.directory}: ranks {merged.ranks}, {len(merged.steps)} scanned steps")
    print(f"{'step':>8} {'ranks':>5} {'frag max':>9} {'frag med':>9} {'worst':>5} {'min largest':>12} {'watch fail':>10}")
    for row in merged.steps:
        print(f"{row.step:>8} {row.ranks:>5} {_fmt(row.frag_max, 'ratio'):>9} {_fmt(row.frag_median, 'ratio'):>9} "
              f"{'-' if row.worst_rank is None else row.worst_rank:>5} {_fmt(row.largest_free_min, 'size'):>12} "
              f"{row.watch_failures:>10}")
    for err in merged.source_errors:
        print(f"rank {err['rank']} step {err.get('step')}: source {err.get('source')!r} failed: {err.get('error')}")
    return 0

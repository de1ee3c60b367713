"""``ms-memopt learn REC.jsonl [REC2.jsonl ...] --out MODEL.template.json``: a step template.

Learns, from recordings made with ``ms_memopt.mindspore.mark_step`` under ``ms-memopt record``,
the model's prologue and its ``first``, ``new_shape`` and ``repeat`` steps, each allocation's
size a polynomial in the step dims (:mod:`ms_memopt.engine.template`). ``ms-memopt simulate
MODEL.template.json --schedule FILE.csv`` then runs any sequence of shapes. Prints what was
learned and which positions no polynomial reproduced exactly (``--json``: one object).
Exit code 0; 2 for recordings that do not line up (the message names recording and step).

Example:
    ms-memopt learn rec16.jsonl rec24.jsonl rec32.jsonl --out gpt.template.json
"""
from __future__ import annotations

import json
import sys

from ms_memopt.core.errors import InputError

__all__ = ["add_parser", "run"]


def add_parser(parser) -> None:
    parser.add_argument("recordings", nargs="+", metavar="REC.jsonl",
                        help="recordings with dims step marks (ms-memopt record of a run calling mark_step)")
    parser.add_argument("--out", required=True, metavar="MODEL.template.json", help="template file to write")
    parser.add_argument("--max-degree", type=int, default=3, help="highest polynomial degree tried (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    from ms_memopt.engine.template import learn_files, save_template

    if args.max_degree < 0:
        raise InputError(f"expected a degree >= 0, got {args.max_degree}", key="--max-degree")
    if not str(args.out).endswith(".template.json"):
        raise InputError("the template file's name must end with .template.json (simulate recognises it by that)",
                         key="--out")
    template = learn_files(args.recordings, max_degree=args.max_degree)
    save_template(template, args.out)
    summary = template.summary()
    summary["out"] = str(args.out)
    summary["not_exact_positions"] = template.not_exact
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"template {args.out}: dims {', '.join(template.dims)}; allocator {template.allocator}; "
          f"{len(template.recordings)} recording(s)")
    print(f"{'class':<10} {'samples':>7} {'allocs':>7} {'ops':>7}  recorded at")
    rows = [("prologue", {"samples": template.prologue["samples"], "allocs": summary["prologue_allocs"],
                          "ops": len(template.prologue["ops"]), "seen": []})]
    rows += list(summary["classes"].items())
    for name, c in rows:
        seen = "; ".join(",".join(f"{k}={v}" for k, v in s.items()) for s in c["seen"])
        print(f"{name:<10} {c['samples']:>7} {c['allocs']:>7} {c['ops']:>7}  {seen}")
    print(f"sizes: {template.exact} of {template.positions} allocation positions fitted exactly")
    for miss in template.not_exact[:10]:
        print(f"  not exact: {miss['class']} allocation #{miss['alloc']} (recorded sizes {miss['sizes']}, "
              f"off by up to {miss['max_error']} B)", file=sys.stdout)
    if len(template.not_exact) > 10:
        print(f"  ... and {len(template.not_exact) - 10} more (--json lists all)")
    for k, variant in enumerate(template.free_orders):
        print(f"free order {k}: {variant['recording']} freed in another order ({', '.join(variant['parts'])}); "
              "MindSpore draws some free orders once per process")
    return 0

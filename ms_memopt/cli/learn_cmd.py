"""``ms-memopt learn REC.jsonl [REC2.jsonl ...] --out MODEL.template.json``: a step template.

Learns, from recordings made with ``ms_memopt.mindspore.mark_step`` under ``ms-memopt record``,
the model's prologue and its ``first``, ``new_shape`` and ``repeat`` steps, each allocation's
size a polynomial in the step dims (:mod:`ms_memopt.templates.template`). ``ms-memopt simulate
MODEL.template.json --schedule FILE.csv`` then runs any sequence of shapes. Prints what was
learned and which positions no polynomial reproduced exactly (``--json``: one object).
The prologue is fitted in the dims each recording holds fixed (``hidden``: one process per
width). Exit code 0; 2 for recordings that do not line up (the message names recording and
step). Recordings at several values of a dim fixed per process that changes how many
allocations a step makes (``layers``, 3 or more consecutive counts) give a template over that
repeated block count (:mod:`ms_memopt.templates.layers`); counts whose steps do not show
one repeated block are refused (exit 2; the message names what a layer adds and what does not
hold).

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
    from ms_memopt.templates.template import learn_files, save_template

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
    if template.layered:
        counts = summary["layered"]["counts"]
        dim = summary["layered"]["dim"]
        print(f"repeated block count {dim}: recorded at {', '.join(map(str, counts))}; a larger {dim} is made from "
              f"{dim}={counts[-1]}'s steps with the blocks one {dim} more inserts (below: {dim}={counts[-1]})")
    print(f"{'class':<10} {'samples':>7} {'allocs':>7} {'ops':>7}  recorded at")
    # the prologue is fitted in the dims fixed per recording (hidden...): show those values
    fixed = [n for j, n in enumerate(template.dims) if any(e[j] for e in template.prologue["basis"])]
    prologue_seen = list({tuple((n, s[n]) for n in fixed): None for s in template.prologue["seen"]}) if fixed else []
    rows = [("prologue", {"samples": template.prologue["samples"], "allocs": summary["prologue_allocs"],
                          "ops": len(template.prologue["ops"]), "seen": [dict(k) for k in prologue_seen]})]
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
        who = (f"{variant['recording']} freed in another order" if variant["recording"] is not None else
               "the frees whose order differed between processes, each run of them freed as "
               + "".join("abcd"[r] for r in variant["permutation"]))
        print(f"free order {k}: {who} ({', '.join(variant['parts'])})")
    if template.free_orders:
        print("MindSpore draws some free orders once per process (CPU): simulate --free-order all shows the layouts "
              "they give")
    return 0

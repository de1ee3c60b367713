"""``ms-memopt learn REC.jsonl [REC2.jsonl ...] --out MODEL.template.json``: a step template.

Learns, from recordings made with ``ms_memopt.mindspore.mark_step`` under ``ms-memopt record``,
the model's prologue and its steps by class (``first``, ``repeat``, and by what is new in them:
``new:seq+tokens``..., :mod:`ms_memopt.templates.classes`), each allocation's size a polynomial
in the step dims (:mod:`ms_memopt.templates.template`). It says what the calibration lacks (the
classes no step fell in, with a plan of the shapes to record) and the allocations it recognised
as MindSpore's own leak (left out of simulations). ``--plan seq=16,24,32 --plan batch=2,4,6``
without recordings prints the calibration to record: the fewest processes that play every class. ``ms-memopt simulate
MODEL.template.json --schedule FILE.csv`` then runs any sequence of shapes. Prints what was
learned and which positions no polynomial reproduced exactly (``--json``: one object).
The prologue is fitted in the dims each recording holds fixed (``hidden``: one process per
width). Exit code 0; 2 for recordings that do not line up (the message names recording and
step). Recordings at several values of a dim fixed per process that changes how many
allocations a step makes (``layers``, 3 or more consecutive counts) give a template over that
repeated block count (:mod:`ms_memopt.templates.layers`); counts whose steps do not show
one repeated block are refused (exit 2; the message names what a layer adds and what does not
hold).

An Ascend profiler capture (torch_npu's or MindSpore's, a rank's folder, ``ASCEND_PROFILER_OUTPUT/``
or the ``.db``) is learned as a recording cut at the profiler's step markers, the tensors it held
before the capture as the prologue (:mod:`ms_memopt.templates.capture`); ``--dims-csv FILE``
gives each captured step's dims (a header of dim names, one row per step).

Example:
    ms-memopt learn rank0_ascend_pt --out mine.template.json
    ms-memopt learn --plan seq=16,24,32 --plan batch=2,4,6
    ms-memopt learn rec16.jsonl rec24.jsonl rec32.jsonl --out gpt.template.json
"""
from __future__ import annotations

import json
import sys

from ms_memopt.core.errors import InputError

__all__ = ["add_parser", "run"]


def add_parser(parser) -> None:
    parser.add_argument("recordings", nargs="*", metavar="REC.jsonl",
                        help="recordings with dims step marks (ms-memopt record of a run calling mark_step), or "
                             "Ascend profiler captures (a rank's folder, ASCEND_PROFILER_OUTPUT/ or the .db)")
    parser.add_argument("--dims-csv", action="append", default=[], metavar="FILE.csv",
                        help="for a profiler capture (one per capture, in order): a header of dim names and one "
                             "row per captured step (an optional step column numbers them); without it the "
                             "steps have no dims")
    parser.add_argument("--out", default=None, metavar="MODEL.template.json", help="template file to write")
    parser.add_argument("--plan", action="append", default=[], metavar="DIM=V1,V2,...",
                        help="without recordings: print the calibration to record over these values (one --plan "
                             "per dim that varies within a run: the fewest processes that play every class of step)")
    parser.add_argument("--max-degree", type=int, default=3, help="highest polynomial degree tried (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _parse_plan(items: list[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        try:
            if not sep or not name.isidentifier():
                raise ValueError
            out[name] = [int(v) for v in values.split(",")]
        except ValueError:
            raise InputError(f"expected DIM=V1,V2,... (integers), got {item!r}", key="--plan") from None
        if len(set(out[name])) < 2:
            raise InputError(f"{name}: give 2 values or more (3 or more to fit sizes quadratic in it)", key="--plan")
    return out


def _print_plan(values: dict[str, list[int]]) -> int:
    from ms_memopt.templates.classes import calibration_plan, classify, playable_classes, possible_novelties

    plan = calibration_plan(values)
    print(f"record {len(plan)} processes (one ms-memopt record each), the steps in this order:")
    for k, process in enumerate(plan):
        print(f"process {k}: " + " ".join("x".join(str(d[n]) for n in values) for d in process))
        for name in values:
            print(f"  --{name} {','.join(str(d[name]) for d in process)}")
    print("(" + "x".join(values) + " per step; classes played: "
          + ", ".join(sorted(set().union(*(classify(p) for p in plan)))) + ")")
    never = sorted(set(possible_novelties(list(values))) - set(playable_classes(values)))
    if never:
        print(f"(no step over these values can be {', '.join(never)}: each needs a token count that two shapes "
              "of the grid share)")
    return 0


def run(args) -> int:
    from ms_memopt.templates.template import learn_files, save_template

    if args.plan and not args.recordings:
        return _print_plan(_parse_plan(args.plan))
    if not args.recordings:
        raise InputError("give recordings to learn from (or --plan DIM=V1,V2,... for the calibration to record)",
                         key="recordings")
    if args.out is None:
        raise InputError("give --out MODEL.template.json", key="--out")
    from ms_memopt.templates.template import MAX_TEMPLATE_DEGREE

    if not 0 <= args.max_degree <= MAX_TEMPLATE_DEGREE:
        raise InputError(f"expected a degree from 0 to {MAX_TEMPLATE_DEGREE}, got {args.max_degree}",
                         key="--max-degree")
    if not str(args.out).endswith(".template.json"):
        raise InputError("the template file's name must end with .template.json (simulate recognises it by that)",
                         key="--out")
    template = learn_files(args.recordings, max_degree=args.max_degree, dims_csv=args.dims_csv)
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
    width = max([10] + [len(name) for name in summary["classes"]])
    print(f"{'class':<{width}} {'samples':>7} {'allocs':>7} {'ops':>7}  recorded at")
    # the prologue is fitted in the dims fixed per recording (hidden...): show those values
    fixed = [n for j, n in enumerate(template.dims) if any(e[j] for e in template.prologue["basis"])]
    prologue_seen = list({tuple((n, s[n]) for n in fixed): None for s in template.prologue["seen"]}) if fixed else []
    rows = [("prologue", {"samples": template.prologue["samples"], "allocs": summary["prologue_allocs"],
                          "ops": len(template.prologue["ops"]), "seen": [dict(k) for k in prologue_seen]})]
    rows += list(summary["classes"].items())
    for name, c in rows:
        seen = "; ".join(",".join(f"{k}={v}" for k, v in s.items()) for s in c["seen"])
        print(f"{name:<{width}} {c['samples']:>7} {c['allocs']:>7} {c['ops']:>7}  {seen}")
    for name, c in summary["classes"].items():
        if len(c.get("covers", [])) > 1:
            print(f"{name} makes the same steps as: {', '.join(k for k in c['covers'] if k != name)}")
    leak = next((c["runtime_kept"] for c in summary["classes"].values() if "runtime_kept" in c), None)
    if leak:
        sizes = ", ".join(f"{n} x {size} B" for size, n in leak["sizes"].items())
        print(f"MindSpore's own leak: {leak['allocs']} allocations a step never freed ({sizes}; "
              f"{leak['pool_bytes']:,} B a step in the pool): op arguments its CPU PyNative ops never free, left out "
              "of simulations (simulate --keep-runtime-leak keeps them)")
    for entry in template.recordings:
        if "capture" in entry:
            _print_capture(entry["path"], entry["capture"])
    if template.lacks:
        print("the calibration lacks:")
        for entry in template.lacks:
            print(f"  {entry['class']}: {entry['why']}")
        values = _recorded_values(template)
        if values:
            print("record these (ms-memopt learn " + " ".join(f"--plan {n}={','.join(map(str, v))}"
                                                           for n, v in values.items()) + "):")
            _print_plan(values)
    if template.purposes:
        _print_purposes(template.purposes)
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


def _print_capture(path: str, capture: dict) -> None:
    """What a profiler capture gave: its steps, what it held before the capture, its figures."""
    from ms_memopt.core.units import format_size

    marks = capture["marks"] or "no step marker"
    held = capture["held_before"]
    print(f"capture {path}: {capture['steps']} step(s) ({marks}); held before the capture: {held['tensors']} "
          f"tensors, {format_size(held['bytes'])} ({format_size(held['held_through'])} held all through: the "
          f"persistent state); recorded peak allocated {format_size(capture['recorded']['peak_allocated'] or 0)}")
    for note in capture["notes"]:
        print(f"  {note}")


def _recorded_values(template) -> dict[str, list[int]]:
    """The values of each dim a run varied, as recorded (3 of them, spread: for a plan)."""
    dims: dict[str, set[int]] = {}
    for part in template.classes.values():
        for seen in part["seen"]:
            for name, value in seen.items():
                dims.setdefault(name, set()).add(value)
    per_run = {name for name in template.dims if any(e[template.dims.index(name)] for e in template.prologue["basis"])}
    out = {}
    for name, values in dims.items():
        values = sorted(values)
        if len(values) > 1 and name not in per_run:
            out[name] = values if len(values) <= 3 else [values[0], values[len(values) // 2], values[-1]]
    return out


def _print_purposes(purposes: dict) -> None:
    """What each allocation is for, learned from lifetimes (``analysis.purposes``)."""
    from ms_memopt.core.units import format_size

    print(f"purposes (from lifetimes in {purposes.get('recording')}; per step: its last full step):")
    for name, p in purposes["purposes"].items():
        if not p["count"]:
            continue
        where = "" if p["in_pool"] else f" ({p['how']})"
        peak = f", at most {format_size(p['peak'])} at once" if p["peak"] != p["bytes"] else ""
        print(f"  {name:<13} {p['count']:>6} allocations, {format_size(p['bytes'])}{peak}{where}")
    if purposes["purposes"].get("unclassified", {}).get("count"):
        print("  (unclassified: kept past a step that did not make it in its backward, or never freed after the "
              "first step)")

"""``ms-memopt simulate MODEL.template.json --schedule FILE.csv``: a learned step template run.

Two routes. Without ``--export-events`` the template runs as a one-card job
(:func:`~ms_memopt.templates.workload.recipe_for_template`): every policy of ``--policy``,
``--steps``, ``--seeds``, ``--capacity``, ``--allocator``, ``--compact-trigger``, ``--out``'s
timeline, report and memory map, ``--export-memory-viz``, the forecast and the executors, as a
recipe naming it (``memopt.workload.template``) gets; the time model is not priced (a template
records no model FLOPs), and a job of many ranks needs a recipe (``--ranks`` and ``--stages`` are
refused with that advice). With ``--export-events`` (the held-out check's route):

The template (``ms-memopt learn``) generates the events of every step of the schedule (one CSV
row per step, one column per dim): its prologue, then per step its class's variant (``first``,
``repeat``, or by what is new in it: ms_memopt/templates/classes.py), without the allocations
``learn`` named MindSpore's own leak unless ``--keep-runtime-leak``. They are replayed through the template's allocator
model (the recorded pool's: ``mindspore-bestfit`` for CPU recordings; ``--allocator``
overrides, ``--allocator-option`` and ``--capacity`` set it up). Prints peaks, OOMs and
fragmentation (``--json``: one object, bytes); ``--export-events OUT.jsonl`` writes the events
with the model's addresses and its blocks as ``segment_alloc`` events (our JSONL,
docs/events.md). Exit code 0, or 1 with ``--fail-on-oom`` after an OOM. ``args.free_order``
(when the parser gives one): generate in that calibration recording's free order
(``template.free_orders``, :func:`~ms_memopt.templates.template.generate`), or ``"all"``: every
order, one file per distinct layout (``OUT.jsonl`` the default order's, ``OUT.layoutN.jsonl``
the others; :func:`~ms_memopt.templates.draws.draw_outcomes`), the addresses a process can
get; ``args.free_order_from`` (a recording): in the order that process drew, read from its first
step (:func:`~ms_memopt.templates.template.free_order_of`).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from ms_memopt.core.errors import InputError
from ms_memopt.core.outputs import check_output_file
from ms_memopt.core.units import format_size, parse_size

__all__ = ["DEFAULT_FIXED_STEPS", "fixed_dims", "run"]

#: steps run without ``--schedule`` or ``--steps`` for a template whose dims never varied
DEFAULT_FIXED_STEPS = 10


def fixed_dims(template) -> dict[str, int] | None:
    """The one value of each dim every step of ``template`` was recorded at (``{}``: a template
    without dims, a profiler capture's), or ``None`` when some dim varied (a schedule is needed).

    Example:
        >>> from ms_memopt.templates.template import Template
        >>> part = {"samples": 1, "seen": [{"seq": 8}], "basis": [[0]], "ops": []}
        >>> fixed_dims(Template(["seq"], part, {"first": part}))
        {'seq': 8}
    """
    seen = {tuple(sorted(s.items())) for part in template.classes.values() for s in part.get("seen", ())}
    if template.layered or len(seen) > 1:
        return None
    return dict(next(iter(seen), ()))


def _write_schedule(path: str, dims: dict[str, int], steps: int) -> None:
    """``steps`` rows of ``dims`` (a ``step`` column numbers them: a template without dims needs one)."""
    names = list(dims)
    lines = [",".join(["step"] + names)] + [",".join([str(n)] + [str(dims[k]) for k in names])
                                              for n in range(1, steps + 1)]
    Path(path).write_text("\n".join(lines) + "\n")


def run(args) -> int:
    from ms_memopt.allocators import create
    from ms_memopt.allocators.options import parse_allocator_options
    from ms_memopt.core.events import write_jsonl
    from ms_memopt.templates.template import flat_template, load_template, read_schedule
    from ms_memopt.templates.draws import draw_outcomes

    template = load_template(args.recipe)
    if not getattr(args, "schedule", None):
        fixed = fixed_dims(template)
        if fixed is None:
            raise InputError("a template needs --schedule FILE.csv (a header of dims "
                             f"{','.join(template.dims)}, one row per step)", key="--schedule")
        with tempfile.TemporaryDirectory(prefix="ms-memopt-schedule-") as folder:
            args.schedule = str(Path(folder) / "recorded_dims.csv")
            _write_schedule(args.schedule, fixed, args.steps or DEFAULT_FIXED_STEPS)
            try:
                return run(args)
            finally:
                args.schedule = None
    if not args.export_events:
        return _run_job(args, template)
    for flag in _JOB_ONLY:
        if getattr(args, flag, None) not in (None, False):
            raise InputError("--export-events replays the schedule once through the recorded pool's model; "
                             "drop it for the job's options", key="--" + flag.replace("_", "-"))
    # not a FIFO (it waits for a reader), not an input; the other layouts' files are checked as they are named
    check_output_file(args.export_events, key="--export-events", inputs=[args.recipe, args.schedule])
    schedule = read_schedule(args.schedule, template.dims)
    if args.steps is not None:      # the schedule's first steps, as in the job route
        if not 1 <= args.steps <= len(schedule):
            raise InputError(f"expected 1 to {len(schedule)} steps (the schedule's rows), got {args.steps}",
                             key="--steps")
        schedule = schedule[:args.steps]
    name = args.allocator or template.allocator
    options = parse_allocator_options(name, args.allocator_option)
    capacity = None if args.capacity is None else parse_size(args.capacity, source="--capacity", positive=True)
    warnings: list[str] = []
    flat = flat_template(template, schedule, warnings=warnings)      # a layered template at the schedule's count
    # which calibration process's free order (flat.free_orders); None: the most common one
    free_order = getattr(args, "free_order", None)
    order_match = drawn = None
    if getattr(args, "free_order_from", None):
        if free_order is not None:
            raise InputError("give --free-order or --free-order-from, not both", key="--free-order-from")
        from ms_memopt.templates.template import free_order_of
        from ms_memopt.io.traces import load_trace

        recorded = load_trace(args.free_order_from).events
        free_order, order_match = free_order_of(flat, schedule, recorded)
        if order_match < 1.0:       # an order no calibration process drew: read from its first step
            flat, free_order, drawn = _drawn_order(flat, schedule, recorded, args.free_order_from, free_order)
    keep = bool(getattr(args, "keep_runtime_leak", False))
    layouts = draw_outcomes(flat, schedule, lambda: create(name, capacity, **options), warnings=warnings,
                            orders=None if free_order == "all" else [free_order], keep_runtime_leak=keep)
    meta = {"source": "ms-memopt simulate", "template": str(args.recipe), "schedule": str(args.schedule),
            "allocator": name, "allocator_options": options, "capacity": capacity}
    if name == template.allocator and template.pool:
        meta["pool"] = template.pool
    paths = [_layout_path(args.export_events, i) for i in range(len(layouts))]
    for path in paths[1:]:
        check_output_file(path, key="--export-events", inputs=[args.recipe, args.schedule])
    for path, layout in zip(paths, layouts):
        write_jsonl(path, layout.placed, meta={**meta, "free_orders": layout.free_orders})
    result = layouts[0].result
    out = {"template": str(args.recipe), "schedule": str(args.schedule), "steps": len(schedule),
           "dims": template.dims, "capacity": capacity, "warnings": warnings,
           "classes": _class_counts(template, schedule), "export_events": args.export_events,
           "free_order": free_order, "free_orders": len(flat.free_orders),
           "free_order_from": getattr(args, "free_order_from", None), "free_order_match": order_match,
           **({"free_order_drawn": drawn} if drawn is not None else {}),
           "runtime_leak": "kept" if keep else "left out",
           **{k: v for k, v in result.to_dict().items() if k not in ("address_match", "policy")}}
    if free_order == "all":
        figures = [layout.result.to_dict() for layout in layouts]
        out["layouts"] = [{"free_orders": layout.free_orders, "export_events": path,
                           **{k: got[k] for k in _LAYOUT_FIGURES}}
                          for path, layout, got in zip(paths, layouts, figures)]
    if args.json:
        print(json.dumps(out))
    else:
        for text in warnings:
            print(f"warning: {text}", file=sys.stderr)
        kinds: dict[str, int] = {}
        for oom in result.ooms:
            kinds[oom.kind] = kinds.get(oom.kind, 0) + 1
        c = out["classes"]
        print(f"template         {args.recipe}: {len(schedule)} steps from {args.schedule} "
              f"({c['first']} first, {c['new_shape']} new shape, {c['repeat']} repeat)")
        print(f"events           {result.events:,} ({result.allocs:,} allocs)")
        print(f"allocator        {result.allocator}, capacity "
              + (format_size(capacity) if capacity is not None else "unbounded"))
        print(f"peak allocated   {format_size(result.peak_allocated)}")
        print(f"peak reserved    {format_size(result.peak_reserved)}")
        print(f"segments         {result.segment_allocs:,} allocated from the device")
        print(f"OOMs             {len(result.ooms)}"
              + (" (" + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")" if kinds else ""))
        if result.ooms:
            first = result.ooms[0]
            print(f"  first OOM      {format_size(first.size)} at event {first.event_index}: "
                  f"{format_size(first.free_total)} free, largest hole {format_size(first.largest_free)}")
        print(f"free at end      {format_size(result.free_total_end)}, largest hole "
              f"{format_size(result.largest_free_end)}")
        print(f"frag ratio       {_ratio(result.frag_ratio_end)} at end, max {_ratio(result.frag_ratio_max)}")
        print(f"events written   {args.export_events}")
        if free_order == "all":
            _print_layouts(layouts, paths, len(flat.free_orders) + 1)
    return 1 if (getattr(args, "fail_on_oom", False) and any(layout.result.ooms for layout in layouts)) else 0


def _drawn_order(flat, schedule, recorded, path: str, closest):
    """``--free-order-from`` a process whose first step frees in an order no calibration process
    drew: the template with that order added (read from its first step alone,
    :func:`~ms_memopt.templates.drawn.drawn_free_order`), its index and the evidence, said on
    stderr; the closest known order where the first step does not show one."""
    from dataclasses import replace

    from ms_memopt.templates.template import drawn_free_order

    entry, evidence = drawn_free_order(flat, schedule, recorded, name=f"first step of {path}")
    if entry is None:
        print(f"note: {path}'s first step frees in no order the template knows ({evidence['why']}); simulated in "
              "the closest", file=sys.stderr)
        return flat, closest, evidence
    for run in evidence["runs"]:
        sizes = ", ".join(f"{size:,} B" for size in run["sizes"])
        print(f"note: {path} drew a free order the template never saw: its first step frees allocations "
              f"#{', #'.join(map(str, run['allocations']))} of the first step ({sizes}) in the order "
              f"{_letters(run['drawn'])} where every calibration process freed "
              f"{_letters(run['default'])} (a, b, ...: those allocations in the order made)",
              file=sys.stderr)
    print("note: simulated in that order, the same runs of the later steps' classes reordered alike ("
          + ", ".join(f"{label}: {n}" for label, n in evidence["reordered"].items()) + ")", file=sys.stderr)
    flat = replace(flat, free_orders=[*flat.free_orders, entry])
    return flat, len(flat.free_orders) - 1, evidence


def _letters(ranks: list[int]) -> str:
    """An order of a run's allocations as letters (``a``: the first made)."""
    return "".join(chr(ord("a") + r) if r < 26 else f"[{r}]" for r in ranks)


#: what ``--free-order all`` reports of each layout (bytes; ratios)
_LAYOUT_FIGURES = ("peak_reserved", "segment_allocs", "largest_free_end", "frag_ratio_max", "ooms")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _layout_path(path: str, index: int) -> str:
    """Where layout ``index`` of ``--free-order all`` is written: ``OUT.jsonl`` for the default
    order's, ``OUT.layoutN.jsonl`` for the others."""
    if index == 0:
        return path
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.layout{index}.{suffix}" if dot and "/" not in suffix else f"{path}.layout{index}"


def _print_layouts(layouts, paths: list[str], orders: int) -> None:
    print(f"layouts          {len(layouts)} distinct over {orders} free order(s) (MindSpore on CPU draws one "
          "per process; a run's first step shows which: --free-order-from)")
    for i, (layout, path) in enumerate(zip(layouts, paths)):
        names = ", ".join("default" if k is None else str(k) for k in layout.free_orders)
        r = layout.result
        print(f"  layout {i:<3}     orders {names}: peak reserved {format_size(r.peak_reserved)}, largest hole at "
              f"end {format_size(r.largest_free_end)}, frag max {_ratio(r.frag_ratio_max)}, OOMs {len(r.ooms)}; "
              f"{path}")


#: the job route's options (they do not combine with --export-events)
_JOB_ONLY = ("out", "seeds", "export_memory_viz", "export_max_entries", "compact_trigger", "ranks", "stages")


def _run_job(args, template) -> int:
    """The template as a one-card job (:func:`~ms_memopt.cli.simulate_job.run_jobs`)."""
    from ms_memopt.cli.simulate_job import run_jobs
    from ms_memopt.templates.workload import recipe_for_template

    for flag in ("ranks", "stages"):
        if getattr(args, flag, None) is not None:
            raise InputError("a bare template is one card; for a job of many ranks name it in a recipe "
                             "(memopt.workload.template, with its sequence-length rules or memopt.workload.schedule; "
                             "docs/simulation.md)", key="--" + flag)
    if getattr(args, "keep_runtime_leak", False):
        raise InputError("--keep-runtime-leak goes with --export-events (one replay to compare with a recording); "
                         "the job simulates the model's own memory", key="--keep-runtime-leak")
    for flag in ("free_order", "free_order_from"):
        if getattr(args, flag, None) is not None:
            raise InputError(f"--{flag.replace('_', '-')} goes with --export-events (one replay in that "
                             "process's order); the job runs the most common order", key="--" + flag.replace("_", "-"))
    capacity = None if args.capacity is None else parse_size(args.capacity, source="--capacity", positive=True)
    recipe = recipe_for_template(args.recipe, args.schedule, capacity=capacity, steps=args.steps, template=template)
    args.steps = None           # the recipe has them
    return run_jobs(recipe, args, priced=False)


def _class_counts(template, schedule) -> dict[str, int]:
    """Steps of the schedule that are ``first``, ``repeat`` or have something new (``new_shape``),
    and per novelty class (``new:...``, ms_memopt/templates/classes.py)."""
    from ms_memopt.templates.classes import classify, is_new

    counts = {"first": 0, "new_shape": 0, "repeat": 0}
    for kind in classify(schedule):
        counts["new_shape" if is_new(kind) else kind] += 1
        if is_new(kind):
            counts[kind] = counts.get(kind, 0) + 1
    return counts

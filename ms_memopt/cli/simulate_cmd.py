"""``ms-memopt simulate RECIPE``: many training steps of a whole job under memory policies.

Every distinct card stream of the recipe (pipeline stages x data-parallel groups; tensor-parallel
peers share a stream), or a ``--ranks N`` sample, runs through the simulator
(:mod:`ms_memopt.simulation.job`) on local processes, or on a Dask or Ray cluster with ``--executor``.
The job dies at its first rank. ``--compact-trigger forecast|margin`` (or the recipe's
``memopt.compact_trigger``) selects what makes the ``compact`` policy compact at a scan. Prints one line per policy (or, with ``--json``, one JSON
object: per policy ``job_oom_step``, ``job_oom_rank``, ``job_oom_stage``, ``ranks``, the
``distribution`` across ranks, ``first_rank`` (the failing rank's
:class:`ms_memopt.simulation.simulate.PolicyResult` figures) and ``rank_results``; with ``--seeds N``,
each policy holds ``seeds`` (one job each) and ``median_job_oom_step``). ``--out DIR``
receives ``timeline.jsonl`` (every rank's samples, stamped with ``rank`` and ``stage``),
and for the rank the job is judged by (its first failing rank, or the closest call, as the job
itself ran it: :class:`ms_memopt.simulation.job.ShowRank`) ``layouts.jsonl`` (its pool at each policy's OOM, or at its worst moment when
it survives) and ``report.md`` with ``fragmentation.png`` and ``memory_map.png``.
``--export-memory-viz FILE.pickle`` writes that rank's simulated events with the model's addresses, the
segments it took and gave back, and its final layout in PyTorch's memory snapshot format (pytorch.org/memory_viz,
MindStudio Insight's converter): that rank alone is simulated once more after the job, straight into the file;
with one policy to ``FILE.pickle``, with several one file per policy, ``FILE.<policy>.pickle``;
``--export-max-entries N`` keeps the newest N trace entries. Exit code 0, or 1
with ``--fail-on-oom`` when a policy lets the job OOM.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from ms_memopt.cli.simulate_job import add_job_arguments, run_jobs
from ms_memopt.core.errors import InputError
from ms_memopt.core.units import format_size, parse_size

__all__ = ["add_parser", "run"]


def add_parser(parser) -> None:
    parser.add_argument("recipe", help="recipe YAML (MindFormers keys + memopt section), or a step template "
                                       "MODEL.template.json (ms-memopt learn) with --schedule")
    add_job_arguments(parser)
    parser.add_argument("--seeds", type=int, default=None, help="run job seeds 0..N-1 and report the median")
    parser.add_argument("--out", default=None, help="directory for timeline.jsonl and plots")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--export-memory-viz", default=None, metavar="FILE.pickle",
                        help="write the events of the rank the job is judged by (model addresses) and final layout as a "
                             "PyTorch memory snapshot for pytorch.org/memory_viz; several policies: "
                             "FILE.<policy>.pickle")
    parser.add_argument("--export-max-entries", type=int, default=None, metavar="N",
                        help="keep only the newest N trace entries of --export-memory-viz, and the final state (as "
                             "PyTorch's _record_memory_history(max_entries=N)); default: every entry")
    parser.add_argument("--fail-on-oom", action="store_true", help="exit 1 when a policy lets the job OOM")
    # a learned step template (MODEL.template.json, ms-memopt learn) instead of a recipe
    parser.add_argument("--schedule", default=None, metavar="FILE.csv",
                        help="template only: one row per step, one column per dim (header: the dim names)")
    parser.add_argument("--export-events", default=None, metavar="OUT.jsonl",
                        help="template only: write the events with the model's addresses (JSONL)")
    parser.add_argument("--capacity", default=None, metavar="SIZE",
                        help="the device capacity per card, e.g. 80GiB (a recipe: overrides memopt.device.hbm)")
    parser.add_argument("--free-order", type=_free_order, default=None, metavar="K|all",
                        help="template only: simulate in the free order of entry K of the template's free_orders "
                             "(a calibration process's own; default: the most common); all: every order, one "
                             "result per distinct layout (the addresses a process can get)")
    parser.add_argument("--keep-runtime-leak", action="store_true",
                        help="template only: also simulate the allocations learn recognised as MindSpore's own "
                             "leak (CPU PyNative op arguments never freed; left out by default); to compare with a "
                             "recording of that runtime")
    parser.add_argument("--free-order-from", default=None, metavar="REC.jsonl",
                        help="template only: simulate in the free order the recorded process drew, read from its "
                             "first step (MindSpore draws it once per process on CPU)")


def _free_order(text: str) -> int | str:
    """``--free-order``'s value: an entry of the template's ``free_orders``, or ``all``."""
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an entry number or all, got {text!r}") from None



def run(args) -> int:
    if str(args.recipe).endswith(".template.json"):      # a learned step template (ms-memopt learn)
        from ms_memopt.cli.simulate_template import run as run_template
        return run_template(args)
    for flag in ("schedule", "export_events", "free_order", "free_order_from"):
        if getattr(args, flag, None) is not None:
            raise InputError("only for a step template (MODEL.template.json, ms-memopt learn)"
                             + ("; a recipe names one as memopt.workload.schedule" if flag == "schedule" else ""),
                             key="--" + flag.replace("_", "-"))
    if getattr(args, "keep_runtime_leak", False):
        raise InputError("only for a step template (MODEL.template.json, ms-memopt learn)", key="--keep-runtime-leak")
    from ms_memopt.config.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    if args.capacity is not None:
        recipe = with_capacity(recipe, parse_size(args.capacity, source="--capacity", positive=True))
        print(f"capacity: {recipe.notes[-1]}", file=sys.stderr)
    return run_jobs(recipe, args)


def with_capacity(recipe, capacity: int):
    """``recipe`` with its card's memory (``memopt.device.hbm``) set to ``capacity`` bytes
    (``simulate --capacity``), and a note in ``recipe.notes`` saying what it replaced."""
    was = recipe.capacity
    device = dataclasses.replace(recipe.memopt.device, hbm=capacity)
    note = (f"--capacity {format_size(capacity)} overrides memopt.device.hbm"
            + (f" ({format_size(was)} in the recipe)" if was is not None else ""))
    return dataclasses.replace(recipe, memopt=dataclasses.replace(recipe.memopt, device=device),
                               notes=(*recipe.notes, note))




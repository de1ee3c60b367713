"""``ms-memopt pack INSTANCE``: static placement of buffers with known lifetimes.

Reads an ``id,lower,upper,size`` CSV (or, when the file is not one, an event trace through
:func:`ms_memopt.io.traces.load_trace`), packs it with :func:`ms_memopt.analysis.planner.pack`, checks
the result and prints the arena, the lower bound, their ratio, whether the arena is proven
optimal and, if not, by how much it could still be off (the gap to the best proven lower
bound). The search stops early when it stagnates (``--stall``) and shows a progress bar on
stderr when it runs for more than a second. Exit 1 when ``--capacity`` is given and the
placement does not fit, 2 on bad input.

Example:
    ms-memopt pack A.1048576.csv --capacity 1048576 --time-limit 60 --out offsets.csv
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from ms_memopt.analysis.planner import DEFAULT_STALL, DEFAULT_TIME_LIMIT, Buffer, pack
from ms_memopt.core.errors import InputError
from ms_memopt.core.outputs import check_output_file
from ms_memopt.core.placement import buffers_from_events
from ms_memopt.core.units import format_size, parse_size
from ms_memopt.io.traces import load_trace
from ms_memopt.io.traces.instances import looks_like_instance, read_instance, write_offsets

__all__ = ["add_parser", "run", "load_buffers"]


def add_parser(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``ms-memopt pack``."""
    parser.add_argument("instance", help="id,lower,upper,size CSV (lifetimes half-open), or an event trace")
    parser.add_argument("--capacity", help="bytes available, e.g. 1048576, 512MiB, 4.2GB")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help=f"seconds for the whole packing (default {DEFAULT_TIME_LIMIT:g})")
    parser.add_argument("--gap", type=float, default=0.0,
                        help="stop once arena <= lower bound x (1 + GAP) (default 0: aim for the bound)")
    # argparse %-formats help strings: a literal percent sign is written %%
    parser.add_argument("--stall", type=float, default=None, metavar="S",
                        help="stop improving after S seconds without progress (default "
                             f"{DEFAULT_STALL * 100:g}%% of the time limit, at least 1 s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", metavar="OFFSETS.csv", help="write id,offset rows here")


def load_buffers(path: str | os.PathLike, *, deadline: float | None = None) -> list[Buffer]:
    """Buffers from an instance CSV (detected by its header) or, failing that, an event trace.

    Raises:
        InputError: missing file, malformed instance, or a file neither format accepts.
    """
    name = str(path)
    if not Path(name).exists():
        raise InputError("no such file", source=name)
    if Path(name).is_dir():
        raise InputError("is a directory, expected an instance CSV or a trace file", source=name)
    if looks_like_instance(name) or _first_line(name).lower().startswith("id,"):
        return read_instance(name, deadline=deadline)  # an instance, or close enough for its reader's precise complaint
    trace = load_trace(name)
    buffers = buffers_from_events(list(trace.events))
    if not buffers:
        raise InputError("the trace holds no allocation", source=name)
    return buffers


def _optimality(solution) -> str:
    """"yes, proven" or how far above the optimum the arena could still be."""
    if solution.optimal:
        how = "equals the lower bound" if solution.arena <= solution.lower_bound else \
            "the search ruled out every smaller arena"
        return f"yes, proven ({how})"
    bound = solution.best_bound
    stronger = "" if bound == solution.lower_bound else \
        f", raised from the peak {solution.lower_bound} B by exhausted searches"
    return (f"not proven: at most {solution.arena - bound} B ({solution.gap * 100:.2g} %) above the optimum "
            f"(best lower bound {bound} B{stronger})")


def _first_line(path: str) -> str:
    """The first line of ``path`` (a pipe's head is kept for the reader; a FIFO without a writer
    is an InputError after a wait, not a hang: :func:`ms_memopt.core.lines.read_head`)."""
    from ms_memopt.core.lines import read_head

    return read_head(path, 65536).decode("utf-8", errors="replace").split("\n", 1)[0].strip()


def _parse_capacity(text: str | None) -> int | None:
    return None if text is None else parse_size(text, source="--capacity", positive=True)


def run(args: argparse.Namespace) -> int:
    """Pack, report, write offsets; exit 1 when a capacity is given and not met."""
    capacity = _parse_capacity(args.capacity)
    if args.time_limit is not None and not args.time_limit >= 0:
        raise InputError(f"expected seconds >= 0, got {args.time_limit}", source="--time-limit")
    if not (args.gap >= 0 and math.isfinite(args.gap)):
        raise InputError(f"expected a finite gap >= 0, got {args.gap}", source="--gap")
    if args.stall is not None and not args.stall >= 0:
        raise InputError(f"expected seconds >= 0, got {args.stall}", source="--stall")
    if args.out:        # before the search: not a FIFO (it waits for a reader), not the instance itself
        check_output_file(args.out, key="--out", inputs=[args.instance])
    # the time limit covers reading and every step after it, not the search alone
    limit = DEFAULT_TIME_LIMIT if args.time_limit is None else args.time_limit
    started = time.perf_counter()
    buffers = load_buffers(args.instance, deadline=started + limit)
    remaining = max(0.0, limit - (time.perf_counter() - started))
    solution = pack(buffers, capacity=capacity, time_limit=remaining, gap=args.gap,
                    stall=args.stall, progress=not args.no_progress)
    if args.out:
        ordered = {b.id: solution.offsets[b.id] for b in buffers}
        write_offsets(ordered, args.out)
    report = {
        "instance": str(args.instance),
        "buffers": len(buffers),
        "lower_bound": solution.lower_bound,
        "arena": solution.arena,
        "ratio": round(solution.ratio, 6),
        "capacity": capacity,
        "fits": solution.fits,
        "valid": solution.valid,
        "optimal": solution.optimal,
        "proven_bound": solution.best_bound,
        "gap": round(solution.gap, 9),
        "stopped": solution.stopped,
        "method": solution.method,
        "seconds": round(solution.seconds, 3),
        "fit_seconds": None if solution.fit_seconds is None else round(solution.fit_seconds, 3),
    }
    if args.out:
        report["out"] = str(args.out)
    if not solution.valid:
        report["problems"] = solution.problems[:10]
    if args.json:
        print(json.dumps(report))
    else:
        rows = [
            ("buffers", f"{len(buffers)}"),
            ("lower bound", f"{solution.lower_bound} B ({format_size(solution.lower_bound)}), peak live bytes"),
            ("arena", f"{solution.arena} B ({format_size(solution.arena)})"),
            ("ratio", f"{solution.ratio:.6f}" + ("  (optimal)" if solution.optimal else "")),
            ("optimal", _optimality(solution)),
            ("capacity", "-" if capacity is None else
             f"{capacity} B ({format_size(capacity)}): " +
             (f"fits (first fit after {solution.fit_seconds:.3f} s)" if solution.fits else "DOES NOT FIT")),
            ("valid", "yes (no overlap in time x address)" if solution.valid else
             "NO: " + "; ".join(solution.problems[:3])),
            ("method", solution.method + (f" (stopped: {solution.stopped})" if solution.stopped else "")),
            ("seconds", f"{solution.seconds:.3f}"),
        ]
        if args.out:
            rows.append(("offsets", str(args.out)))
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
    if not solution.valid:
        return 1
    return 1 if solution.fits is False else 0

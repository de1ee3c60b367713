"""``ms-memopt doctor TRACE [B] [--capacity SIZE] [--out DIR] [--json]``: what killed (or would
kill) a recorded run, the blocks in the way, and the settings that save it, measured.

Reads every format ``replay`` reads. With one recording: the verdict, the blockers and the
remedies ranked (:mod:`ms_memopt.doctor.diagnose`); ``--out DIR`` also writes ``report.md`` with the
remedies' timelines and the memory map at the worst moment, the blockers outlined. With two:
where they part and which fragments more. Exit codes: 0 ok, 1 with ``--fail-on-oom`` when the
recording dies at ``--capacity``, 2 bad input.

Example:
    ms-memopt doctor snapshot.pickle --capacity 40GB
    ms-memopt doctor run_seq2k.jsonl run_seq4k.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ms_memopt.core.errors import InputError
from ms_memopt.core.outputs import check_output_folder, write_text_in
from ms_memopt.core.units import format_size, parse_size

__all__ = ["add_parser", "run", "write_report", "recorded_capacity"]

_SHOWN_BLOCKERS = 12


def add_parser(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``ms-memopt doctor``."""
    from ms_memopt.io.traces import FORMATS

    parser.add_argument("trace", help="the recording (format detected from its content), or a failed job's log "
                                      "(plain or .gz) or log folder (msrun's worker_N.log, rank_N/, MindFormers' output/log/)")
    parser.add_argument("other", nargs="?", default=None,
                        help="a second recording: compare the two (first divergence, which fragments more)")
    parser.add_argument("--capacity", metavar="SIZE", default=None,
                        help="device memory the pool may reserve (e.g. 40GB); default: the card the recording "
                             "names (ms-memopt's exports), else unbounded")
    parser.add_argument("--allocator", metavar="NAME", default=None,
                        help="the recorded allocator's model (default: the one that recorded it)")
    parser.add_argument("--format", default=None, choices=list(FORMATS), help="skip format detection")
    parser.add_argument("--out", metavar="DIR", default=None, help="write report.md and its plots here")
    parser.add_argument("--json", action="store_true", help="print one JSON object (sizes in bytes)")
    parser.add_argument("--fail-on-oom", action="store_true",
                        help="exit 1 when the recording runs out of memory at --capacity (a log: holds an OOM report)")
    from ms_memopt.cli.doctor_logs_cmd import add_arguments

    add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ms_memopt.allocators import MODELS
    from ms_memopt.cli.doctor_logs_cmd import crash_route
    from ms_memopt.doctor.diagnose import compare, diagnose
    from ms_memopt.io.traces import load_trace

    from ms_memopt.io.traces.memory_viz import check_export_path

    for path in (args.trace, args.other):       # simulate wrote FILE.<policy>.pickle: name them
        if path is not None:
            check_export_path(path)
    routed = crash_route(args)     # a failed job's log or log folder, not a recording
    if routed is not None:
        return routed
    capacity = None if args.capacity is None else parse_size(args.capacity, source="--capacity", positive=True)
    if args.allocator is not None and (args.allocator not in MODELS or args.allocator == "pool"):
        raise InputError(f"unknown allocator {args.allocator!r}; expected one of "
                         f"{', '.join(m for m in MODELS if m != 'pool')}", key="--allocator")
    trace = _load(load_trace, args.trace, args.format)
    if args.other is not None:
        other = _load(load_trace, args.other, args.format)
        comparison = compare(trace, other, capacity=capacity)
        print(json.dumps(comparison.to_dict()) if args.json else _comparison_text(comparison))
        return 0
    from ms_memopt.core.progress import progress_bar

    # one unit per setting replayed (the baseline's replays come first, before the first name)
    with progress_bar(None, "doctor: replaying", "setting", enabled=not args.json) as bar:
        def progress(name: str) -> None:
            bar.set_postfix_str(name, refresh=False)
            bar.update(1)

        capacity_why = "--capacity" if capacity is not None else "unbounded"
        if capacity is None:
            capacity, capacity_why = recorded_capacity(trace, args.allocator)
        diagnosis = diagnose(trace, capacity=capacity, allocator=args.allocator, progress=progress)
        diagnosis.capacity_why = capacity_why
    if args.out:
        write_report(diagnosis, Path(args.out), trace=trace)
    print(json.dumps(diagnosis.to_dict()) if args.json else _text(diagnosis, args.out))
    return 1 if args.fail_on_oom and diagnosis.verdict.failed else 0


def recorded_capacity(trace, allocator: str | None) -> tuple[int | None, str]:
    """The card the recording ran on, when it names one (``simulate --export-memory-viz``) and is
    replayed through its own model (``replay`` and ``doctor`` without ``--capacity``: as
    recorded, the same pool and addresses), with what decided it; else ``(None, "unbounded")``."""
    from ms_memopt.replay.replay import recorded_allocator

    recorded = recorded_allocator(trace)
    if recorded.capacity is None or allocator not in (None, recorded.name):
        return None, "unbounded"
    return recorded.capacity, "the recording's card; --capacity to change"


def _load(load_trace, path: str, fmt: str | None):
    from ms_memopt.io.traces.ms_pool_log import ASCEND_POOL_NAME, POOL_NAME, recorded_final_layout

    trace = load_trace(path, format=fmt)
    if trace.final is None and trace.meta.get("pool") in (POOL_NAME, ASCEND_POOL_NAME):
        trace.final = recorded_final_layout(trace.events)
    return trace


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _text(d, out: str | None) -> str:
    v = d.verdict
    options = f" {d.allocator_options}" if d.allocator_options else ""
    why = getattr(d, "capacity_why", "")
    lines = [f"recording   {d.trace} ({d.format}, {d.events:,} events), replayed through {d.allocator}{options}, "
             "capacity " + (format_size(d.capacity) if d.capacity is not None else "unbounded")
             + (f" ({why})" if why and d.capacity is not None and why != "--capacity" else ""),
             f"allocator   {d.allocator} ({d.family} settings): {d.allocator_why}",
             f"peaks       allocated {format_size(d.peak_allocated)}, reserved {format_size(d.peak_reserved)}",
             f"verdict     {v.kind.upper()}" + (" (a request failed)" if v.failed else "")
             + (f" at event {v.event}" if v.event is not None else "") + f": {v.text}"]
    if d.blockers:
        of_first = " at the first failure" if v.kind != "fragmentation" else ""
        lines.append(f"blockers    {len(d.blockers)} live blocks, {format_size(d.window_bytes or 0)} to move, would "
                     f"open the hole{of_first} (largest first):")
        for b in sorted(d.blockers, key=lambda b: -b.size)[:_SHOWN_BLOCKERS]:
            life = "alive before the recording" if b.allocated_at is None else (
                f"allocated at event {b.allocated_at}, " + ("never freed" if b.freed_at is None
                                                             else f"freed at {b.freed_at}"))
            flag = " LONG-LIVED between transients" if b.between_transients else (" long-lived" if b.long_lived else "")
            where = f"; {b.frames[0]}" if b.frames else ""
            lines.append(f"  {format_size(b.size):>11}  {b.tag or '-'}  {life}{flag}{where}")
        if len(d.blockers) > _SHOWN_BLOCKERS:
            lines.append(f"  ... {len(d.blockers) - _SHOWN_BLOCKERS} more (--json or --out lists all)")
    elif v.kind == "fragmentation":
        lines.append("blockers    none found: no window of live blocks holds the request")
    if v.kind == "none":
        lines.append(f"remedies    none needed: {d.summary}")
        return "\n".join(lines + ([f"report      {Path(out) / 'report.md'}"] if out else []))
    lines.append(f"advice      {d.summary}")
    if not d.remedies and not d.skipped:
        return "\n".join(lines + ([f"report      {Path(out) / 'report.md'}"] if out else []))
    lines.append(f"remedies    {d.family}'s settings, measured (best first: survives at the capacity, then peak "
                 "reserved without a capacity, then worst frag)")
    base = next((r for r in d.remedies if r.setting == "baseline"), None)
    parted = False
    for r in d.remedies:
        if not r.measured:
            lines.append(f"  {r.setting:<36} {r.note}")
            continue
        if d.capacity is not None and not r.survives and not parted:
            parted = True
            lines.append(f"  -- {'none of these' if r is d.remedies[0] else 'these do not'} survive"
                         f" {format_size(d.capacity)} --")
        peak = (f"{format_size(r.peak_reserved_unbounded)}{_saving(r, base)}" if r.unbounded else
                f"{format_size(r.peak_reserved)} (the card: it takes all it is given)")
        lines.append(f"  {r.setting:<36} {'survives' if r.survives else f'{r.oom_count} OOM'}; peak reserved "
                     f"{peak}; frag max {_ratio(r.frag_ratio_max)}; slow path "
                     f"{r.slow_path_events}; {'address-verified' if r.verified else 'from the source'}")
        lines.append(f"  {'':<36} set: {r.line}")
        if r.setting == "pool mode" and r.note:
            lines.append(f"  {'':<36} {r.note}")
    for s in d.skipped:
        lines.append(f"  {s.setting:<36} not tried: {s.why}")
    if out:
        lines.append(f"report      {Path(out) / 'report.md'}")
    return "\n".join(lines)


def _saving(remedy, base) -> str:
    """Against the recorded setting, both without a capacity."""
    if base is None or remedy is base or not base.unbounded:
        return ""
    delta = base.peak_reserved_unbounded - remedy.peak_reserved_unbounded
    return f" ({format_size(abs(delta))} {'less' if delta >= 0 else 'more'})" if delta else " (the same)"


def _comparison_text(c) -> str:
    lines = [f"A = {c.a}", f"B = {c.b}",
             "first divergence: " + ("none" if c.first_divergence is None else c.difference), c.summary,
             "matched moments (fraction of each recording): reserved / in use / largest hole"]
    for row in c.moments:
        cells = []
        for side in ("a", "b"):
            m = row[side]
            cells.append("-" if m is None else f"{format_size(m['reserved'])} / {format_size(m['allocated'])} / "
                                               f"{format_size(m['largest_free'])}")
        lines.append(f"  {row['fraction']:.0%}  A {cells[0]}   B {cells[1]}")
    return "\n".join(lines)


def write_report(d, out: Path, *, trace=None) -> Path:
    """``out/report.md``: verdict, blockers, remedies, a timeline of each remedy against the
    request, and the memory map at the worst moment with the blockers outlined; with ``trace``
    also ``memory_viz.pickle`` for PyTorch's viewer, purposes and blockers in its legend."""
    from ms_memopt.report.plots import plot_timeline
    from ms_memopt.io.layouts import LayoutSnapshot
    from ms_memopt.report.memory_map import plot_memory_map
    out.mkdir(parents=True, exist_ok=True)
    check_output_folder(out, ("report.md", "remedies_timeline.png", "memory_map.png", "memory_viz.pickle"))
    # the recorded setting and the best four others: more lines than that cannot be told apart
    shown = [r for r in d.remedies if r.timeline and r.setting != "baseline"][:4]
    shown += [r for r in d.remedies if r.timeline and r.setting == "baseline"]
    series = {r.setting: list(r.timeline) for r in shown}
    lines = [f"# ms-memopt doctor: {Path(d.trace).name}", "",
             f"Replayed through `{d.allocator}`" + (f" {d.allocator_options}" if d.allocator_options else "")
             + f" ({d.allocator_why}), capacity "
             + (format_size(d.capacity) if d.capacity is not None else "unbounded")
             + f"; peaks: allocated {format_size(d.peak_allocated)}, reserved {format_size(d.peak_reserved)}.", "",
             f"## Verdict: {d.verdict.kind}", "", d.verdict.text, "", f"**Advice:** {d.summary}", ""]
    if series:
        requests = {"the failing request": d.verdict.request} if d.verdict.request else None
        plot_timeline(series, out / "remedies_timeline.png", title="largest hole under each setting",
                      requests=requests, xlabel="event index of the recording", xunit="event")
        lines += ["![largest hole under each setting](remedies_timeline.png)", ""]
    placed = _placed_head(d, trace) if trace is not None else None
    if d.layout is not None and d.layout.segments:
        spans = [(b.addr, b.size) for b in d.blockers]
        layout = _tagged(d.layout, placed[0]) if placed is not None else d.layout
        plot_memory_map([LayoutSnapshot(d.verdict.event or 0, f"before event {d.verdict.event}", layout)],
                        out / "memory_map.png", title="the pool at the worst moment (blockers outlined in red)",
                        outline=spans)
        lines += ["![memory map](memory_map.png)", ""]
    lines += ["## Blockers", ""]
    if d.blockers:
        lines += [f"{len(d.blockers)} live blocks ({format_size(d.window_bytes or 0)}) whose moving or absence would "
                  "have opened the hole.", "", "| size | tag | allocated at | freed at | long-lived | between "
                  "transients | frames |", "|---|---|---|---|---|---|---|"]
        for b in sorted(d.blockers, key=lambda b: -b.size):
            lines.append(f"| {format_size(b.size)} | {b.tag or ''} | {'' if b.allocated_at is None else b.allocated_at} "
                         f"| {'' if b.freed_at is None else b.freed_at} | {'yes' if b.long_lived else ''} | "
                         f"{'yes' if b.between_transients else ''} | {'<br>'.join(b.frames[:2])} |")
    else:
        lines.append("None: no window of live blocks holds the request.")
    lines += ["", "## Remedies, measured", ""]
    if d.verdict.kind == "none":
        lines += ["None needed: " + d.summary + "."]
    elif not d.remedies and not d.skipped:
        lines += ["None measured: the run's live tensors alone are more than the card, which no setting changes."]
    else:
        lines += [f"{d.family}'s settings, ranked by survival at the capacity, then peak reserved without a capacity "
                  "(what the setting saves), then the worst frag ratio.", "",
                  "| setting | survives | OOMs | peak reserved | frag max | slow path | "
                  "model | what to set |", "|---|---|---|---|---|---|---|---|"]
    for r in d.remedies:
        lines.append(f"| {r.setting} | {'yes' if r.survives else 'no'} | {r.oom_count} | "
                     f"{format_size(r.peak_reserved_unbounded)} "
                     f"| {_ratio(r.frag_ratio_max)} | {r.slow_path_events} | "
                     f"{'address-verified' if r.verified else 'from the source'} | `{r.line}` {r.note} |")
    if d.skipped:
        lines += ["", "Not tried on this recording:", ""] + [f"- {s.setting}: {s.why}" for s in d.skipped]
    if placed is not None:
        viz = _memory_viz(d, placed, out / "memory_viz.pickle")
        if viz:
            lines += ["", f"Open `{viz.name}` in PyTorch's memory viewer (pytorch.org/memory_viz): blocks are "
                      "coloured by purpose, the blockers in categories of their own (`blocker: ...`)."]
    return write_text_in(out, "report.md", "\n".join(lines) + "\n")


def _placed_head(d, trace):
    """The recording up to the worst moment as the model placed it (``placed_events``), or
    ``None`` (said on stderr) for a format the replay cannot place."""
    from ms_memopt.allocators import create
    from ms_memopt.replay.replay import placed_events

    stop = d.verdict.event if d.verdict.event is not None else len(trace.events)
    head = type(trace)(trace.events[:stop], source=trace.source, format=trace.format, initial=trace.initial,
                       meta=trace.meta)
    try:
        return placed_events(head, create(d.allocator, d.capacity, **d.allocator_options))
    except (InputError, NotImplementedError) as exc:    # a format the viewer cannot show: say so
        print(f"ms-memopt doctor: no memory map tags and no memory_viz.pickle: {exc}", file=sys.stderr)
        return None


def _tagged(layout, events):
    """``layout`` with each live block's tag from the recording (the allocator model keeps none):
    the tag of the allocation placed at its address and not freed before the layout's moment."""
    from dataclasses import replace

    live: dict[int, str | None] = {}
    for event in events:
        if event.addr is None:
            continue
        if event.action == "alloc":
            live[event.addr] = event.tag
        elif event.action == "free":
            live.pop(event.addr, None)
    segments = [replace(seg, blocks=[replace(b, tag=b.tag or live.get(b.addr)) if b.live else b for b in seg.blocks])
                for seg in layout.segments]
    return replace(layout, segments=segments)


def _memory_viz(d, placed, path: Path) -> Path | None:
    """The recording as the model placed it, up to the worst moment, blockers marked."""
    from ms_memopt.io.traces.memory_viz import write_memory_viz

    events, result = placed
    try:
        write_memory_viz(path, events, result.final_layout, blockers=[b.id for b in d.blockers if b.id is not None],
                         recorded_by={"source": "ms-memopt doctor", "allocator": d.allocator,
                                      "allocator_options": d.allocator_options, "recording": str(d.trace)})
    except (InputError, NotImplementedError) as exc:    # a format the viewer cannot show: say so
        print(f"ms-memopt doctor: no memory_viz.pickle: {exc}", file=sys.stderr)
        return None
    return path

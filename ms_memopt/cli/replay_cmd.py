"""``ms-memopt replay TRACE``: replay a recorded trace through an allocator model.

Prints peaks, segments, OOMs and fragmentation in human units, or with ``--json`` one object in
bytes (the fields of :class:`~ms_memopt.replay.replay.ReplayResult` plus ``trace``, ``format``,
``capacity`` and ``oom_count``). Exit codes: 0 ok, 1 OOMs happened and ``--fail-on-oom`` was
given, 2 bad input.

Example:
    ms-memopt replay memory_block.csv --allocator mindspore --capacity 64GB --json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import stat
import sys

from ms_memopt.core.errors import InputError
from ms_memopt.core.outputs import check_output_file
from ms_memopt.core.units import format_size, parse_size
from ms_memopt.replay.replay import default_allocator, recorded_allocator
from ms_memopt.io.traces.memory_viz import check_export_path
from ms_memopt.io.traces.ms_pool_log import ASCEND_POOL_NAME, POOL_NAME, recorded_final_layout

__all__ = ["add_parser", "run", "default_allocator", "check_profiler_folder"]


def add_parser(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``ms-memopt replay``."""
    from ms_memopt.allocators import MODELS
    from ms_memopt.io.traces import FORMATS

    parser.add_argument("trace", help="trace file (format detected from its content)")
    parser.add_argument("--allocator", metavar="NAME", default=None,
                        help=f"allocator model: {', '.join(MODELS)} (default: from the recording: torch, torch-expandable, torch-npu or "
                             "torch-npu-expandable for PyTorch/torch_npu snapshots as they show it, torch for "
                             "msMemScope files, mindspore-bestfit for MindSpore pool logs and their recordings, "
                             "mindspore otherwise; the output says what decided it)")
    parser.add_argument("--capacity", metavar="SIZE", default=None,
                        help="device memory the pool may reserve, e.g. 64GB, 96GiB (default: the card the "
                             "recording names, ms-memopt's exports; else unbounded)")
    parser.add_argument("--format", default=None, choices=list(FORMATS), help="skip format detection")
    parser.add_argument("--component", metavar="NAME", default=None,
                        help="the Ascend profiler's component to replay (PTA, MindSpore, GE, WORKSPACE; "
                             "default the framework's)")
    parser.add_argument("--allocator-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a model option, typed per option (e.g. increase_size=512MiB, grow=add, "
                             "max_split_size_mb=128, garbage_collection_threshold=0.8); repeatable")
    parser.add_argument("--policy", default="baseline", choices=("baseline", "compact", "pool"),
                        help="what-if: compact at the recording's step ends, or pool mode with regions sized "
                             "from the recording (needs --capacity); default baseline (docs/traces.md)")
    parser.add_argument("--compact-every", type=int, default=1, metavar="N",
                        help="with --policy compact: every N-th step event (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (sizes in bytes)")
    parser.add_argument("--fail-on-oom", action="store_true", help="exit 1 when any request ran out of memory")
    parser.add_argument("--strict", action="store_true",
                        help="exit 2 when the trace is inconsistent (frees of unknown ids, double frees, an id "
                             "allocated while live, overlapping recorded addresses, a segment freed that was never "
                             "allocated); without it they are counted in the output")
    parser.add_argument("--export-memory-viz", metavar="FILE", default=None,
                        help="also write the events as the model placed them, its segments and final layout, as a "
                             "PyTorch memory snapshot (pytorch.org/memory_viz, MindStudio Insight)")
    parser.add_argument("--export-max-entries", type=int, default=None, metavar="N",
                        help="keep only the newest N trace entries of --export-memory-viz, and the final state")
    parser.add_argument("--export-profiler", metavar="DIR", default=None,
                        help="also write the run as the model placed it as torch_npu's profiler output of one rank, "
                             "DIR/rank0_ascend_pt (operator_memory.csv, memory_record.csv, trace_view.json and "
                             "ascend_pytorch_profiler_0.db), for msprof-analyze compare and MindStudio Insight")
    parser.add_argument("--export-instances", metavar="FILE.csv", default=None,
                        help="also write the trace's buffers as an id,lower,upper,size instance for `ms-memopt pack`")


def _policy_lines(policy: dict) -> list[str]:
    if policy.get("name") == "compact":
        return [f"policy           compact every {policy['every']} step(s): {policy['compactions']} compactions, "
                f"{format_size(policy['bytes_moved'])} moved; frag before {_ratio(policy['frag_before_max'])} "
                f"-> after {_ratio(policy['frag_after_max'])} (worst)"]
    if policy.get("name") == "pool":
        regions = ", ".join(f"{k} {format_size(v)}" for k, v in policy["regions"].items())
        return [f"policy           pool mode: {regions} (a region per purpose the recording's lifetimes show; "
                f"{policy['long_lived']:,} long-lived tensors; sized from this recording, a best case)"]
    return []


def _finite(value):
    return value if not isinstance(value, float) or math.isfinite(value) else None


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _ratio(value: float | None) -> str:
    return "n/a (nothing free)" if value is None else f"{value:.2f}"


def run(args: argparse.Namespace) -> int:
    """Run the command; returns the exit code."""
    from ms_memopt.allocators import create
    from ms_memopt.allocators.options import parse_allocator_options
    from ms_memopt.replay.replay import replay
    from ms_memopt.replay.viz_export import export_replay
    from ms_memopt.io.traces import load_trace
    from ms_memopt.io.traces.memory_viz import check_max_entries

    capacity = None if args.capacity is None else parse_size(args.capacity, source="--capacity", positive=True)
    # a plain replay of a large pool log or JSONL (or of a pipe) reads it as a stream: memory holds
    # the model's state and one chunk of events, whatever the file's size (an export is written as a
    # stream too; instances and policies need the whole event list; smaller files are read whole,
    # sampled ~200 times as before)
    streamable = (args.policy == "baseline" and not args.export_instances and not args.export_profiler
                  and _large_or_pipe(args.trace))
    check_export_path(args.trace)
    check_max_entries(args.export_max_entries, args.export_memory_viz)
    for key, target in (("--export-memory-viz", args.export_memory_viz), ("--export-instances", args.export_instances)):
        if target:      # not a FIFO (it waits for a reader), not the recording itself
            check_output_file(target, key=key, inputs=[args.trace])
    if args.export_profiler:
        check_profiler_folder(args.export_profiler, inputs=[args.trace])
    trace = load_trace(args.trace, format=args.format, **({"stream": True} if streamable else {}))
    if args.component is not None:
        if trace.format != "ascend-profiler":
            raise InputError(f"--component applies to the Ascend profiler's output, not {trace.format}",
                             key="--component")
        from ms_memopt.io.traces.ascend_profiler import read_ascend_profiler

        trace = read_ascend_profiler(args.trace, component=args.component)
    # what decided the model, said in the output: the option, or what the recording shows
    recorded = recorded_allocator(trace)
    name = args.allocator or recorded.name
    reason = "--allocator" if args.allocator else recorded.why
    capacity_why = "--capacity" if capacity is not None else None
    if capacity is None and recorded.capacity is not None and name == recorded.name:
        capacity, capacity_why = recorded.capacity, "the recording's card; --capacity to change"
    if (trace.final is None and trace.meta.get("pool") in (POOL_NAME, ASCEND_POOL_NAME)
            and isinstance(trace.events, list)):        # a stream's reader sets it at the end
        trace.final = recorded_final_layout(trace.events)
    if name == "pool":
        # the pool model splits memory into regions sized from a recipe's memopt.pool section;
        # a trace alone does not say how big each region is
        raise InputError("the pool model needs region sizes from a recipe, which replay does not "
                         "take; use `ms-memopt simulate RECIPE --policy pool`, or replay with "
                         "--allocator mindspore, mindspore-vmm, torch or torch-expandable",
                         key="--allocator")
    options = parse_allocator_options(name, args.allocator_option)
    if name == recorded.name and not args.allocator_option:
        options = recorded.options_for(capacity)        # as it recorded: the same pool, the same addresses
    recorded_by = {"source": "ms-memopt replay", "allocator": name, "allocator_options": options,
                   "capacity": capacity, "recording": str(trace.source)}
    try:
        if args.policy == "baseline" and args.export_memory_viz:
            result = export_replay(trace, create(name, capacity, **options), args.export_memory_viz, allocator=name,
                                   recorded_by=recorded_by, max_entries=args.export_max_entries)
        elif args.policy == "baseline":
            result = replay(trace, create(name, capacity, **options))
        else:
            from ms_memopt.replay.whatif import replay_policy

            result = replay_policy(trace, args.policy, allocator=name, capacity=capacity,
                                   compact_every=args.compact_every, options=options)
    except NotImplementedError as exc:  # e.g. a model that cannot start from a snapshot's state
        raise InputError(f"{exc}; this trace starts from a recorded state, try --allocator "
                         f"{'torch' if trace.format == 'torch-snapshot' else 'mindspore'}",
                         key="--allocator") from None
    if args.export_memory_viz and args.policy != "baseline":     # the policy swaps models: baseline's placements
        export_replay(trace, create(name, capacity, **options), args.export_memory_viz, allocator=name,
                      recorded_by={**recorded_by, "policy": "baseline"}, max_entries=args.export_max_entries)
    if args.export_profiler:
        from ms_memopt.replay.profiler_export import export_profiler

        try:
            folder = export_profiler(trace, create(name, capacity, **options), args.export_profiler)[1]
        except OSError as exc:        # a folder on the way that is a file, no permission, a full disk
            raise InputError(f"{args.export_profiler}: cannot write the profiler output: "
                             f"{exc.strerror or exc}", key="--export-profiler") from None
        print(f"profiler output: {folder} (the run as the {name} model placed it"
              f"{'' if args.policy == 'baseline' else ' under the baseline policy'}, in torch_npu's format: "
              "`msprof-analyze compare -d FOLDER -bp OTHER` reads it)", file=sys.stderr)
    if args.export_memory_viz:
        print(f"memory viz: {args.export_memory_viz} (the events as the {name} model placed them"
              f"{'' if args.policy == 'baseline' else ' under the baseline policy'}, its segments and final layout)",
              file=sys.stderr)
    if args.export_instances:
        from ms_memopt.core.placement import lower_bound
        from ms_memopt.io.traces.instances import write_instance
        from ms_memopt.io.traces.instances_events import trace_to_instances

        buffers = trace_to_instances(trace)
        write_instance(buffers, args.export_instances)
        print(f"instances: {len(buffers):,} buffers (id,lower,upper,size; the peak of live bytes "
              f"{format_size(lower_bound(buffers))}) written to {args.export_instances}; "
              f"`ms-memopt pack {args.export_instances}` places them with their lifetimes known", file=sys.stderr)

    out = {"trace": trace.source, "format": trace.format, "capacity": capacity}
    out.update(result.to_dict())
    out["allocator_reason"] = reason
    out["capacity_reason"] = capacity_why
    out["allocator_options"] = options
    out["address_note"] = _address_note(result.address_match, name, recorded)
    if isinstance(trace.meta.get("recorded"), dict):   # the recording's own figures (the Ascend profiler's)
        out["recorded"] = trace.meta["recorded"]
    if "pool_log" in trace.meta:      # what the pool-log reader skipped or inferred
        out["pool_log"] = trace.meta["pool_log"]
    found = trace.inconsistencies       # what cannot have happened (core/consistency.py)
    if found:
        out["inconsistencies"] = found
        summary = ", ".join(f"{v['count']:,} {k} (first at line {v['first_line']})" for k, v in found.items())
        if args.strict:
            raise InputError(f"an inconsistent trace: {summary} (--strict)", source=str(trace.source))
        print(f"ms-memopt replay: warning: {trace.source}: an inconsistent trace: {summary}; replayed anyway "
              "(--strict to refuse)", file=sys.stderr)
    out = {key: _finite(value) for key, value in out.items()}
    if args.json:
        print(json.dumps(out))
    else:
        print(_human(out, result))
    return 1 if (args.fail_on_oom and result.ooms) else 0


def check_profiler_folder(directory: str, *, inputs: list[str]) -> None:
    """Refuse ``--export-profiler DIR`` where a rank folder cannot be written: DIR not a folder
    (a file, FIFO), inside an input folder, or already holding ``rank0_ascend_pt`` (a profiler's
    own output is never overwritten).

    Raises:
        InputError: naming ``--export-profiler`` and the path.
    """
    check_output_file(directory, key="--export-profiler", inputs=inputs)
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise InputError(f"{directory}: is not a folder; --export-profiler takes the folder the rank's folder "
                         "is written in", key="--export-profiler")
    rank = os.path.join(directory, "rank0_ascend_pt")
    if os.path.lexists(rank):
        raise InputError(f"{rank}: is already there; remove it or choose another folder (a profiler's output "
                         "is never overwritten)", key="--export-profiler")


#: bytes above which a plain replay streams a pool log or JSONL file
STREAM_ABOVE = 64 << 20


def _large_or_pipe(path: str) -> bool:
    """A regular file over :data:`STREAM_ABOVE` bytes, a pipe or device, or a folder of the Ascend
    profiler's output whose file to read is over that size (a missing path: no)."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return False
    if stat.S_ISREG(info.st_mode):
        return info.st_size > STREAM_ABOVE
    if stat.S_ISDIR(info.st_mode):
        from ms_memopt.io.traces.ascend_profiler import profiler_size

        return profiler_size(path) > STREAM_ABOVE
    return True


def _recorded_lines(rec: dict, out: dict) -> list[str]:
    """The recording's figures beside the model's (the reader computed them: ``Trace.meta["recorded"]``)."""
    def size(value) -> str:
        return "n/a" if value is None else format_size(value)
    lines = [f"recorded         {rec.get('component', '')}: peak allocated {size(rec.get('peak_allocated'))} "
             f"(model {size(out['peak_allocated'])}), peak reserved {size(rec.get('peak_reserved'))} "
             f"(model {size(out['peak_reserved'])})",
             f"  reserved       recorded {size(rec.get('reserved_first'))} at start, {size(rec.get('reserved_last'))} "
             f"at end; model {size(out['final_reserved'])} at end"]
    if rec.get("checked"):
        lines.append(f"  allocated      the events' curve differs from the recorded one by "
                     f"{rec.get('allocated_max_diff', 0):,} B at most over {rec['checked']:,} rows"
                     + ("" if not rec.get("allocated_max_diff") else f" (first at line {rec.get('first_diff_line')})"))
    if rec.get("allocated_first") is not None:
        lines.append(f"  before capture {size(rec['allocated_first'])} allocated ({rec.get('unseen_releases', 0)} "
                     f"released with no row, {size(rec.get('held_initial_bytes', 0))} held throughout)")
    return lines


#: below this share of allocations at the recorded address, say why
_LOW_MATCH = 0.9


def _address_note(match: float | None, name: str, recorded) -> str | None:
    """Why the address match is low, when the recording was placed by another model than ``name``
    (the user's ``--allocator``): each allocator places blocks by its own rules, so the addresses
    differ by design and the peaks and OOMs are the figures to compare."""
    if match is None or match >= _LOW_MATCH or name == recorded.name:
        return None
    return (f"the recording was placed by {recorded.name} ({recorded.why}), not by {name}: each allocator "
            f"places blocks by its own rules, so addresses are not expected to match; compare the peaks and OOMs "
            f"(replay without --allocator replays through {recorded.name})")


def _human(out: dict, result) -> str:
    kinds = {}
    for oom in result.ooms:
        kinds[oom.kind] = kinds.get(oom.kind, 0) + 1
    policy = out.get("policy") or {}
    lines = [
        f"trace            {out['trace']} ({out['format']}, {out['events']:,} events, {out['allocs']:,} allocs)",
        f"allocator        {out['allocator']}, capacity "
        + (format_size(out['capacity']) if out['capacity'] is not None else "unbounded")
        + (f" ({out['capacity_reason']})" if out.get("capacity_reason") not in (None, "--capacity") else ""),
        f"  chosen by      {out['allocator_reason']}",
        f"peak allocated   {format_size(out['peak_allocated'])}",
        f"peak reserved    {format_size(out['peak_reserved'])}",
        f"final allocated  {format_size(out['final_allocated'])}",
        f"final reserved   {format_size(out['final_reserved'])}",
        f"segments         {out['segment_allocs']:,} allocated from the device",
        *_policy_lines(policy),
        f"OOMs             {len(result.ooms)}"
        + (" (" + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")" if kinds else ""),
    ]
    if result.ooms:
        first = result.ooms[0]
        lines.append(f"  first OOM      {format_size(first.size)} at event {first.event_index}: "
                     f"{format_size(first.free_total)} free, largest hole {format_size(first.largest_free)}")
    lines += [
        f"free at end      {format_size(out['free_total_end'])}, largest hole {format_size(out['largest_free_end'])}",
        f"frag ratio       {_ratio(out['frag_ratio_end'])} at end, max {_ratio(out['frag_ratio_max'])}",
        f"address match    {_percent(out['address_match'])}"
        + ("" if out.get("final_layout_match") is None else
           f", final layout {'identical' if out['final_layout_match'] else 'differs'}"),
        *([f"  why            {out['address_note']}"] if out.get("address_note") else []),
        "speed            " + (f"{out['events_per_s']:,.0f} events/s" if out['events_per_s'] else "n/a"),
    ]
    if out.get("recorded"):
        lines += _recorded_lines(out["recorded"], out)
    log = out.get("pool_log")
    if log:
        lines.append(f"pool log         {log['pool_lines']:,} pool lines of process {log['pid']}; skipped "
                     f"{log['skipped_lines']} torn, {log['unmatched_frees']} frees of unknown addresses, "
                     f"{log['inferred_frees']} frees inferred"
                     + (f" (first skipped at line {log['skipped_at_lines'][0]})" if log['skipped_at_lines'] else ""))
    return "\n".join(lines)

"""``ms-memopt doctor LOG`` and ``ms-memopt doctor LOGDIR``: the crash-log route of ``doctor``.

``doctor`` reads a recording when the path is one (:func:`ms_memopt.io.traces.detect_format`);
otherwise a text log (plain or ``.gz``) holding an OOM message, or a whole job's log folder, comes
here (:mod:`ms_memopt.doctor.crash_logs`). Exit codes: 0 read (whatever the verdict), 1 with
``--fail-on-oom`` when an OOM report was found, 2 bad input (a file of no known format holding no
OOM message, a folder with no logs).

Example:
    ms-memopt doctor output/msrun_log/worker_104.log
    ms-memopt doctor output/msrun_log --out report/ --json
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ms_memopt.core.errors import InputError
from ms_memopt.core.outputs import check_output_folder, write_text_in
from ms_memopt.core.units import format_size

__all__ = ["add_arguments", "crash_route", "log_text", "job_text", "write_log_report", "write_job_report"]

_SHOWN_REPORTS = 6
_SHOWN_BLOCKERS = 12


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The crash-log options of ``ms-memopt doctor`` (LOGDIR: which executor reads the ranks)."""
    from ms_memopt.simulation.executors import EXECUTORS

    parser.add_argument("--executor", default="local", choices=list(EXECUTORS),
                        help="LOGDIR: read the ranks' logs on local processes (default), Dask or Ray")
    parser.add_argument("--address", default=None, help="LOGDIR: the Dask scheduler or Ray cluster to use")
    parser.add_argument("--workers", type=int, default=None, help="LOGDIR: worker processes (default: every core)")
    parser.add_argument("--recipe", metavar="YAML", default=None,
                        help="LOG/LOGDIR: the job's recipe (MindFormers YAML): what ms-memopt plan says the card needs")
    parser.add_argument("--layout", metavar="FILE", default=None,
                        help="LOG: the pool's MemoryDebugInfo<N>.txt at the failure (default: one beside the log)")


def crash_route(args: argparse.Namespace) -> int | None:
    """Run the crash-log route when ``args.trace`` is a log or a job's folder; ``None`` when it is a
    recording (the replay route runs). Raises :class:`InputError` for a file that is neither."""
    from ms_memopt.io.traces import detect_format

    path = args.trace
    if args.other is not None or getattr(args, "format", None) is not None:
        return None
    try:
        fmt = detect_format(path)
    except InputError as exc:
        if os.path.isdir(path):
            return _run_job(args)
        return _run_log(args, exc)
    if fmt == "mindspore-pool-log":
        # a pool recording (VLOG_v=12906) that also holds an OOM message: the message decides
        from ms_memopt.io.oom_logs import read_oom_log

        if read_oom_log(path).reports:
            return _run_log(args, None)
    return None


def _run_log(args: argparse.Namespace, not_a_trace: InputError | None) -> int:
    from ms_memopt.doctor.crash_logs import diagnose_log

    d = diagnose_log(args.trace, layout=args.layout)
    plan = _plan(args)
    if not d.reports:
        if not_a_trace is not None:
            raise InputError(f"{not_a_trace.message}; nor a log holding an out-of-memory message (MindSpore's "
                             "'Out of Memory!!!', 'Memory not enough', 'memory isn't enough and alloc failed'; "
                             "PyTorch's or torch_npu's 'out of memory. Tried to allocate')",
                             source=not_a_trace.source, line=not_a_trace.line)
    if args.out:
        write_log_report(d, Path(args.out), plan=plan)
    if args.json:
        print(json.dumps(dict(d.to_dict(), plan=plan), default=str))
    else:
        print(log_text(d, args.out) + (f"\nplan        {plan['text']}" if plan else ""))
    return 1 if args.fail_on_oom and d.reports else 0


def _plan(args: argparse.Namespace) -> dict | None:
    from ms_memopt.doctor.crash_logs import plan_for

    return None if getattr(args, "recipe", None) is None else plan_for(args.recipe)


def _run_job(args: argparse.Namespace) -> int:
    from ms_memopt.doctor.crash_logs import diagnose_logdir

    if args.workers is not None and args.workers < 1:
        raise InputError(f"expected a positive number of workers, got {args.workers}", key="--workers")
    plan = _plan(args)
    job = diagnose_logdir(args.trace, executor=args.executor, address=args.address, workers=args.workers)
    if args.out:
        write_job_report(job, Path(args.out), plan=plan)
    if args.json:
        print(json.dumps(dict(job.to_dict(), plan=plan), default=str))
    else:
        print(job_text(job, args.out) + (f"\nplan        {plan['text']}" if plan else ""))
    return 1 if args.fail_on_oom and job.first else 0


# --- text ----------------------------------------------------------------------------------------------
def _where(report) -> str:
    bits = [f"line {report.line}"]
    if report.time:
        bits.append(report.time)
    if report.rank is not None:
        bits.append(f"rank {report.rank}")
    if report.step is not None:
        bits.append(f"step {report.step}")
    return ", ".join(bits)


def _figures(report) -> str:
    shown = [f"{name} {fig.printed}" for name, fig in report.figures.items()]
    return "; ".join(shown) if shown else "-"


def _report_lines(report, verdict, index: int) -> list[str]:
    name = {"mindspore": "MindSpore", "torch_npu": "torch_npu", "pytorch": "PyTorch"}[report.framework]
    lines = [f"report {index:<4} {_where(report)}: {name} {report.allocator} ({report.wording})"
             + (", message cut" if report.cut else ""),
             f"  request   {'-' if report.request is None else format_size(report.request.value) + ' (' + report.request.printed + ')'}"
             + (f" (kernel {report.kernel})" if report.kernel else ""),
             f"  printed   {_figures(report)}",
             f"  verdict   {verdict.text}"]
    if report.notes:
        lines.append(f"  notes     {'; '.join(report.notes)}")
    return lines


def log_text(d, out: str | None = None) -> str:
    """The terminal text of ``doctor LOG``."""
    lines = [f"log         {d.source} ({format_size(d.bytes_read)}, {len(d.reports)} OOM report(s))"]
    if not d.reports:
        lines.append("verdict     none: no out-of-memory message in this log")
        if d.first_error:
            lines.append(f"first error {d.first_error[:200]}")
        return "\n".join(lines)
    for i, (r, v) in enumerate(zip(d.reports, d.verdicts)):
        if i == _SHOWN_REPORTS:
            lines.append(f"... {len(d.reports) - _SHOWN_REPORTS} more report(s) (--json lists all)")
            break
        lines += _report_lines(r, v, i + 1)
    v = d.verdict
    lines.append(f"verdict     (the first report) {v.text}")
    if d.layout_file:
        lines.append(f"layout      {d.layout_file}: largest hole {format_size(v.largest_free)}")
    if d.blockers:
        moved = sum(b["size"] for b in d.blockers)
        lines.append(f"blockers    {len(d.blockers)} live blocks, {format_size(moved)} to move, would open the hole "
                     "(largest first):")
        for b in d.blockers[:_SHOWN_BLOCKERS]:
            lines.append(f"  {format_size(b['size']):>11}  {b['tag'] or '-'}  at {b['addr']:#x} ({b['pool']} block "
                         f"{b['segment']:#x})")
    elif v.kind == "fragmentation" and not d.layout_file:
        lines.append("blockers    need the pool's layout at the failure: MS_ALLOC_CONF=\"memory_tracker:True\" keeps "
                     "MemoryDebugInfo<N>.txt beside the log, or record the run (below)")
    lines.append("remedies    (for this verdict and framework, best first)")
    for r in d.remedies:
        lines.append(f"  {r.setting:<30} {r.line}")
        lines.append(f"  {'':<30} {r.why}")
    lines.append(f"next time   {d.record}")
    if out:
        lines.append(f"report      {Path(out) / 'report.md'}")
    return "\n".join(lines)


def job_text(job, out: str | None = None) -> str:
    """The terminal text of ``doctor LOGDIR``."""
    from ms_memopt.doctor.crash_logs import format_counts

    with_oom = sum(1 for d in job.ranks.values() if d.reports)
    lines = [f"job         {job.folder}: {len(job.ranks)} rank log group(s), {format_size(job.bytes_read)} read; "
             f"{with_oom} with an OOM report, {len(job.followers)} failed otherwise, {len(job.silent)} without an error",
             f"verdict     {job.text}",
             f"counts      {format_counts(job.counts)} (ranks with an OOM report, by the verdict of their first)"]
    first = job.first_diagnosis
    if first is not None and first.reports:
        r, v = first.reports[0], first.verdict
        lines += [f"first       {first.source}"] + _report_lines(r, v, 1)[1:]
        lines.append("remedies    (for this verdict and framework, best first)")
        for m in first.remedies:
            lines.append(f"  {m.setting:<30} {m.line}")
        lines.append(f"next time   {first.record}")
    if job.followers:
        k = job.followers[0]
        lines.append(f"after it    e.g. rank {k}: {(job.ranks[k].first_error or '')[:160]}")
    if out:
        lines.append(f"report      {Path(out) / 'report.md'}")
    return "\n".join(lines)


# --- report.md -------------------------------------------------------------------------------------------------
def _md_reports(d) -> list[str]:
    lines = ["| # | where | framework | allocator | request | verdict | sure | text |", "|---|---|---|---|---|---|---|---|"]
    for i, (r, v) in enumerate(zip(d.reports, d.verdicts)):
        lines.append(f"| {i + 1} | {_where(r)} | {r.framework} | {r.allocator} | "
                     f"{'-' if r.request is None else r.request.printed} | {v.kind} | {'yes' if v.sure else 'no'} | "
                     f"{v.text} |")
    return lines


def _md_remedies(d) -> list[str]:
    lines = ["| setting | what to set | why |", "|---|---|---|"]
    lines += [f"| {m.setting} | `{m.line}` | {m.why} |" for m in d.remedies]
    return lines + ["", f"Record the run for a full diagnosis next time: `{d.record}`"]


def _md_plan(plan: dict | None) -> list[str]:
    return [] if not plan else ["## What the card needs (ms-memopt plan)", "", plan["text"], ""]


def write_log_report(d, out: Path, *, plan: dict | None = None) -> Path:
    """``out/report.md`` for one log (and ``memory_map.png`` when the pool's layout was read)."""
    out.mkdir(parents=True, exist_ok=True)
    check_output_folder(out, ("report.md", "memory_map.png"))
    lines = [f"# ms-memopt doctor: {Path(d.source).name}", ""]
    if not d.reports:
        lines.append("No out-of-memory message in this log.")
    else:
        v = d.verdict
        lines += [f"## Verdict: {v.kind}", "", v.text, ""]
        if d.layout is not None and d.layout.segments:
            from ms_memopt.io.layouts import LayoutSnapshot
            from ms_memopt.report.memory_map import plot_memory_map

            plot_memory_map([LayoutSnapshot(0, "at the failure", d.layout)], out / "memory_map.png",
                            title="the pool at the failure (blockers outlined in red)",
                            outline=[(b["addr"], b["size"]) for b in d.blockers])
            lines += ["![memory map](memory_map.png)", ""]
        if d.blockers:
            lines += ["## Blockers", "", "| size | tag | address | pool block |", "|---|---|---|---|"]
            lines += [f"| {format_size(b['size'])} | {b['tag'] or ''} | {b['addr']:#x} | {b['segment']:#x} |"
                      for b in d.blockers] + [""]
        lines += ["## Reports", ""] + _md_reports(d) + ["", "## Remedies", ""] + _md_remedies(d) + [""]
        lines += _md_plan(plan)
    return write_text_in(out, "report.md", "\n".join(lines) + "\n")


def write_job_report(job, out: Path, *, plan: dict | None = None) -> Path:
    """``out/report.md`` for a job's folder: the first failure, counts per verdict, every OOM rank."""
    from ms_memopt.doctor.crash_logs import format_counts

    out.mkdir(parents=True, exist_ok=True)
    check_output_folder(out, ("report.md",))
    lines = [f"# ms-memopt doctor: {job.folder}", "", f"**{job.text}**", "",
             f"Ranks read: {len(job.ranks)}; with an OOM report: {sum(1 for d in job.ranks.values() if d.reports)}; "
             f"failed otherwise (after it): {len(job.followers)}; without an error: {len(job.silent)}.", "",
             f"Verdicts (first report of each rank): {format_counts(job.counts)}.", ""]
    first = job.first_diagnosis
    if first is not None and first.reports:
        lines += ["## The first failure", "", f"Log: `{first.source}`", ""] + _md_reports(first) + \
                 ["", "## Remedies", ""] + _md_remedies(first) + [""] + _md_plan(plan)
    oom = [(k, d) for k, d in job.ranks.items() if d.reports]
    if oom:
        lines += ["## Ranks with an OOM report", "", "| rank | time | step | verdict | text |", "|---|---|---|---|---|"]
        for k, d in oom[:256]:
            r = d.reports[0]
            lines.append(f"| {k} | {r.time or ''} | {'' if r.step is None else r.step} | {d.verdict.kind} | "
                         f"{d.verdict.text} |")
    if job.followers:
        lines += ["", "## Ranks that failed after it", "", "| rank | first error |", "|---|---|"]
        lines += [f"| {k} | {(job.ranks[k].first_error or '')[:200].replace('|', '/')} |" for k in job.followers[:64]]
        if len(job.followers) > 64:
            lines.append(f"| ... | {len(job.followers) - 64} more |")
    return write_text_in(out, "report.md", "\n".join(lines) + "\n")


"""Reports: a markdown summary and PNG figures from the logs of a run or a simulation.

Framework-free (matplotlib with the Agg backend, no display). :func:`build_report` looks at a
directory and uses what it finds:

==========================  ====================================================================
``train.jsonl``, ``run.json``  a standalone run (``ms-memopt run``): losses, step times, device
``rank_N/scan.jsonl``       layout scans of every rank (merged with :mod:`ms_memopt.report.merge`);
                            ``kind: compaction`` lines mark compactions
``timeline.jsonl``          a simulation (``ms-memopt simulate --out``): samples per policy
``layouts.jsonl``           pool layouts at chosen steps (:func:`layout_to_dict`), for the memory map
``plan.json``               an estimate (``ms-memopt plan --json``), for the region budget bars
``simulation.json``         what simulate decided (:mod:`ms_memopt.report.simulation_info`): the
                            heading, the rank the figures show, the printed table's figures
==========================  ====================================================================

and writes ``report.md`` plus ``fragmentation.png`` (the timeline plot of
:mod:`ms_memopt.report.plots`), ``memory_map.png`` (:func:`plot_memory_map`), ``region_budget.png``
(:func:`plot_region_budget`) and ``loss.png`` (a run's loss and step time).

Sizes are bytes in every file; plots pick KiB/MiB/GiB from the largest value they draw.

Example:
    >>> build_report("out/run")          # doctest: +SKIP
    PosixPath('out/run/report.md')
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

from ms_memopt.core.errors import InputError
from ms_memopt.core.jsontext import parse_json, read_json_lines
from ms_memopt.core.lines import open_text
from ms_memopt.core.units import format_size, short_repr
from ms_memopt.io.layouts import read_layouts
from ms_memopt.report.memory_map import plot_memory_map
from ms_memopt.report.plots import plot_fragmentation_timeline, plot_loss, plot_region_budget, plot_scan_timeline
from ms_memopt.report.simulation_info import COLUMNS, SimulationInfo, read_simulation_info

__all__ = ["build_report", "doctor_hint", "REPORT_NAME"]

REPORT_NAME = "report.md"
#: layout snapshots drawn in the memory map at most (evenly spread when a log holds more)
MAX_MAP_ROWS = 24


#: the type each common key of our JSONL logs must have when present (a list as ``policy``
#: raised TypeError: unhashable type while grouping)
_ROW_TYPES = {"policy": str, "kind": str, "step": int, "rank": int, "stage": int, "seed": int, "label": str}


def _rows_of(path: Path) -> list[dict]:
    rows = []
    for number, obj in read_json_lines(path):
        for key, kind in _ROW_TYPES.items():
            value = obj.get(key)
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                raise InputError(f"{key!r} must be {'a string' if kind is str else 'an integer'}, got "
                                 f"{short_repr(value)}", source=str(path), line=number)
        rows.append(obj)
    return rows


def _json_object(path: Path) -> dict:
    """A JSON file of ours (run.json, plan.json) as an object: bounded, and an InputError naming it
    when it is not JSON or not an object."""
    with open_text(path, expected="a JSON file written by ms-memopt") as handle:
        data = parse_json(handle.read(), source=str(path))
    if not isinstance(data, dict):
        raise InputError(f"expected a JSON object, got {type(data).__name__}", source=str(path))
    return data


def _scan_logs(directory: Path) -> dict[int, list[dict]]:
    """rank -> every line (scans and compactions) of its scan logs, in order."""
    from ms_memopt.report.merge import find_scan_logs, read_scan_records

    out: dict[int, list[dict]] = {}
    for rank, paths in find_scan_logs(directory).items():
        for path in paths:
            for _, row in read_scan_records(path):
                r = rank if rank is not None else (row.get("rank") or 0)
                out.setdefault(r, []).append(row)
    return dict(sorted(out.items()))


def doctor_hint(root: Path, scans: dict[int, list[dict]]) -> str | None:
    """When a scan warned (a watched request would not fit, a frag warning, a forecast), the
    command that diagnoses it, on the recording this run left (``pool.log`` of ``ms-memopt run``
    on CPU, a ``record`` file), or how to make one."""
    warned = [(r, l) for r, ls in scans.items() for l in ls if l.get("warnings")]
    if not warned:
        return None
    rank, first = warned[0]
    recording = next((p for p in (root / "pool.log", root / "memopt-record.jsonl") if p.is_file()), None)
    what = (f"`ms-memopt doctor {recording}`" if recording is not None else
            "`ms-memopt record --out run.jsonl -- python train.py ...`, then `ms-memopt doctor run.jsonl`")
    return (f"Scans warned {len(warned)} time(s), first at rank {rank} step {first['step']} "
            f"({first['warnings'][0]}). Diagnose it (verdict, the blocks in the way, the setting that saves "
            f"the run, measured): {what} with `--capacity` set to the card's memory.")


# --- the report ------------------------------------------------------------------------------------

def _checkpoint_advice(plan: dict) -> str:
    if plan.get("checkpoint_every") is not None:
        return f"recommended checkpoint_every {plan['checkpoint_every']}"
    if plan.get("fits") is False:
        return "no checkpoint_every fits"
    return "checkpointing not needed"


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pick(items: list, n: int) -> list:
    """Up to ``n`` items spread evenly, first and last included."""
    if len(items) <= n:
        return list(items)
    idx = sorted({round(i * (len(items) - 1) / (n - 1)) for i in range(n)})
    return [items[i] for i in idx]


def _nothing_fragmented(scans: dict[int, list[dict]]) -> str | None:
    """A plain sentence when no rank's scans ever changed (so the flat timeline is not mistaken
    for a broken one), else ``None``."""
    readings = {(l.get("free_total"), l.get("largest_free")) for ls in scans.values() for l in ls
                if l.get("kind", "scan") == "scan" and l.get("free_total") is not None}
    if len(readings) != 1:
        return None
    free_total, largest = readings.pop()
    count = sum(1 for ls in scans.values() for l in ls if l.get("kind", "scan") == "scan")
    if count < 2:
        return None
    return (f"**Nothing fragmented in this run:** all {count} scans saw the same pool ({format_size(free_total)} "
            f"free, largest hole {format_size(largest)}). The workload requested the same sizes in the same "
            f"order every step, so each step's frees left exactly the holes the next step filled again; "
            f"fragmentation needs sizes or lifetimes that change from step to step (varying sequence "
            f"lengths, dynamic shapes, buffers that outlive a step).")


def _real_pool_note(scans: dict[int, list[dict]]) -> str | None:
    """What scans of the real CPU pool (source ``pool-log``) can and cannot show, in figures."""
    real = [l for ls in scans.values() for l in ls if l.get("kind", "scan") == "scan" and l.get("source") == "pool-log"]
    if not real:
        return None
    ratios = [l["frag_ratio"] for l in real if l.get("frag_ratio") is not None]
    peak = max(l.get("allocated") or 0 for l in real)
    reserved = max(l.get("reserved") or 0 for l in real)
    holes = max(len(l.get("hole_histogram") or {}) for l in real)
    text = (f"**The real pool:** these scans read MindSpore's own CPU pool, buffer by buffer, from its "
            f"log. Across {len(real)} scans the largest hole moved from {format_size(real[0]['largest_free'])} "
            f"to {format_size(real[-1]['largest_free'])} and free memory from {format_size(real[0]['free_total'])} "
            f"to {format_size(real[-1]['free_total'])}; frag ratio at most {max(ratios, default=0):.4f}.")
    if reserved and peak * 100 < reserved and max(ratios, default=0) < 0.05:
        text += (f" It stays near 0 because the CPU pool grows in 1 GiB blocks ({format_size(reserved)} "
                 f"reserved) while this model holds at most {format_size(peak)}: the holes that changing "
                 f"sequence lengths leave (up to {holes} size classes of them) sit at the start of a block "
                 f"whose untouched rest stays one free range. A fragmentation OOM needs a pool filled close "
                 f"to its capacity, which is what `ms-memopt simulate` and `ms-memopt replay --capacity` "
                 f"on a recording show.")
    return text


def _pool_log_replay(root: Path) -> str | None:
    """One sentence on the run's own pool log (``pool.log``, written when its scans followed the
    real pool): how many pool calls it holds and how exactly the model replays them, from the
    summary the run wrote when it finished (:mod:`ms_memopt.replay.pool_log_check`; the report
    does not replay)."""
    from ms_memopt.replay.pool_log_check import ALLOCATOR, SUMMARY_NAME, read_summary
    from ms_memopt.io.traces.ms_pool_log import LOG_NAME

    if not (root / LOG_NAME).is_file():
        return None
    summary = read_summary(root)
    if summary is None:
        return (f"The run's pool log (`{LOG_NAME}`) has no replay summary (`{SUMMARY_NAME}`, written when "
                f"the run finishes): `ms-memopt replay {LOG_NAME}` replays it through the `{ALLOCATOR}` model "
                f"(docs/allocators.md).")
    if "error" in summary:
        return f"The run's pool log `{LOG_NAME}` could not be replayed: {summary['error']}."
    match = "n/a" if summary.get("address_match") is None else f"{100 * summary['address_match']:.2f}%"
    return (f"The run's pool log (`{LOG_NAME}`: {summary['events']:,} pool events, {summary['allocs']:,} allocations) "
            f"replays through the `{summary.get('allocator', ALLOCATOR)}` model at {match} address match, final layout "
            f"{'identical' if summary.get('final_layout_match') else 'different'} "
            f"(`ms-memopt replay {LOG_NAME}`; docs/allocators.md).")


def build_report(directory: str | Path, *, title: str | None = None, plan: dict | None = None,
                 memory_map_title: str | None = None, layouts_ready: Callable[[], None] | None = None) -> Path:
    """Write ``report.md`` and its figures into ``directory`` from the logs found there.

    Args:
        directory: a run's ``--out``, a simulation's ``--out`` or a directory with both.
        title: the report's heading (default: simulate's, from ``simulation.json``, else
            ``ms-memopt report: <directory name>``).
        plan: an estimate dict (``plan --json``); default: ``plan.json`` in the directory.
        memory_map_title: the memory map's title (default: simulate's, else the directory's name).
        layouts_ready: called just before ``layouts.jsonl`` is read, after the figures before it: a
            simulation still collecting its layouts writes them then (``ms-memopt simulate --out``).

    Raises:
        InputError: not a directory, nothing to report on, or a malformed log (file and line).
    """
    root = Path(directory)
    if not root.is_dir():
        raise InputError("not a directory", source=str(root))
    info = read_simulation_info(root)
    if info is not None:        # what simulate decided: the same report whichever command writes it
        title = title or info.title
        memory_map_title = memory_map_title or info.memory_map_title
    lines = [f"# {title or 'ms-memopt report: ' + root.name}", ""]
    found = False
    problems: list[str] = []

    # the run
    run_meta = root / "run.json"
    train_log = root / "train.jsonl"
    if run_meta.is_file() or train_log.is_file():
        found = True
        lines += ["## Training run", ""]
        if run_meta.is_file():
            meta = _json_object(run_meta)
            model = meta.get("model") or {}
            lines += [f"- recipe: `{meta.get('recipe')}`; device **{meta.get('device')}**; optimizer "
                      f"{meta.get('optimizer')}; pool mode {'on' if meta.get('pool_mode') else 'off'}",
                      f"- model: {model.get('num_layers')} layers, hidden {model.get('hidden_size')}, "
                      f"{model.get('num_heads')} heads, seq {model.get('seq_length')}, vocab {model.get('vocab_size')}, "
                      f"{model.get('dtype')}",
                      f"- steps {meta.get('start_step')}..{meta.get('steps')}; wall time {meta.get('seconds', 0):.1f} s; "
                      f"scans {meta.get('scans')}; compactions {meta.get('compactions')}; "
                      f"checkpoints: {', '.join(Path(c).name for c in meta.get('checkpoints') or []) or 'none'}"]
            pool = meta.get("pool") or {}
            if pool:
                lines.append(f"- memory pool: **{pool.get('kind')}** ({pool.get('mode')}"
                             f"{', SOMAS' if pool.get('somas') else ''}). {pool.get('explain', '')}")
            lines += [f"- note: {n}" for n in meta.get("notes") or []]
        if train_log.is_file():
            rows = _rows_of(train_log)
            if rows:
                times = [r["step_seconds"] for r in rows]
                lines += [f"- loss {rows[0]['loss']:.4f} (step {rows[0]['step']}) -> {rows[-1]['loss']:.4f} "
                          f"(step {rows[-1]['step']}); median step time {statistics.median(times) * 1000:.0f} ms",
                          "", "![loss and step time](loss.png)"]
                plot_loss(rows, root / "loss.png", title=f"{title or root.name}: loss and step time")
        lines.append("")

    # scans (any number of ranks)
    scans = _scan_logs(root)
    timeline = root / "timeline.jsonl"
    if scans:
        found = True
        from ms_memopt.report.merge import merge_ranks

        merged = merge_ranks(root)
        lines += ["## Layout scans", "",
                  f"Ranks {merged.ranks}; {len(merged.steps)} scanned steps. Per step across ranks: the worst "
                  f"and median frag ratio (`free_total / largest_free - 1`), the smallest largest free block, "
                  f"failed watched requests.", ""]
        table = [[s.step, s.ranks, _ratio(s.frag_max), _ratio(s.frag_median),
                  "-" if s.worst_rank is None else s.worst_rank, format_size(s.largest_free_min),
                  format_size(s.free_total_max), s.watch_failures] for s in _pick(merged.steps, 12)]
        lines += _md_table(["step", "ranks", "frag max", "frag median", "worst rank", "min largest_free",
                            "max free_total", "watch fails"], table)
        sources = {line["extra"]["source_description"] for ls in scans.values() for line in ls
                   if isinstance(line.get("extra"), dict) and line["extra"].get("source_description")}
        lines += ["", *(f"Scan source: {text}." for text in sorted(sources))]
        still = _nothing_fragmented(scans)
        if still:
            lines += ["", still]
        real = _real_pool_note(scans)
        if real:
            lines += ["", real]
        replayed = _pool_log_replay(root)
        if replayed:
            lines += ["", replayed]
        compactions = [(r, line) for r, ls in scans.items() for line in ls if line.get("kind") == "compaction"]
        if compactions:
            lines += ["", f"Compactions: {len(compactions)} (" + ", ".join(
                f"rank {r} step {c['step']}: {format_size(c.get('bytes_moved'))} moved in "
                f"{c.get('seconds', 0) * 1000:.0f} ms" for r, c in compactions[:8]) + ")"]
        for err in merged.source_errors:
            lines.append(f"- rank {err['rank']} step {err.get('step')}: source {err.get('source')!r} failed: "
                         f"{err.get('error')}")
        plot_scan_timeline(scans, root / "scan_fragmentation.png", title=f"{title or root.name}: layout scans")
        lines += ["", "![fragmentation timeline of the scans](scan_fragmentation.png)", ""]
        hint = doctor_hint(root, scans)
        if hint:
            lines += [hint, ""]

    # a simulation
    if timeline.is_file():
        found = True
        lines += _simulation_section(root, timeline, problems, title or root.name, info)

    # layouts
    if layouts_ready is not None:
        layouts_ready()
    snapshots = read_layouts(root, at_most=MAX_MAP_ROWS)    # one figure row each: a bounded figure
    if snapshots:
        found = True
        plot_memory_map(snapshots, root / "memory_map.png",
                        title=memory_map_title or f"{root.name}: address space at chosen steps")
        lines += ["## Memory map", "",
                  "Each row is the pool at one step: segments end to end in address order, live blocks "
                  "coloured by purpose, holes light grey. A request fits only inside one hole.", "",
                  "![memory map](memory_map.png)", ""]

    # the plan
    if plan is None and (root / "plan.json").is_file():
        plan = _json_object(root / "plan.json")
    if plan:
        found = True
        plot_region_budget(plan, root / "region_budget.png",
                           title=f"{Path(str(plan.get('recipe', ''))).name or 'plan'}")
        cap = plan.get("capacity")
        lines += ["## Memory plan (per card)", ""]
        lines += _md_table(["region", "bytes", "share"],
                           [[n, format_size(v), f"{100 * v / max(1, plan['total']):.1f}%"]
                            for n, v in plan["regions"].items()])
        lines += ["", f"Total {format_size(plan.get('total'))} of {format_size(cap) if cap else 'unknown'} "
                  f"({'fits' if plan.get('fits') else 'does not fit' if plan.get('fits') is False else 'no capacity'}); "
                  f"{_checkpoint_advice(plan)}.", "",
                  "![region budget](region_budget.png)", ""]

    if not found:
        raise InputError("nothing to report: expected train.jsonl, rank_N/scan.jsonl, timeline.jsonl, "
                         "layouts.jsonl or plan.json", source=str(root))
    if problems:
        lines += ["## Not drawn", ""] + [f"- {p}" for p in problems] + [""]
    out = root / REPORT_NAME
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def _oom_text(ooms: dict, job: bool, shown: int = 5) -> str:
    """The OOMs of one policy: per seed, or for a job the ranks by OOM step, earliest (the job's
    death) first, ``shown`` of them, e.g. ``rank 17 (stage 0, seed 1234): step 437 (...); 3 more ranks``."""
    unit = "rank" if job else "seed"
    items = sorted(((r["step"], key, r) for key, r in ooms.items() if key is not None),
                   key=lambda t: (t[0], t[1]) if job else (t[1], t[0]))

    def one(key, r) -> str:
        where = f"{unit} {key}"
        if job:
            where += f" (stage {r.get('stage', '?')}, seed {r.get('seed', '?')})"
        return f"{where}: step {r['step']} ({r.get('oom_kind', '?')}, {r.get('tag') or 'an untagged request of'} {format_size(r.get('size'))})"

    if not items:
        return "none"
    if not job:
        return ", ".join(one(key, r) for _, key, r in items)
    text = "; ".join(one(key, r) for _, key, r in items[:shown])
    return text + (f"; {len(items) - shown} more ranks" if len(items) > shown else "")


def _judged_table(info: SimulationInfo) -> list[str]:
    """simulate's printed table, from the figures it wrote (``simulation.json``): the same numbers."""
    rows = []
    for policy, f in info.policies.items():
        failed = f.get("rank_failed")
        rows.append([policy, f.get("seed"), f.get("ranks"), "-" if f.get("job_oom_step") is None else f["job_oom_step"],
                     f"{f.get('rank')}{'' if failed else ' (closest call)'}", f.get("stage"),
                     f.get("oom_kind") or "-", format_size(f.get("free_total_at_oom")), f.get("oom_ranks"),
                     "-" if f.get("oom_step_median") is None else f["oom_step_median"],
                     format_size(f.get("largest_free_min")), _ratio(f.get("frag_ratio_max")), f.get("compactions"),
                     format_size(f.get("peak_allocated"))])
    shown = info.shown
    lines = [f"The job is judged by its first failing rank (or, when every rank survives, the closest call); the "
             f"figures below are that rank's, as `ms-memopt simulate` printed them. The plots show rank "
             f"{shown.get('rank')} (stage {shown.get('stage')}, stream seed {shown.get('seed')}), the rank the job is "
             f"judged by under `{shown.get('policy', 'the first policy')}`.", ""]
    lines += _md_table(["policy", "seed", "ranks", "job_oom", "rank", "stage", "oom_kind", "free@oom", "oom_ranks",
                        "median", "lf_min", "frag_max", "compactions", "peak"], rows)
    lines += ["", "Columns: " + "; ".join(f"**{name}**: {text}" for name, text in COLUMNS.items()) + "."]
    if info.bound:
        lines += ["", f"**Bound**: {info.bound}."]
    return lines


def _simulation_section(root: Path, timeline: Path, problems: list[str], title: str,
                        info: SimulationInfo | None = None) -> list[str]:
    rows = _rows_of(timeline)
    # A job simulation stamps every row with its rank (and stage): its streams are ranks, each
    # with its own seed; a single-card simulation's streams are seeds.
    job = any("rank" in row for row in rows)
    unit = "rank" if job else "seed"
    by_policy: dict[str, dict] = {}
    for row in rows:
        p = by_policy.setdefault(row.get("policy", "?"), {"streams": set(), "oom": {}, "compactions": 0,
                                                          "frag_max": None, "lf_min": None, "last": 0})
        stream = row.get(unit)
        p["streams"].add(stream)
        p["last"] = max(p["last"], row.get("step", 0))
        kind = row.get("kind")
        if kind == "oom":
            p["oom"][stream] = row
        elif kind == "compaction":
            p["compactions"] += 1
        if kind in ("scan", "watch"):
            ratio = row.get("frag_ratio")
            if ratio is not None and (p["frag_max"] is None or ratio > p["frag_max"]):
                p["frag_max"] = ratio
            lf = row.get("largest_free")
            if lf is not None and (p["lf_min"] is None or lf < p["lf_min"]):
                p["lf_min"] = lf
    what = ("rank streams (each rank with its own seed; the job dies at its first failing rank)" if job
            else "seeds")
    lines = ["## Simulation", "",
             f"{len(rows)} samples from `{timeline.name}` (at scans and just before watched requests), "
             f"over {what}.", ""]
    table = []
    for policy, p in by_policy.items():
        table.append([policy, len(p["streams"]), _oom_text(p["oom"], job), _ratio(p["frag_max"]),
                      format_size(p["lf_min"]), p["compactions"]])
    if info is not None and info.policies:
        lines += _judged_table(info)
        lines += ["", "Every rank's OOMs, from the timeline:", ""]
        lines += _md_table(["policy", "ranks", "OOM (earliest rank first)", "compactions, all ranks"],
                           [[policy, len(p["streams"]), _oom_text(p["oom"], job), p["compactions"]]
                            for policy, p in by_policy.items()])
    else:
        lines += _md_table(["policy", "ranks" if job else "seeds", "OOM (earliest rank first)" if job else "OOM",
                            "frag max", "min largest_free", "compactions"], table)
    if info is not None:
        # the rank the job is judged by, as simulate drew it (the timeline's first stream otherwise)
        shown = info.shown
        plot_fragmentation_timeline(timeline, root / "fragmentation.png", seed=shown.get("seed"),
                                    title=f"{Path(info.recipe).name}, rank {shown.get('rank')} (stage "
                                          f"{shown.get('stage')}, stream seed {shown.get('seed')})")
    else:
        plot_fragmentation_timeline(timeline, root / "fragmentation.png", title=title)
    lines += ["", "![fragmentation timeline](fragmentation.png)", ""]
    lines += _step_time_section(root, title)
    return lines


#: a simulation's time model figures (``ms-memopt simulate --out``), per policy
TIMING_NAME = "timing.json"


def _step_time_section(root: Path, title: str) -> list[str]:
    """The time model's figures (:mod:`ms_memopt.simulation.timing`) from ``timing.json``, when written."""
    path = root / TIMING_NAME
    if not path.is_file():
        return []
    try:
        policies = _json_object(path)["policies"]
        if not isinstance(policies, dict):
            raise TypeError(f"'policies' is a {type(policies).__name__}")
    except (KeyError, TypeError) as exc:
        raise InputError(f"not a timing file: {exc}", source=str(path)) from None
    from ms_memopt.report.plots import plot_step_times

    def pct(v) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    rows = []
    for policy, data in policies.items():
        t = data.get("timing")
        if not t:
            rows.append([policy, "-", "-", "-", "-", "-", "-", "-"])
            continue
        rows.append([policy, f"{t['step_seconds_median']:.4g} s", f"{t['step_seconds_p99']:.4g} s", pct(t["step_cv"]),
                     pct(data.get("card_cv")), pct(t["mfu"]), pct(t["memory_stall_share"]),
                     pct(t["compaction_pause_share"])])
    plot_step_times(policies, root / "step_time.png", title=f"{title}: the job's step time")
    return ["## Step time (time model)", "",
            "The job's step is its slowest card's step (compute, memory stalls) plus the longest compaction "
            "(a global sync point) plus the gradient AllReduce (docs/simulation.md, *Time*); the CV across "
            "cards is the spread of the cards' busy times at a step.", "",
            *_md_table(["policy", "median step", "p99 step", "CV over steps", "CV across cards", "MFU",
                        "memory stalls", "compaction pauses"], rows),
            "", "![step time per policy and across ranks](step_time.png)", ""]

"""Reports: a markdown summary and PNG figures from the logs of a run or a simulation.

Framework-free (matplotlib with the Agg backend, no display). :func:`build_report` looks at a
directory and uses what it finds:

==========================  ====================================================================
``train.jsonl``, ``run.json``  a standalone run (``ms-memopt run``): losses, step times, device
``rank_N/scan.jsonl``       layout scans of every rank (merged with :mod:`ms_memopt.report_merge`);
                            ``kind: compaction`` lines mark compactions
``timeline.jsonl``          a simulation (``ms-memopt simulate --out``): samples per policy
``layouts.jsonl``           pool layouts at chosen steps (:func:`layout_to_dict`), for the memory map
``plan.json``               an estimate (``ms-memopt plan --json``), for the region budget bars
==========================  ====================================================================

and writes ``report.md`` plus ``fragmentation.png`` (the timeline plot of
:mod:`ms_memopt.plots`), ``memory_map.png`` (:func:`plot_memory_map`), ``region_budget.png``
(:func:`plot_region_budget`) and ``loss.png`` (a run's loss and step time).

Sizes are bytes in every file; plots pick KiB/MiB/GiB from the largest value they draw.

Example:
    >>> build_report("out/run")          # doctest: +SKIP
    PosixPath('out/run/report.md')
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .errors import InputError
from .layout import DEVICE_ADDRESS_LIMIT, Block, Layout, Segment
from .jsontext import read_json_lines
from .metrics import measure
from .plots import (Marker, forecast_marker, plot_fragmentation_timeline, plot_timeline, pyplot, save_figure,
                    size_unit)
from .units import format_size

__all__ = ["LayoutSnapshot", "layout_to_dict", "layout_from_dict", "read_layouts", "write_layouts",
           "plot_memory_map", "plot_region_budget", "plot_loss", "plot_scan_timeline", "build_report",
           "LAYOUTS_NAME", "REPORT_NAME"]

LAYOUTS_NAME = "layouts.jsonl"
REPORT_NAME = "report.md"

# purpose -> color, and tag prefixes -> purpose; tags not listed are "other"
_PURPOSE_COLORS = {"parameter": "#1f77b4", "optimizer": "#9467bd", "gradient": "#ff7f0e",
                   "activation": "#2ca02c", "allreduce": "#d62728", "shape_cache": "#8c564b",
                   "workspace": "#e377c2", "other": "#7f7f7f"}
_PURPOSE_OF = {"param": "parameter", "weight": "parameter", "optim": "optimizer", "master": "optimizer",
               "adam": "optimizer", "grad": "gradient", "activ": "activation", "act": "activation",
               "saved": "activation", "allreduce": "allreduce", "communication": "allreduce", "comm_": "allreduce",
               "reduce": "allreduce", "bucket": "allreduce",
               "shape": "shape_cache", "rope": "shape_cache", "workspace": "workspace", "scratch": "workspace"}
_FREE_COLOR = "#f2f2f2"


@dataclass
class LayoutSnapshot:
    """A pool layout at one step, with a label for the memory map (``"baseline step 300"``)."""
    step: int
    label: str
    layout: Layout


# --- layouts on disk -----------------------------------------------------------------------------

def layout_to_dict(layout: Layout, *, step: int, label: str) -> dict:
    """One JSON object of ``layouts.jsonl``: blocks as ``[addr, size, live, tag]``, bytes.

    Example:
        >>> seg = Segment(0, 1024, [Block(0, 512, True, tag="activation"), Block(512, 512, False)])
        >>> layout_to_dict(Layout([seg]), step=3, label="x")["segments"][0]["blocks"][0]
        [0, 512, True, 'activation']
    """
    return {"step": int(step), "label": label, "capacity": layout.capacity,
            "segments": [{"addr": s.addr, "size": s.size, "stream": s.stream, "pool": s.pool,
                          "blocks": [[b.addr, b.size, bool(b.live), b.tag] for b in s.blocks]}
                         for s in layout.segments]}


def _tag(tag: object) -> str | None:
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"a block tag must be a string or null, got {tag!r:.40}")
    return tag


def _bytes(value) -> int:
    """An address or size of a layout record: an integer in [0, DEVICE_ADDRESS_LIMIT)."""
    number = int(value)
    if not 0 <= number < DEVICE_ADDRESS_LIMIT:
        raise ValueError(f"{value!r} is outside [0, 2**48)")
    return number


def layout_from_dict(obj: dict, *, source: str = "<layout>", line: int | None = None) -> LayoutSnapshot:
    """Inverse of :func:`layout_to_dict`.

    Raises:
        InputError: a field missing or of the wrong type (names the file and line).
    """
    try:
        segments = []
        for s in obj["segments"]:
            blocks = [Block(_bytes(a), _bytes(n), bool(live), tag=_tag(tag)) for a, n, live, tag in s["blocks"]]
            segments.append(Segment(_bytes(s["addr"]), _bytes(s["size"]), blocks, stream=int(s.get("stream", 0)),
                                    pool=str(s.get("pool", "common"))))
        capacity = obj.get("capacity")
        layout = Layout(segments, capacity=None if capacity is None else int(capacity))
        step = int(obj["step"])
        return LayoutSnapshot(step=step, label=str(obj.get("label") or f"step {step}"), layout=layout)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:    # OverflowError: int(inf)
        raise InputError(f"not a layout record ({type(exc).__name__}: {exc}); expected step, segments "
                         f"[{{addr, size, blocks: [[addr, size, live, tag], ...]}}]", source=source,
                         line=line) from None


def write_layouts(path: str | Path, snapshots: Iterable[LayoutSnapshot]) -> Path:
    """Write snapshots as ``layouts.jsonl`` (one object per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for snap in snapshots:
            f.write(json.dumps(layout_to_dict(snap.layout, step=snap.step, label=snap.label)) + "\n")
    return path


def read_layouts(directory_or_file: str | Path) -> list[LayoutSnapshot]:
    """Snapshots from ``layouts.jsonl`` (a directory's, its ``rank_N/``'s, or the file given);
    a torn last line is ignored. Empty list when there is none."""
    path = Path(directory_or_file)
    files = [path] if path.is_file() else sorted([path / LAYOUTS_NAME, *path.glob(f"rank_*/{LAYOUTS_NAME}")])
    out = []
    for file in files:
        if not file.is_file():
            continue
        out += [layout_from_dict(obj, source=str(file), line=number) for number, obj in read_json_lines(file)]
    return out


# --- memory map ----------------------------------------------------------------------------------

def _category(tag: str | None) -> tuple[str, str]:
    """(purpose, color) of a block or region tag, by prefix: ``"grad_accum"`` -> gradient."""
    name = (tag or "").lower()
    for prefix, purpose in _PURPOSE_OF.items():
        if name.startswith(prefix):
            return purpose, _PURPOSE_COLORS[purpose]
    return "other", _PURPOSE_COLORS["other"]


def _pool_category(pool: str) -> tuple[str, str]:
    """Untagged live blocks (allocator models keep no tags) are coloured by their pool or region."""
    purpose, color = _category(pool)
    if purpose != "other":
        return purpose, color
    if pool == "persistent":
        return "persistent pool (parameters, optimizer states)", "#1f77b4"
    return f"{pool} pool (untagged)", "#7f7f7f"


def plot_memory_map(snapshots: Sequence[LayoutSnapshot], path: str | Path, *,
                    title: str = "Memory map", outline: Sequence[tuple[int, int]] = ()) -> Path:
    """One row per snapshot: the pool's segments laid end to end in address order (gaps between
    segments, which no request can use, are left out), live blocks coloured by purpose, free
    blocks (holes) light grey, segment/region boundaries as black ticks with the region name.
    ``outline``: ``(addr, size)`` ranges drawn with a red frame in every row where they lie
    (``ms-memopt doctor``'s blockers).

    Raises:
        InputError: no snapshots.
    """
    if not snapshots:
        raise InputError("no layouts to draw (expected layouts.jsonl)")
    plt = pyplot()
    from matplotlib.patches import Patch

    widest = max(sum(s.size for s in snap.layout.segments) for snap in snapshots) or 1
    div, unit = size_unit(widest)
    rows = len(snapshots)
    fig, ax = plt.subplots(figsize=(12, 1.3 + 0.9 * rows))
    used: dict[str, str] = {}
    for row, snap in enumerate(snapshots):
        y = rows - 1 - row
        offset = 0
        previous = None
        bars: dict[str, list[tuple[float, float]]] = {}
        framed = []
        for seg in sorted(snap.layout.segments, key=lambda s: s.addr):
            for addr, size in outline:
                if seg.addr <= addr < seg.end:
                    framed.append(((offset + addr - seg.addr) / div, size / div))
            for block in seg.blocks:
                start = (offset + block.addr - seg.addr) / div
                width = block.size / div
                if block.live:
                    label, color = _category(block.tag) if block.tag else _pool_category(seg.pool)
                    used[label] = color
                else:
                    label, color = "free", _FREE_COLOR
                bars.setdefault(color, []).append((start, width))
            ax.plot([offset / div] * 2, [y - 0.42, y + 0.42], color="black", linewidth=0.8)
            if seg.pool != previous and seg.size / widest > 0.03:   # name each region where it starts
                ax.text((offset + seg.size * 0.01) / div, y - 0.33, seg.pool, fontsize=6.5, va="bottom",
                        ha="left", color="black", alpha=0.85)
            previous = seg.pool
            offset += seg.size
        ax.plot([offset / div] * 2, [y - 0.42, y + 0.42], color="black", linewidth=0.8)
        few = sum(len(v) for v in bars.values()) <= 400   # block edges only where they stay visible
        for color, spans in bars.items():
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color,
                           edgecolor="white" if few else "none", linewidth=0.4)
        if framed:
            ax.broken_barh(framed, (y - 0.4, 0.8), facecolors="none", edgecolor="red", linewidth=1.2, zorder=5)
        m = measure(snap.layout)
        ratio = "n/a" if m.frag_ratio is None else f"{m.frag_ratio:.2f}"
        ax.text(offset / div, y + 0.45, f" free {format_size(m.free_total)}, largest hole "
                f"{format_size(m.largest_free)}, frag {ratio}", fontsize=8, va="bottom", ha="right")
    regions = {seg.pool for snap in snapshots for seg in snap.layout.segments}
    ax.set_yticks(range(rows))
    ax.set_yticklabels([snap.label for snap in reversed(snapshots)])
    ax.set_ylim(-0.6, rows - 0.2)
    ax.set_xlim(0, widest / div * 1.01)
    ax.set_xlabel(f"offset in reserved memory ({unit}); segments in address order, black ticks = "
                  f"segment boundaries")
    order = list(_PURPOSE_COLORS)
    handles = [Patch(facecolor=c, label=f"live: {n}")
               for n, c in sorted(used.items(), key=lambda nc: (order.index(nc[0]) if nc[0] in order else 99, nc[0]))]
    handles.append(Patch(facecolor=_FREE_COLOR, edgecolor="#999999", label="free (hole)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if rows < 3 else -0.2),
              ncol=min(len(handles), 6), fontsize=8, frameon=False)
    pools = ", ".join(sorted(regions))
    ax.set_title(f"{title}\n(pools/regions: {pools})", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


# --- region budget -------------------------------------------------------------------------------

def plot_region_budget(plan: dict, path: str | Path, *, title: str = "Per-card memory by region") -> Path:
    """Bars of the estimate's regions (``plan --json``: ``regions``, ``capacity``, ``total``), a
    stacked total bar, and the capacity as a dashed line.

    Raises:
        InputError: ``plan`` has no ``regions`` mapping.
    """
    regions = plan.get("regions") if isinstance(plan, dict) else None
    if not isinstance(regions, dict) or not regions:
        raise InputError("expected a plan with a 'regions' mapping (ms-memopt plan --json)")
    plt = pyplot()
    capacity = plan.get("capacity")
    total = sum(regions.values())
    div, unit = size_unit(max(total, capacity or 0))
    names = list(regions)
    colors = [_category(n)[1] for n in names]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * (len(names) + 1)))
    ys = list(range(len(names), 0, -1))
    ax.barh(ys, [regions[n] / div for n in names], color=colors, height=0.6)
    for y, n in zip(ys, names):
        ax.text(regions[n] / div, y, f" {format_size(regions[n])}", va="center", fontsize=8)
    left = 0.0
    for n, c in zip(names, colors):
        ax.barh(0, regions[n] / div, left=left, color=c, height=0.6, edgecolor="white", linewidth=0.5)
        left += regions[n] / div
    ax.text(left, 0, f" {format_size(total)}", va="center", fontsize=8, fontweight="bold")
    if capacity:
        ax.axvline(capacity / div, color="black", linestyle="--", linewidth=1.2,
                   label=f"capacity {format_size(capacity)}")
        verdict = "fits" if total <= capacity else "DOES NOT FIT"
        ax.legend(loc="lower right", fontsize=8)
    else:
        verdict = "capacity unknown"
    ax.set_yticks([*ys, 0])
    ax.set_yticklabels([*names, "total"])
    ax.set_xlabel(f"bytes per card ({unit})")
    ax.set_xlim(0, max(total, capacity or 0) / div * 1.18)
    ax.grid(True, axis="x", alpha=0.3)
    extra = []
    if plan.get("checkpoint_every") is not None:
        extra.append(f"checkpoint_every {plan['checkpoint_every']}")
    if plan.get("worst_stage") is not None:
        extra.append(f"worst pipeline stage {plan['worst_stage']}")
    ax.set_title(f"{title}: {verdict}" + (f" ({', '.join(extra)})" if extra else ""), fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


# --- loss ------------------------------------------------------------------------------------------

def plot_loss(rows: Sequence[dict], path: str | Path, *, title: str = "Training") -> Path:
    """Loss and step time (ms) against the step, from ``train.jsonl`` rows."""
    plt = pyplot()
    steps = [r["step"] for r in rows]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    a1.plot(steps, [r["loss"] for r in rows], color="#1f77b4", label="loss")
    a1.set_ylabel("loss (cross-entropy, nats)")
    a2.plot(steps, [r["step_seconds"] * 1000 for r in rows], color="#ff7f0e", label="step time")
    a2.set_ylabel("step time (ms)")
    a2.set_xlabel("training step")
    for ax in (a1, a2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


# --- reading a directory ---------------------------------------------------------------------------

def _rows_of(path: Path) -> list[dict]:
    return [obj for _, obj in read_json_lines(path)]


def _scan_logs(directory: Path) -> dict[int, list[dict]]:
    """rank -> every line (scans and compactions) of its scan logs, in order."""
    from .report_merge import find_scan_logs, read_scan_records

    out: dict[int, list[dict]] = {}
    for rank, paths in find_scan_logs(directory).items():
        for path in paths:
            for _, row in read_scan_records(path):
                r = rank if rank is not None else (row.get("rank") or 0)
                out.setdefault(r, []).append(row)
    return dict(sorted(out.items()))


def plot_scan_timeline(scans: dict[int, list[dict]], path: str | Path, *,
                       title: str = "Layout scans") -> Path:
    """``free_total``, ``largest_free`` and ``frag_ratio`` against the step from scan logs, one line
    per rank, compactions, predicted OOMs (a watched request that would not fit) and the latest
    forecast of when a watched request stops fitting (docs/forecast.md) marked; drawn
    by :func:`ms_memopt.plots.plot_timeline`, the figure simulations use too."""
    series: dict[str, list] = {}
    markers: list[Marker] = []
    requests: dict[str, int] = {}
    for rank, lines in scans.items():
        label = f"rank {rank}"
        scanned = [l for l in lines if l.get("kind", "scan") == "scan" and l.get("free_total") is not None]
        series[label] = [(l["step"], l["free_total"], l.get("largest_free") or 0, l.get("frag_ratio"))
                         for l in scanned]
        markers += [Marker(label, l["step"], "compaction", l.get("largest_free_before"), l.get("largest_free_after"))
                    for l in lines if l.get("kind") == "compaction"]
        markers += [Marker(label, l["step"], "predicted_oom", l.get("largest_free") or 0) for l in scanned
                    if any(not w.get("fits", True) for w in (l.get("watch") or {}).values())]
        for l in scanned:
            for name, check in (l.get("watch") or {}).items():
                if isinstance(check, dict) and isinstance(check.get("size"), int):
                    requests[name] = check["size"]
        forecasts = [w["forecast"] for w in (scanned[-1].get("watch") or {}).values()
                     if isinstance(w, dict) and isinstance(w.get("forecast"), dict)
                     and w["forecast"].get("step") is not None] if scanned else []
        if forecasts:       # the latest scan's soonest forecast
            markers.append(forecast_marker(label, min(forecasts, key=lambda f: f["step"])))
    return plot_timeline(series, path, markers=markers, title=title, requests=requests)


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
    real pool): how many pool calls it holds and how exactly the model replays them."""
    from .poolcapture import LOG_NAME

    path = root / LOG_NAME
    if not path.is_file():
        return None
    from .allocators import create
    from .replay import replay
    from .traces import load_trace

    try:
        trace = load_trace(path)
    except InputError as exc:
        return f"The run's pool log `{LOG_NAME}` could not be replayed: {exc}."
    result = replay(trace, create("mindspore-bestfit"), sample_every=0)
    match = "n/a" if result.address_match is None else f"{100 * result.address_match:.2f}%"
    return (f"The run's pool log (`{LOG_NAME}`: {result.events:,} pool events, {result.allocs:,} allocations) "
            f"replays through the `mindspore-bestfit` model at {match} address match, final layout "
            f"{'identical' if result.final_layout_match else 'different'} "
            f"(`ms-memopt replay {LOG_NAME}`; docs/allocators.md).")


def build_report(directory: str | Path, *, title: str | None = None, plan: dict | None = None,
                 memory_map_title: str | None = None) -> Path:
    """Write ``report.md`` and its figures into ``directory`` from the logs found there.

    Args:
        directory: a run's ``--out``, a simulation's ``--out`` or a directory with both.
        title: the report's heading.
        plan: an estimate dict (``plan --json``); default: ``plan.json`` in the directory.

    Raises:
        InputError: not a directory, nothing to report on, or a malformed log (file and line).
    """
    root = Path(directory)
    if not root.is_dir():
        raise InputError("not a directory", source=str(root))
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
            meta = json.loads(run_meta.read_text(encoding="utf-8"))
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
        from .report_merge import merge_ranks

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
        lines += _simulation_section(root, timeline, problems, title or root.name)

    # layouts
    snapshots = read_layouts(root)
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
        plan = json.loads((root / "plan.json").read_text(encoding="utf-8"))
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
        return f"{where}: step {r['step']} ({r.get('oom_kind', '?')}, {r.get('tag', '?')} {format_size(r.get('size'))})"

    if not items:
        return "none"
    if not job:
        return ", ".join(one(key, r) for _, key, r in items)
    text = "; ".join(one(key, r) for _, key, r in items[:shown])
    return text + (f"; {len(items) - shown} more ranks" if len(items) > shown else "")


def _simulation_section(root: Path, timeline: Path, problems: list[str], title: str) -> list[str]:
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
    lines += _md_table(["policy", "ranks" if job else "seeds", "OOM (earliest rank first)" if job else "OOM", "frag max",
                        "min largest_free", "compactions"], table)
    plot_fragmentation_timeline(timeline, root / "fragmentation.png", title=title)
    lines += ["", "![fragmentation timeline](fragmentation.png)", ""]
    lines += _step_time_section(root, title)
    return lines


#: a simulation's time model figures (``ms-memopt simulate --out``), per policy
TIMING_NAME = "timing.json"


def _step_time_section(root: Path, title: str) -> list[str]:
    """The time model's figures (:mod:`ms_memopt.timing`) from ``timing.json``, when written."""
    path = root / TIMING_NAME
    if not path.is_file():
        return []
    try:
        policies = json.loads(path.read_text(encoding="utf-8"))["policies"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"not a timing file: {exc}", source=str(path)) from None
    from .plots import plot_step_times

    def pct(v) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    rows = []
    for policy, data in policies.items():
        t = data.get("timing")
        if not t:
            rows.append([policy, "-", "-", "-", "-", "-", "-"])
            continue
        rows.append([policy, f"{t['step_seconds_median']:.4g} s", f"{t['step_seconds_p99']:.4g} s", pct(t["step_cv"]),
                     pct(t["mfu"]), pct(t["memory_stall_share"]), pct(t["compaction_pause_share"])])
    plot_step_times(policies, root / "step_time.png", title=f"{title}: the job's step time")
    return ["## Step time (time model)", "",
            "The job's step is its slowest rank's step (compute, memory stalls) plus the longest compaction "
            "(a global sync point) plus the gradient AllReduce (docs/simulation.md, *Time*).", "",
            *_md_table(["policy", "median step", "p99 step", "CV over steps", "MFU", "memory stalls",
                        "compaction pauses"], rows),
            "", "![step time per policy and across ranks](step_time.png)", ""]

"""Fragmentation timelines (matplotlib, written to files; no display needed).

:func:`plot_timeline` draws three panels against the training step — ``free_total``,
``largest_free`` (in the unit that suits the data: GiB for a 96 GiB card, MiB or KiB for the
few MiB pool of a CPU run) and ``frag_ratio`` — one line per series (a policy of a simulation,
a rank of a run's scan logs), with markers (compactions, OOMs, predicted OOMs). It takes plain
lists, so simulations (:func:`plot_fragmentation_timeline` reads ``ms-memopt simulate``'s
``timeline.jsonl``) and run scan logs share it. :func:`pyplot`, :func:`save_figure` and
:func:`size_unit` are the one place for the Agg backend, the saving and the unit choice.

Example:
    >>> plot_timeline({"rank 0": [(1, 3 * 2**20, 2**20, 2.0), (2, 3 * 2**20, 3 * 2**20, 0.0)]},
    ...               "out/timeline.png", markers=[Marker("rank 0", 2, "compaction")])  # doctest: +SKIP
    >>> size_unit(5 * 2**20)
    (1048576, 'MiB')
"""
from __future__ import annotations

import statistics
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ms_memopt.core.errors import InputError
from ms_memopt.report.figure_check import FigureWarning, figure_problems
from ms_memopt.core.jsontext import read_json_lines
from ms_memopt.core.units import format_size

__all__ = ["FREE_COLOR", "Marker", "PURPOSE_COLORS", "forecast_marker", "plot_fragmentation_timeline", "plot_loss",
           "plot_region_budget", "plot_scan_timeline", "plot_step_times", "plot_sweep", "plot_timeline", "pool_color", "purpose_color", "pyplot",
           "fit_to_texts", "save_figure", "size_unit", "wrap_to_width"]

#: one sample: (step, free_total bytes, largest_free bytes, frag_ratio or None when nothing is free)
Sample = tuple[int, int, int, "float | None"]

_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
_MARKER_KINDS = ("compaction", "oom", "predicted_oom", "forecast")


@dataclass
class Marker:
    """An event on a series' timeline: ``kind`` is ``"compaction"`` (triangle, dotted line),
    ``"oom"`` (cross, dashed line through every panel) or ``"predicted_oom"`` (a watched request
    that would not fit: red cross). ``largest_free`` (bytes) places the symbol on the middle
    panel: for a compaction the largest hole the scan saw before it, with ``largest_free_after``
    drawn as the jump it made; ``None`` puts it at the series' last sample at or before that
    step (no symbol when there is none: never at a made-up 0). ``"forecast"``: the step a
    watched request of ``largest_free`` bytes is forecast to stop fitting in one piece
    (:mod:`ms_memopt.analysis.forecast`), a triangle with the interval ``low``-``high`` as an error bar
    (``high`` ``None``: open-ended)."""

    series: str
    step: int
    kind: str
    largest_free: int | None = None
    largest_free_after: int | None = None
    low: int | None = None
    high: int | None = None


def forecast_marker(series: str, forecast: dict) -> Marker:
    """The marker of a forecast as scan records and timelines carry it
    (:func:`ms_memopt.analysis.scan.forecast_fields`)."""
    return Marker(series, forecast["step"], "forecast", forecast.get("request"),
                  low=forecast.get("earliest_step"), high=forecast.get("latest_step"))


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str | Path, *, dpi: int = 110) -> Path:
    """Save ``fig`` as ``path`` (parent directories created) and close it; each defect
    :func:`~ms_memopt.report.figure_check.figure_problems` finds is a
    :class:`~ms_memopt.report.figure_check.FigureWarning` naming the file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.set_dpi(dpi)        # checked as written: text extents round differently at other resolutions
        fig.savefig(path, dpi=dpi)
        for problem in figure_problems(fig):
            warnings.warn(f"{path}: {problem}", FigureWarning, stacklevel=2)
    finally:
        pyplot().close(fig)
    return path


def size_unit(largest: float) -> tuple[int, str]:
    """``(bytes per unit, name)`` for sizes up to ``largest`` bytes: the biggest binary unit
    that ``largest`` reaches, bytes below 1 KiB."""
    for div, name in _UNITS:
        if largest >= div:
            return div, name
    return 1, "bytes"


def plot_timeline(series: dict[str, list[Sample]], path: str | Path, *, markers: list[Marker] = (),
                  title: str = "Fragmentation timeline", requests: dict[str, "int | list[tuple[int, int]]"] | None = None,
                  xlabel: str = "training step", xunit: str = "step") -> Path:
    """Three panels against the step: ``free_total``, ``largest_free`` and ``frag_ratio``.

    What decides an OOM is drawn first: the largest hole's trend, the per-window minimum of
    ``largest_free`` (one window per step up to 80 steps, wider beyond), against each watched
    request's size as a horizontal line. Where a window holds several samples, the raw samples
    stay faint behind the trends (the per-window minimum of ``free_total`` and maximum of
    ``frag_ratio``), and the legend says so. Series are drawn from the widest line to the
    thinnest, so one that coincides with another (compaction before its first compaction is the
    baseline) shows as a thin line inside a wide one, and the legend says until which step they
    coincide. The x axis spans the steps that ran; a forecast beyond them is named in the
    legend. One legend for the three panels sits below them, off the data.

    Args:
        series: label -> samples ``(step, free_total, largest_free, frag_ratio)`` in step order
            (sizes in bytes; ``frag_ratio`` ``None`` when nothing is free).
        path: the PNG to write.
        markers: compactions, OOMs and predicted OOMs (see :class:`Marker`); a marker of a
            label not in ``series`` gets a colour of its own.
        title: the figure title (wrapped to the figure's width).
        requests: watched request name -> size in bytes (the AllReduce bucket), drawn as a
            horizontal line on the ``largest_free`` panel; or ``[(step, size), ...]`` for a request
            whose size changes (each step's largest of a learned template), drawn as steps.
        xlabel: what the x axis counts (steps; or the events of a recording).
        xunit: the x axis' unit in the trends' window ("minimum per 13 steps"): ``"step"``,
            ``"event"``.

    Returns:
        ``path``.
    """
    plt = pyplot()
    requests = {name: _constant(size) for name, size in (requests or {}).items()}
    top = max((max(s[1], s[2]) for samples in series.values() for s in samples), default=1)
    div, unit = size_unit(max([top, *(_largest(size) for size in requests.values())]))
    first_step = min((s[0] for samples in series.values() for s in samples), default=0)
    last_step = max((s[0] for samples in series.values() for s in samples), default=1)
    window = max(1, -(-last_step // 80))
    fig, axes = plt.subplots(3, 1, figsize=(10, 9.5), sharex=True)
    colors: dict[str, str] = {}
    reference = next(iter(series.values()), [])
    faint_drawn = False
    for rank, (label, samples) in enumerate(series.items()):
        color = f"C{rank % 10}"
        colors[label] = color
        steps = [s[0] for s in samples]
        ratios = [float("nan") if s[3] is None else s[3] for s in samples]
        width = max(1.0, 3.2 - 1.0 * rank)
        same = _same_until(reference, samples) if rank else None
        name = label if same is None else f"{label} (= {next(iter(series))} {same})"
        marker = "." if len(samples) <= 60 else None    # dots only where they can be told apart
        trends = [(ax, _window_trend(samples, column, window, pick), div if column < 3 else 1)
                  for ax, column, pick in ((axes[0], 1, min), (axes[1], 2, min), (axes[2], 3, max))]
        if len(samples) > len(trends[1][1][0]):     # a window holds several samples: show them all, faint
            faint = dict(color=color, linewidth=0.5, alpha=0.25)
            axes[0].plot(steps, [s[1] / div for s in samples], **faint)
            axes[1].plot(steps, [s[2] / div for s in samples], **faint)
            axes[2].plot(steps, ratios, **faint)
            faint_drawn = True
        for ax, (xs, ys), scale in trends:
            ax.plot(xs, [y / scale for y in ys], color=color, linewidth=width, marker=marker,
                    label=name, solid_capstyle="butt")
    for name, size in sorted(requests.items(), key=lambda kv: -_largest(kv[1])):
        what = name if "request" in name else f"{name} request"
        dashed = dict(color="black", linestyle=(0, (6, 3)), linewidth=1.2, zorder=4)
        if isinstance(size, int):
            axes[1].axhline(size / div, label=f"{what} {_both_units(size)}: a smaller hole means OOM", **dashed)
        else:       # each window's largest request, held until the next window
            xs, ys = _window_trend([(step, 0, value, None) for step, value in size], 2, window, max)
            axes[1].plot(xs, [y / div for y in ys], drawstyle="steps-mid",
                         label=f"{what} (the largest {per_window(window, xunit)}, up to {_both_units(max(ys))}): "
                               "a smaller hole means OOM", **dashed)
    edges = _run_edges(first_step, last_step)
    _draw_markers(axes, markers, series, colors, div, edges[1])
    axes[1].set_xlim(*edges)
    per = per_window(window, xunit)
    axes[0].set_ylabel(f"free_total ({unit})\nminimum {per}")
    axes[1].set_ylabel(f"largest_free ({unit})\nminimum {per}")
    axes[2].set_ylabel(f"frag_ratio, maximum {per}\n(free_total / largest_free - 1)")
    axes[2].set_xlabel(xlabel)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    handles, labels = _figure_legend_entries(axes)
    if faint_drawn:
        from matplotlib.lines import Line2D
        handles.append(Line2D([], [], color="grey", linewidth=0.5, alpha=0.5))
        labels.append(f"faint: every sample; thick: the minimum (frag_ratio: maximum) {per}")
    _finish(fig, title, handles, labels)
    return save_figure(fig, path)


def _figure_legend_entries(axes) -> tuple[list, list[str]]:
    """Every axes' legend entries, each label once, in drawing order."""
    handles, labels, seen = [], [], set()
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in seen:
                seen.add(label)
                handles.append(handle)
                labels.append(label)
    return handles, labels


def _finish(fig, title: str, handles: list, labels: list[str], *, columns: int = 2,
            title_size: float = 12.0) -> None:
    """The title wrapped to the figure's width, one legend below the axes (off the data), and the
    layout that leaves both their room."""
    width_in, height_in = fig.get_size_inches()
    if title:
        fig.suptitle(wrap_to_width(title, width_in, title_size), fontsize=title_size)
    bottom = 0.0
    if handles:
        rows = -(-len(handles) // columns)
        legend_in = 0.2 * rows + 0.15
        fig.set_size_inches(width_in, height_in + legend_in)
        bottom = legend_in / (height_in + legend_in)
        fig.legend(handles, [wrap_to_width(t, width_in / columns, 8) for t in labels], loc="lower center",
                   ncol=columns, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, bottom, 1, 1))


def wrap_to_width(text: str, width_inches: float, fontsize: float) -> str:
    """``text`` broken into lines that fit ``width_inches`` at ``fontsize`` points (an average
    glyph is about 0.55 of the font size wide), each existing line wrapped on its own."""
    chars = max(20, int(width_inches * 72 / (0.55 * fontsize)) - 2)
    return "\n".join(textwrap.fill(line, chars) or line for line in text.split("\n"))


def per_window(window: int, unit: str) -> str:
    """``per step``, ``per 13 steps``: what one point of a trend stands for."""
    return f"per {unit}" if window == 1 else f"per {window} {unit}s"


def _constant(size):
    """A request's sizes: one ``int`` when they never change, else the ``(step, size)`` list."""
    if isinstance(size, int) or not size:
        return size if isinstance(size, int) else 0
    sizes = {value for _, value in size}
    return sizes.pop() if len(sizes) == 1 else list(size)


def _largest(size) -> int:
    return size if isinstance(size, int) else max(value for _, value in size)


def _both_units(size: int) -> str:
    """``3.91 GiB (4.2 GB)``: binary as everywhere here, decimal as field reports quote it."""
    text = format_size(size)
    return f"{text} ({size / 1e9:.1f} GB)" if size >= 10**9 else text


def _window_trend(samples: list[Sample], column: int, window: int, pick) -> tuple[list[int], list[float]]:
    """``pick`` (min or max) of ``column`` over each window of ``window`` steps, at the window's
    last sampled step; samples without a value (a ``None`` frag ratio) are left out."""
    xs: list[int] = []
    ys: list[float] = []
    current = None
    for sample in samples:
        value = sample[column]
        if value is None:
            continue
        key = (sample[0] - 1) // window
        if key != current:
            xs.append(sample[0])
            ys.append(value)
            current = key
        else:
            xs[-1] = sample[0]
            ys[-1] = pick(ys[-1], value)
    return xs, ys


def _same_until(reference: list[Sample], samples: list[Sample]) -> str | None:
    """How long ``samples`` coincides with ``reference`` sample for sample: ``"throughout"``,
    ``"until step N"``, or ``None`` when they part at once (nothing hidden worth naming)."""
    same = 0
    for mine, theirs in zip(samples, reference):
        if mine != theirs:
            break
        same += 1
    if same < 2:
        return None
    if same == len(samples) == len(reference):
        return "throughout"
    return f"until step {samples[same - 1][0]}"


def _run_edges(first_step: int, last_step: int) -> tuple[float, float]:
    """The x axis on the steps that ran, with a 2% margin: markers and forecasts beyond them
    would squeeze the run into a corner (a forecast beyond is named in the legend instead)."""
    return _padded(first_step, last_step)


def _padded(low: float, high: float) -> tuple[float, float]:
    """``(low, high)`` widened by 2% of the span (at least 0.05; half a unit around a single value)."""
    span = high - low
    margin = max(0.02 * span, 0.05) if span > 0 else 0.5
    return low - margin, high + margin


def _draw_markers(axes, markers: list[Marker], series: dict[str, list[Sample]], colors: dict[str, str],
                  div: int, edge: float = float("inf")) -> None:
    """Each series' markers by kind (one legend entry per kind); forecasts past ``edge`` (the
    end of the x axis) are named with their step in that entry."""
    groups: dict[tuple[str, str], list[Marker]] = {}
    for m in markers:
        if m.kind not in _MARKER_KINDS:
            raise ValueError(f"unknown marker kind {m.kind!r}; expected one of {', '.join(_MARKER_KINDS)}")
        groups.setdefault((m.series, m.kind), []).append(m)
    for (label, kind), group in groups.items():
        color = colors.setdefault(label, f"C{len(colors) % 10}")
        line = {"compaction": ":", "oom": "--"}.get(kind)
        if line:
            for ax in axes:
                for m in group:
                    ax.axvline(m.step, color=color, linestyle=line, linewidth=1)
        placed = [(m, _marker_value(m, series.get(label, []))) for m in group]
        placed = [(m, y) for m, y in placed if y is not None]
        if not placed:
            continue
        xs = [m.step for m, _ in placed]
        ys = [y / div for _, y in placed]
        if kind == "compaction":
            for m, y in placed:
                if m.largest_free_after is not None:
                    axes[1].annotate("", xy=(m.step, m.largest_free_after / div), xytext=(m.step, y / div),
                                     arrowprops=dict(arrowstyle="->", color=color, linewidth=1.5), zorder=5)
            axes[1].scatter(xs, ys, marker="^", s=60, color=color, zorder=5,
                            label=f"{label}: compaction (arrow: largest hole after)")
        elif kind == "oom":
            axes[1].scatter(xs, ys, marker="x", s=80, color=color, zorder=5, label=f"{label}: OOM")
        elif kind == "forecast":
            lows = [m.step - (m.low if m.low is not None else m.step) for m, _ in placed]
            highs = [(m.high if m.high is not None else m.step) - m.step for m, _ in placed]
            beyond = sorted(m.step for m, _ in placed if m.step > edge)
            past = f" (at step {', '.join(map(str, beyond))}, past the run)" if beyond else ""
            axes[1].errorbar(xs, ys, xerr=[lows, highs], fmt="v", markersize=8, capsize=4, color=color,
                             zorder=5, label=f"{label}: forecast, watched request stops fitting{past}")
        else:
            axes[1].scatter(xs, ys, marker="x", s=70, color="red", zorder=5,
                            label=f"{label}: predicted OOM (watched request)")


def _marker_value(marker: Marker, samples: list[Sample]) -> int | None:
    """Where the marker sits on the largest_free panel: its own value, else the series' last
    sample at or before its step."""
    if marker.largest_free is not None:
        return marker.largest_free
    before = [s[2] for s in samples if s[0] <= marker.step]
    return before[-1] if before else None


_REQUIRED = ("policy", "step", "kind", "free_total", "largest_free")


def _rows(path: str | Path) -> list[dict]:
    """The samples of a simulation timeline (:func:`ms_memopt.core.jsontext.read_json_lines`: a torn
    last line is dropped); a complete line that is not a JSON object with ``policy``, ``step``, ``kind``, ``free_total`` and ``largest_free`` raises
    :class:`InputError` naming file:line."""
    source = str(path)
    out = []
    for number, row in read_json_lines(path):
        missing = [k for k in _REQUIRED if row.get(k) is None]
        if missing:
            raise InputError(f"a timeline sample needs {', '.join(missing)}", source=source, line=number)
        if not all(isinstance(row[k], int) for k in ("step", "free_total", "largest_free")):
            raise InputError("expected integer step, free_total and largest_free", source=source, line=number)
        out.append(row)
    return out


def plot_fragmentation_timeline(timeline: str | Path, out_png: str | Path, *, seed: int | None = None,
                                title: str = "Fragmentation timeline") -> Path:
    """Plot a simulation's timeline JSONL (``ms-memopt simulate --out``) with :func:`plot_timeline`:
    one line per policy for one seed (default: the first seed in the file), sampled at scans and
    before watched requests; compactions and OOMs marked, and each policy's last forecast that
    saw the watched request stop fitting (scan rows' ``forecast``, docs/forecast.md).

    Raises:
        InputError: a bad line (names file:line); a torn last line is ignored.
    """
    rows = _rows(timeline)
    if seed is None and rows:
        seed = rows[0].get("seed")
    series: dict[str, list[Sample]] = {}
    markers: list[Marker] = []
    requests: dict[str, list[tuple[int, int]]] = {}
    last_forecast: dict[str, Marker] = {}
    rank = None
    for row in rows:
        if row.get("seed") != seed:
            continue
        rank = row.get("rank", rank)      # a job simulation's stream: a rank with its own seed
        if row["kind"] == "scan" and isinstance(row.get("forecast"), dict) and row["forecast"].get("step") is not None:
            last_forecast[row["policy"]] = forecast_marker(row["policy"], row["forecast"])
        policy = row["policy"]
        kind = row["kind"]
        if kind in ("scan", "watch"):
            series.setdefault(policy, []).append((row["step"], row["free_total"], row["largest_free"],
                                                  row.get("frag_ratio")))
            if kind == "watch" and isinstance(row.get("size"), int):
                requests.setdefault(str(row.get("tag") or "watched"), []).append((row["step"], row["size"]))
        elif kind == "compaction":
            before = row.get("largest_free_before")
            markers.append(Marker(policy, row["step"], "compaction", before if isinstance(before, int) else None,
                                  row["largest_free"]))
        elif kind == "oom":
            markers.append(Marker(policy, row["step"], "oom", row["largest_free"]))
    markers += last_forecast.values()
    # name the rank and seed unless the caller's title does already
    which = [part for part in ([] if rank is None else [f"rank {rank}"]) + [f"seed {seed}"] if part not in title]
    return plot_timeline(series, out_png, markers=markers, requests=requests,
                         title=f"{title}{' (' + ', '.join(which) + ')' if which else ''}: "
                               "samples at scans and before watched requests")


def plot_sweep(rows: list[dict], keys: list[str], path: str | Path, *, title: str = "Sweep") -> Path:
    """The job OOM step per policy over a sweep's grid (:func:`ms_memopt.simulation.sweep.sweep_rows`):
    one group of bars per grid point, one bar per policy; a job that survives every step is a
    hatched bar to the last simulated step, marked "no OOM"; step 0 ("cannot start") is a
    pool-mode plan larger than the card.

    Example:
        >>> rows = [{"hbm": "64GB", "policy": "baseline", "job_oom_step": 120, "steps": 500},
        ...         {"hbm": "64GB", "policy": "pool", "job_oom_step": None, "steps": 500}]
        >>> plot_sweep(rows, ["hbm"], "/tmp/sweep.png").name                     # doctest: +SKIP
        'sweep.png'
    """
    plt = pyplot()
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    points = list(dict.fromkeys(tuple(r[k] for k in keys) for r in rows))
    by = {(tuple(r[k] for k in keys), r["policy"]): r for r in rows}
    width = 0.8 / max(1, len(policies))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(points) * max(1, len(policies)) ** 0.5 + 2), 4.2))
    for i, policy in enumerate(policies):
        color = f"C{i}"
        for j, point in enumerate(points):
            row = by.get((point, policy))
            if row is None:
                continue
            x = j + (i - (len(policies) - 1) / 2) * width
            dead = row["job_oom_step"] is not None
            height = row["job_oom_step"] if dead else row["steps"]
            ax.bar(x, height, width * 0.9, color=color if dead else "none", edgecolor=color,
                   hatch=None if dead else "//", label=policy if j == 0 else None)
            note = ("cannot start" if height == 0 else str(height)) if dead else "no OOM"
            ax.annotate(note, (x, height), ha="center", va="bottom",
                        fontsize=7, rotation=90 if len(points) * len(policies) > 12 else 0)
    ax.set_xticks(range(len(points)))
    ax.set_xticklabels(["\n".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(keys, point)) for point in points],
                       fontsize=8)
    ax.set_ylabel("job OOM step (first rank)")
    steps = max((r["steps"] for r in rows), default=1)
    ax.set_ylim(0, steps * 1.02)
    ax.axhline(steps, color="grey", lw=0.6, ls=":")
    width_in = fig.get_size_inches()[0]
    ax.set_title(wrap_to_width(f"{title}\n(hatched: every rank survived {steps} steps)", width_in, 9), fontsize=9)
    _finish(fig, "", *_figure_legend_entries([ax]), columns=max(1, len(policies)))
    fit_to_texts(fig, ax, "y")      # room for the notes above the bars, and no more
    return save_figure(fig, path)


def plot_step_times(policies: dict[str, dict], path: str | Path, *, title: str = "Step time") -> Path:
    """The job's step time per policy (``{policy: {"step_seconds": [...], "rank_step_median": [...]}}``,
    :mod:`ms_memopt.simulation.timing`): a timeline (left) and each rank's median busy time (right: the
    distribution across ranks, where a straggler shows).

    Policies are drawn from the widest line to the thinnest, so one that coincides with another
    stays visible (the legend says until which step); a policy with fewer steps than the longest
    stopped at its job's OOM (``job_oom_step`` when given, else the step after its last), marked
    with a cross there."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [3, 1]})
    names = list(policies)
    longest = max((len(d.get("step_seconds") or []) for d in policies.values()), default=0)
    first_steps = (next(iter(policies.values()), {}).get("step_seconds") or []) if policies else []
    for i, (policy, data) in enumerate(policies.items()):
        color = f"C{i % 10}"
        steps = data.get("step_seconds") or []
        label = policy
        if i and steps and steps[:2] == first_steps[:2]:
            same = next((k for k, (a, b) in enumerate(zip(steps, first_steps)) if a != b), min(len(steps), len(first_steps)))
            label += f" (= {names[0]} until step {same})" if same < len(steps) else f" (= {names[0]} throughout)"
        # the median per window of steps, thick, over every step, faint (a thousand noisy steps hide each other)
        window = max(1, -(-longest // 100))
        xs = list(range(1, len(steps) + 1))
        trend_x = [min(k + window, len(steps)) for k in range(0, len(steps), window)]
        trend_y = [statistics.median(steps[k:k + window]) for k in range(0, len(steps), window)]
        if window > 1:
            left.plot(xs, steps, lw=0.5, alpha=0.3, color=color)
        left.plot(trend_x, trend_y, lw=max(0.9, 3.0 - 1.0 * i), color=color, label=label)
        oom = data.get("job_oom_step") or (len(steps) + 1 if steps and len(steps) < longest else None)
        if oom is not None and steps:
            left.scatter([trend_x[-1]], [trend_y[-1]], marker="x", s=80, color=color, zorder=5,
                         label=f"{policy}: the job dies at step {oom} (OOM)")
        ranks = data.get("rank_step_median") or []
        right.scatter([i] * len(ranks), ranks, s=10, alpha=0.6, color=color)
    window = max(1, -(-longest // 100))
    left.set_xlabel("step" + (f" (faint: every step; thick: the median per {window} steps)" if window > 1 else ""))
    left.set_ylabel("job step (s)")
    if longest:
        left.set_xlim(*_padded(1, longest))
    width_in = fig.get_size_inches()[0]
    left.set_title(wrap_to_width(title, width_in * 0.7, 9), fontsize=9)
    right.set_xticks(range(len(names)), names, fontsize=8)
    right.margins(x=0.1)
    right.set_ylabel("rank median busy (s)")
    right.set_title("across ranks", fontsize=9)
    handles, labels = _figure_legend_entries([left])
    _finish(fig, "", handles, labels, columns=3)
    return save_figure(fig, path)


# --- purposes and their colors (memory maps, region budgets) -----------------------------------

# purpose -> color, and tag prefixes -> purpose; tags not listed are "other"
PURPOSE_COLORS = {"parameter": "#1f77b4", "optimizer": "#9467bd", "gradient": "#ff7f0e",
                   "activation": "#2ca02c", "allreduce": "#d62728", "shape_cache": "#8c564b",
                   "workspace": "#e377c2", "other": "#7f7f7f"}
PURPOSE_OF = {"param": "parameter", "weight": "parameter", "optim": "optimizer", "master": "optimizer",
               "adam": "optimizer", "grad": "gradient", "activ": "activation", "act": "activation",
               "saved": "activation", "allreduce": "allreduce", "communication": "allreduce", "comm_": "allreduce",
               "reduce": "allreduce", "bucket": "allreduce",
               "shape": "shape_cache", "rope": "shape_cache", "workspace": "workspace", "scratch": "workspace"}
FREE_COLOR = "#f2f2f2"


def purpose_color(tag: str | None) -> tuple[str, str]:
    """(purpose, color) of a block or region tag, by prefix.

    >>> purpose_color("grad_accum")
    ('gradient', '#ff7f0e')
    """
    name = (tag or "").lower()
    for prefix, purpose in PURPOSE_OF.items():
        if name.startswith(prefix):
            return purpose, PURPOSE_COLORS[purpose]
    return "other", PURPOSE_COLORS["other"]


def pool_color(pool: str) -> tuple[str, str]:
    """Untagged live blocks (allocator models keep no tags) are coloured by their pool or region."""
    purpose, color = purpose_color(pool)
    if purpose != "other":
        return purpose, color
    if pool == "persistent":
        return "persistent pool (parameters, optimizer states)", "#1f77b4"
    return f"{pool} pool (untagged)", "#7f7f7f"


# --- the plots of a run's report --------------------------------------------------------------

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
    colors = [purpose_color(n)[1] for n in names]
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
    ax.set_xlim(0, max(total, capacity or 0) / div * 1.02)
    ax.grid(True, axis="x", alpha=0.3)
    extra = []
    if plan.get("checkpoint_every") is not None:
        extra.append(f"checkpoint_every {plan['checkpoint_every']}")
    if plan.get("worst_stage") is not None:
        extra.append(f"worst pipeline stage {plan['worst_stage']}")
    ax.set_title(f"{title}: {verdict}" + (f" ({', '.join(extra)})" if extra else ""), fontsize=10)
    fig.tight_layout()
    fit_to_texts(fig, ax)
    return save_figure(fig, path)


def fit_to_texts(fig, ax, axis: str = "x") -> None:
    """Extend ``ax``'s upper ``axis`` ("x" or "y") limit just enough for the texts drawn on the
    data (labels at the ends of bars, figures above rows), and no further.

    A text keeps its size in pixels while the limit moves, so the limit is solved for: a text
    anchored at ``a`` reaching ``e`` pixels past its anchor fits when
    ``(a - low) / (high - low) * length + e <= length``."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    k = 0 if axis == "x" else 1
    low, high = ax.get_xlim() if axis == "x" else ax.get_ylim()
    frame = ax.get_window_extent(renderer)
    length = frame.width if axis == "x" else frame.height
    needed = high
    for text in ax.texts:
        if not text.get_visible() or not text.get_text().strip():
            continue
        anchor = getattr(text, "xy", None) or text.get_position()      # an annotation's point, a text's position
        anchor_px = ax.transData.transform(anchor)[k]
        past = text.get_window_extent(renderer).get_points()[1, k] - anchor_px
        a = anchor[k]
        if 0 < past < 0.8 * length and a > low:
            needed = max(needed, low + (a - low) * length / (0.97 * length - past))     # and a 3% margin
    if needed > high:
        (ax.set_xlim if axis == "x" else ax.set_ylim)(low, needed)


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


def plot_scan_timeline(scans: dict[int, list[dict]], path: str | Path, *,
                       title: str = "Layout scans") -> Path:
    """``free_total``, ``largest_free`` and ``frag_ratio`` against the step from scan logs, one line
    per rank, compactions, predicted OOMs (a watched request that would not fit) and the latest
    forecast of when a watched request stops fitting (docs/forecast.md) marked; drawn
    by :func:`ms_memopt.report.plots.plot_timeline`, the figure simulations use too."""
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

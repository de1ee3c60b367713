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

from dataclasses import dataclass
from pathlib import Path

from .errors import InputError
from .jsontext import read_json_lines

__all__ = ["Marker", "forecast_marker", "plot_fragmentation_timeline", "plot_timeline", "pyplot", "save_figure",
           "size_unit"]

#: one sample: (step, free_total bytes, largest_free bytes, frag_ratio or None when nothing is free)
Sample = tuple[int, int, int, "float | None"]

_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
_MARKER_KINDS = ("compaction", "oom", "predicted_oom", "forecast")


@dataclass
class Marker:
    """An event on a series' timeline: ``kind`` is ``"compaction"`` (triangle, dotted line),
    ``"oom"`` (cross, dashed line through every panel) or ``"predicted_oom"`` (a watched request
    that would not fit: red cross) or ``"forecast"`` (the step a watched request of
    ``largest_free`` bytes is forecast to stop fitting, :mod:`ms_memopt.forecast`: a triangle
    with the interval ``low``-``high`` as an error bar; ``high`` ``None``: open-ended).
    ``largest_free`` (bytes) places the symbol on the middle panel; ``None`` puts it at the
    series' sample of that step (or 0)."""

    series: str
    step: int
    kind: str
    largest_free: int | None = None
    low: int | None = None
    high: int | None = None


def forecast_marker(series: str, forecast: dict) -> Marker:
    """The marker of a forecast as scan records and timelines carry it
    (:func:`ms_memopt.scan.forecast_fields`)."""
    return Marker(series, forecast["step"], "forecast", forecast.get("request"),
                  low=forecast.get("earliest_step"), high=forecast.get("latest_step"))


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str | Path, *, dpi: int = 110) -> Path:
    """Save ``fig`` as ``path`` (parent directories created) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
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
                  title: str = "Fragmentation timeline") -> Path:
    """Three panels against the step: ``free_total``, ``largest_free`` and ``frag_ratio``.

    Args:
        series: label -> samples ``(step, free_total, largest_free, frag_ratio)`` in step order
            (sizes in bytes; ``frag_ratio`` ``None`` when nothing is free).
        path: the PNG to write.
        markers: compactions, OOMs and predicted OOMs (see :class:`Marker`); a marker of a
            label not in ``series`` gets a colour of its own.
        title: the figure title.

    Returns:
        ``path``.
    """
    plt = pyplot()
    div, unit = size_unit(max((max(s[1], s[2]) for samples in series.values() for s in samples), default=1))
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    colors: dict[str, str] = {}
    for label, samples in series.items():
        steps = [s[0] for s in samples]
        marker = "." if len(samples) <= 60 else None    # dots only where they can be told apart
        line, = axes[0].plot(steps, [s[1] / div for s in samples], label=label, linewidth=1, marker=marker)
        colors[label] = line.get_color()
        axes[1].plot(steps, [s[2] / div for s in samples], label=label, color=colors[label], linewidth=1,
                     marker=marker)
        axes[2].plot(steps, [float("nan") if s[3] is None else s[3] for s in samples], label=label,
                     color=colors[label], linewidth=1, marker=marker)
    at_step = {label: {s[0]: s[2] for s in samples} for label, samples in series.items()}
    groups: dict[tuple[str, str], list[Marker]] = {}
    for m in markers:
        if m.kind not in _MARKER_KINDS:
            raise ValueError(f"unknown marker kind {m.kind!r}; expected one of {', '.join(_MARKER_KINDS)}")
        groups.setdefault((m.series, m.kind), []).append(m)
    for (label, kind), group in groups.items():
        color = colors.setdefault(label, f"C{len(colors) % 10}")
        xs = [m.step for m in group]
        ys = [(m.largest_free if m.largest_free is not None else at_step.get(label, {}).get(m.step, 0)) / div
              for m in group]
        if kind == "compaction":
            for ax in axes:
                for x in xs:
                    ax.axvline(x, color=color, linestyle=":", linewidth=1)
            axes[1].scatter(xs, ys, marker="^", s=60, color=color, zorder=3, label=f"{label}: compaction")
        elif kind == "oom":
            for ax in axes:
                for x in xs:
                    ax.axvline(x, color=color, linestyle="--", linewidth=1)
            axes[1].scatter(xs, ys, marker="x", s=80, color=color, zorder=3, label=f"{label}: OOM")
        elif kind == "forecast":
            lows = [m.step - (m.low if m.low is not None else m.step) for m in group]
            highs = [(m.high if m.high is not None else m.step) - m.step for m in group]
            axes[1].errorbar(xs, ys, xerr=[lows, highs], fmt="v", markersize=8, capsize=4, color=color,
                             zorder=3, label=f"{label}: forecast, watched request stops fitting")
        else:
            axes[1].scatter(xs, ys, marker="x", s=70, color="red", zorder=3,
                            label=f"{label}: predicted OOM (watched request)")
    axes[0].set_ylabel(f"free_total ({unit})")
    axes[1].set_ylabel(f"largest_free ({unit})")
    axes[2].set_ylabel("frag_ratio\n(free_total / largest_free - 1)")
    axes[2].set_xlabel("training step")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


_REQUIRED = ("policy", "step", "kind", "free_total", "largest_free")


def _rows(path: str | Path) -> list[dict]:
    """The samples of a simulation timeline (:func:`ms_memopt.jsontext.read_json_lines`: a torn
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
    saw the watched request stop fitting (scan rows' ``forecast``).

    Raises:
        InputError: a bad line (names file:line); a torn last line is ignored.
    """
    rows = _rows(timeline)
    if seed is None and rows:
        seed = rows[0].get("seed")
    series: dict[str, list[Sample]] = {}
    markers: list[Marker] = []
    last_forecast: dict[str, Marker] = {}
    for row in rows:
        if row.get("seed") != seed:
            continue
        policy = row["policy"]
        if row["kind"] in ("scan", "watch"):
            series.setdefault(policy, []).append((row["step"], row["free_total"], row["largest_free"],
                                                  row.get("frag_ratio")))
        elif row["kind"] in ("compaction", "oom"):
            markers.append(Marker(policy, row["step"], row["kind"], row["largest_free"]))
        if row["kind"] == "scan" and (row.get("forecast") or {}).get("step") is not None:
            last_forecast[policy] = forecast_marker(policy, row["forecast"])
    markers += last_forecast.values()
    return plot_timeline(series, out_png, markers=markers,
                         title=f"{title} (seed {seed}; samples at scans and before watched requests)")

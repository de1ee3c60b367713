"""What can be checked mechanically in a figure before a reader sees it.

:func:`figure_problems` looks at a drawn matplotlib figure and lists its defects in words:

* **text outside the figure**: a title, label, tick label, legend entry or annotation that is cut
  at an edge of the image; a label placed on the data that runs out of its axes;
* **overlapping text**: two pieces of text drawn over each other (forecast labels at one spot,
  region names side by side, a legend over the axis labels);
* **a legend over data**: a legend inside an axes that covers a point or a segment of a line
  or a scatter drawn there;
* **axes past the data**: an axis whose limits run beyond everything drawn on it (the data, and
  text placed in data coordinates) by more than ``margin`` of its span (an x axis to 1200 for
  1000 steps).

:func:`ms_memopt.report.plots.save_figure` runs it on every figure it writes and warns
(:class:`FigureWarning`, naming the file) for each defect, so a command's figures are checked
wherever they are drawn (the README tour's test turns those warnings into failures).

Example:
    >>> import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots()
    >>> _ = ax.plot([1, 1000], [0, 1]); _ = ax.set_xlim(0, 1200)
    >>> figure_problems(fig)
    ['axes 1: the x axis runs to 1200 past the data (to 1000): 17% of its span is empty']
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["FigureWarning", "figure_problems"]

#: the share of an axis' span that may lie beyond its data on either side (matplotlib's own margin is 5%)
MARGIN = 0.1
#: pixels two text boxes or a box and the figure edge may share before it counts
_SLACK = 1.0


class FigureWarning(UserWarning):
    """A figure we wrote has a defect a reader would notice (:func:`figure_problems`)."""


def figure_problems(fig, *, margin: float = MARGIN) -> list[str]:
    """The defects of ``fig`` (drawn here first), one sentence each; ``[]`` when none is found.

    Args:
        fig: a matplotlib figure, laid out as it will be saved.
        margin: the share of an axis' span allowed beyond its data on either side.
    """
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = _texts(fig)
    boxes = [(text, text.get_window_extent(renderer)) for text in texts]
    problems = []
    edge = fig.bbox
    for text, box in boxes:
        if (box.x0 < edge.x0 - _SLACK or box.x1 > edge.x1 + _SLACK or box.y0 < edge.y0 - _SLACK
                or box.y1 > edge.y1 + _SLACK):
            problems.append(f"text {_quote(text)} is cut at the edge of the figure")
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            if _overlap(box_a, box_b):
                problems.append(f"text {_quote(a)} overlaps {_quote(b)}")
    for number, ax in enumerate(fig.axes, 1):
        frame = ax.get_window_extent(renderer).padded(_SLACK)
        for text in ax.texts:        # a label on the data belongs inside its axes
            box = text.get_window_extent(renderer)
            if text.get_visible() and text.get_text().strip() and not _inside(box, frame):
                problems.append(f"axes {number}: text {_quote(text)} runs out of the axes")
        legend = ax.get_legend()
        if legend is not None and legend.get_visible():
            covered = _covered_artists(ax, legend.get_window_extent(renderer))
            if covered:
                problems.append(f"axes {number}: the legend covers {', '.join(covered)}")
        problems += [f"axes {number}: {p}" for p in _axis_overshoot(ax, renderer, margin)]
    return problems


def _texts(fig) -> list:
    """Every piece of text the figure draws: its own texts and legends, and per axes the titles,
    axis labels, tick labels in view, offset texts, annotations and the legend."""
    out = list(fig.texts)
    for legend in fig.legends:
        out += [legend.get_title(), *legend.get_texts()]
    for ax in fig.axes:
        out += [ax.title, ax._left_title, ax._right_title] if hasattr(ax, "_left_title") else [ax.title]
        for axis in (ax.xaxis, ax.yaxis):
            out += [axis.label, axis.get_offset_text(), *_tick_labels(axis)]
        out += list(ax.texts)
        legend = ax.get_legend()
        if legend is not None:
            out += [legend.get_title(), *legend.get_texts()]
    return [t for t in out if t is not None and t.get_visible() and t.get_text().strip()]


def _tick_labels(axis) -> list:
    """The tick labels drawn: the locator's ticks inside the view (it also returns some beyond)."""
    low, high = sorted(axis.get_view_interval())
    slack = 1e-9 * max(abs(low), abs(high), high - low)
    out = []
    for locs, ticks in ((axis.get_majorticklocs(), axis.get_major_ticks),
                        (axis.get_minorticklocs(), axis.get_minor_ticks)):
        for loc, tick in zip(locs, ticks(len(locs))):
            if low - slack <= loc <= high + slack:
                out += [label for label in (tick.label1, tick.label2) if label.get_visible()]
    return out


def _quote(text) -> str:
    words = " ".join(text.get_text().split())
    return repr(words if len(words) <= 60 else words[:57] + "...")


def _inside(box, frame) -> bool:
    return box.x0 >= frame.x0 and box.x1 <= frame.x1 and box.y0 >= frame.y0 and box.y1 <= frame.y1


def _overlap(a, b) -> bool:
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return width > _SLACK and height > _SLACK


def _covered_artists(ax, box) -> list[str]:
    """Labels (or kinds) of the lines and scatters of ``ax`` with a point or a segment under ``box``."""
    covered = []
    inner = box.padded(-_SLACK)
    for line in ax.lines:
        if not line.get_visible() or line.get_transform() != ax.transData:
            continue          # axhline/axvline span the axes: every legend would "cover" them
        xy = np.asarray(line.get_xydata(), dtype=float)
        if len(xy) == 0:
            continue
        pixels = ax.transData.transform(xy)
        if len(pixels) > 1 and line.get_linestyle() not in ("None", "", " "):
            # points along each segment (a line can cross a legend between two of its points)
            t = np.linspace(0.0, 1.0, 9)[:, None, None]
            pixels = (pixels[:-1] * (1 - t) + pixels[1:] * t).reshape(-1, 2)
        if _any_inside(pixels, inner):
            covered.append(_artist_name(line, "a line"))
    for collection in ax.collections:
        offsets = collection.get_offsets()
        if not collection.get_visible() or len(offsets) == 0 or collection.get_offset_transform() != ax.transData:
            continue
        if _any_inside(ax.transData.transform(np.asarray(offsets, dtype=float)), inner):
            covered.append(_artist_name(collection, "points"))
    return covered


def _any_inside(pixels: np.ndarray, box) -> bool:
    ok = np.isfinite(pixels).all(axis=1)
    p = pixels[ok]
    return bool(((p[:, 0] > box.x0) & (p[:, 0] < box.x1) & (p[:, 1] > box.y0) & (p[:, 1] < box.y1)).any())


def _artist_name(artist, kind: str) -> str:
    label = artist.get_label() or ""
    return kind if label.startswith("_") or not label else repr(label)


def _axis_overshoot(ax, renderer, margin: float) -> list[str]:
    """Each linear axis whose limits run past what is drawn (data, and text placed in data
    coordinates) by more than ``margin`` of its span."""
    # axes that share an axis (panels over one x axis) share its data: a panel may have less of it
    lo, hi = [math.inf, math.inf], [-math.inf, -math.inf]
    for k, group in enumerate((ax.get_shared_x_axes(), ax.get_shared_y_axes())):
        for sibling in group.get_siblings(ax):
            data = sibling.dataLim
            if np.isfinite(data.get_points()).all() and data.width >= 0 and data.height >= 0:
                lo[k] = min(lo[k], (data.x0, data.y0)[k])
                hi[k] = max(hi[k], (data.x1, data.y1)[k])
    if not all(math.isfinite(v) for v in (*lo, *hi)):
        return []
    inverse = ax.transData.inverted()
    for text in ax.texts:         # labels placed on the data (bar values, annotations) count as drawn
        if not text.get_visible() or not text.get_text().strip() or text.get_transform() != ax.transData:
            continue
        corners = inverse.transform(text.get_window_extent(renderer).get_points())
        lo = [min(lo[k], corners[:, k].min()) for k in (0, 1)]
        hi = [max(hi[k], corners[:, k].max()) for k in (0, 1)]
    problems = []
    for k, (name, limits, scale) in enumerate((("x", ax.get_xlim(), ax.get_xscale()),
                                               ("y", ax.get_ylim(), ax.get_yscale()))):
        if scale != "linear" or hi[k] <= lo[k]:
            continue
        low, high = sorted(limits)
        span = high - low
        if span <= 0 or not math.isfinite(span):
            continue
        if high - hi[k] > margin * span:
            problems.append(f"the {name} axis runs to {_num(high)} past the data (to {_num(hi[k])}): "
                            f"{(high - hi[k]) / span:.0%} of its span is empty")
        if lo[k] - low > margin * span:
            problems.append(f"the {name} axis starts at {_num(low)} before the data (from {_num(lo[k])}): "
                            f"{(lo[k] - low) / span:.0%} of its span is empty")
    return problems


def _num(value: float) -> str:
    return f"{value:.4g}"

"""The memory map: each row a pool at one step, segments end to end in address order, live blocks
coloured by purpose and holes light grey (the picture of "14 GB free and no 4.2 GB piece").

Example:
    >>> from ms_memopt.core.layout import Block, Layout, Segment
    >>> seg = Segment(0, 1024, [Block(0, 512, True, tag="grad_bucket"), Block(512, 512, False)])
    >>> plot_memory_map([LayoutSnapshot(1, "step 1", Layout([seg]))], "out/map.png")   # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ms_memopt.core.errors import InputError
from ms_memopt.core.metrics import measure
from ms_memopt.core.units import format_size
from ms_memopt.io.layouts import LayoutSnapshot
from ms_memopt.report.plots import (FREE_COLOR, PURPOSE_COLORS, fit_to_texts, pool_color, purpose_color, pyplot,
                                    save_figure, size_unit, wrap_to_width)

__all__ = ["plot_memory_map"]


def plot_memory_map(snapshots: Sequence[LayoutSnapshot], path: str | Path, *,
                    title: str = "Memory map", outline: Sequence[tuple[int, int]] = ()) -> Path:
    """One row per snapshot: the pool's segments laid end to end in address order (gaps between
    segments, which no request can use, are left out), live blocks coloured by purpose, free
    blocks (holes) light grey, segment/region boundaries as black ticks with the region name
    where it fits inside its region. Above each row, from its start, its free total, largest hole
    and frag ratio.
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
    fig, ax = plt.subplots(figsize=(12, 1.4 + 1.0 * rows))
    used: dict[str, str] = {}
    names = []          # (text, end of its region in data units): kept where they fit, see _drop_crowded
    for row, snap in enumerate(snapshots):
        y = rows - 1 - row
        offset = 0
        bars: dict[str, list[tuple[float, float]]] = {}
        framed = []
        regions = []      # (pool, start, end) of runs of segments of one pool, in address order
        for seg in sorted(snap.layout.segments, key=lambda s: s.addr):
            for addr, size in outline:
                if seg.addr <= addr < seg.end:
                    framed.append(((offset + addr - seg.addr) / div, size / div))
            for block in seg.blocks:
                start = (offset + block.addr - seg.addr) / div
                width = block.size / div
                if block.live:
                    label, color = purpose_color(block.tag) if block.tag else pool_color(seg.pool)
                    used[label] = color
                else:
                    label, color = "free", FREE_COLOR
                bars.setdefault(color, []).append((start, width))
            ax.plot([offset / div] * 2, [y - 0.36, y + 0.36], color="black", linewidth=0.8)
            if regions and regions[-1][0] == seg.pool:
                regions[-1][2] = offset + seg.size
            else:
                regions.append([seg.pool, offset, offset + seg.size])
            offset += seg.size
        ax.plot([offset / div] * 2, [y - 0.36, y + 0.36], color="black", linewidth=0.8)
        for pool, start, end in regions:   # name each region where it starts
            names.append((ax.text((start + (end - start) * 0.005) / div, y - 0.29, f" {pool}", fontsize=6.5,
                                  va="bottom", ha="left", color="black", alpha=0.85), end / div))
        few = sum(len(v) for v in bars.values()) <= 400   # block edges only where they stay visible
        for color, spans in bars.items():
            ax.broken_barh(spans, (y - 0.3, 0.6), facecolors=color,
                           edgecolor="white" if few else "none", linewidth=0.4)
        if framed:
            ax.broken_barh(framed, (y - 0.34, 0.68), facecolors="none", edgecolor="red", linewidth=1.2, zorder=5)
        m = measure(snap.layout)
        ratio = "n/a" if m.frag_ratio is None else f"{m.frag_ratio:.2f}"
        # above the row, from its start: a row shorter than the widest still has room for it
        ax.text(0, y + 0.38, f"free {format_size(m.free_total)}, largest hole "
                f"{format_size(m.largest_free)}, frag {ratio}", fontsize=8, va="bottom", ha="left")
    all_regions = {seg.pool for snap in snapshots for seg in snap.layout.segments}
    ax.set_yticks(range(rows))
    ax.set_yticklabels([snap.label for snap in reversed(snapshots)])
    ax.set_ylim(-0.45, rows - 0.55)     # raised to the figures above the top row below
    ax.set_xlim(0, widest / div * 1.01)
    ax.set_xlabel(f"offset in reserved memory ({unit}); segments in address order, black ticks = "
                  f"segment boundaries")
    order = list(PURPOSE_COLORS)
    handles = [Patch(facecolor=c, label=f"live: {n}")
               for n, c in sorted(used.items(), key=lambda nc: (order.index(nc[0]) if nc[0] in order else 99, nc[0]))]
    handles.append(Patch(facecolor=FREE_COLOR, edgecolor="#999999", label="free (hole)"))
    if outline:
        handles.append(Patch(facecolor="none", edgecolor="red", label="outlined: the blocks in the way"))
    width_in = fig.get_size_inches()[0]
    ax.set_title(wrap_to_width(f"{title}\n(pools/regions: {', '.join(sorted(all_regions))})", width_in, 10),
                 fontsize=10)
    legend_rows = -(-len(handles) // 6)
    legend_in = 0.22 * legend_rows + 0.1
    height_in = fig.get_size_inches()[1]
    fig.set_size_inches(width_in, height_in + legend_in)
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, legend_in / (height_in + legend_in), 1, 1))
    fit_to_texts(fig, ax, "y")
    _drop_crowded(fig, names)
    return save_figure(fig, path)


def _drop_crowded(fig, names: list) -> None:
    """Remove the region names that do not fit inside their region, or that would cover the
    name before them (small regions side by side): the title lists every region."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    kept = []
    for text, end in names:
        box = text.get_window_extent(renderer)
        right = text.axes.transData.transform((end, 0))[0]
        if box.x1 > right or any(box.overlaps(other) for other in kept):
            text.remove()
        else:
            kept.append(box)


# --- region budget -------------------------------------------------------------------------------

"""Plots of simulation timelines (matplotlib, written to files; no display needed).

Example:
    >>> plot_fragmentation_timeline("out/timeline.jsonl", "out/fragmentation.png")  # doctest: +SKIP
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["plot_fragmentation_timeline"]

_GIB = 2**30


def _rows(path: str | Path, seed: int | None):
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if seed is None or row.get("seed") == seed:
                yield row


def plot_fragmentation_timeline(timeline: str | Path, out_png: str | Path, *, seed: int | None = None,
                                title: str = "Fragmentation timeline") -> Path:
    """Plot ``free_total``, ``largest_free`` (GiB) and ``frag_ratio`` against the step, one line
    per policy, for one seed (default: the first seed in the file); compactions (triangles)
    and OOMs (crosses) marked. Reads the timeline JSONL written by ``ms-memopt simulate``.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if seed is None:
        first = next(_rows(timeline, None), None)
        seed = first.get("seed") if first else None
    series: dict[str, dict[str, list]] = {}
    events: dict[str, dict[str, list]] = {}
    for row in _rows(timeline, seed):
        policy = row["policy"]
        if row["kind"] in ("scan", "watch"):
            s = series.setdefault(policy, {"step": [], "free": [], "largest": [], "frag": []})
            s["step"].append(row["step"])
            s["free"].append(row["free_total"] / _GIB)
            s["largest"].append(row["largest_free"] / _GIB)
            s["frag"].append(row["frag_ratio"] if row["frag_ratio"] is not None else float("nan"))
        elif row["kind"] in ("compaction", "oom"):
            e = events.setdefault(policy, {"compaction": [], "oom": []})
            e[row["kind"]].append((row["step"], row["largest_free"] / _GIB))
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    colors = {}
    for policy, s in series.items():
        line, = axes[0].plot(s["step"], s["free"], label=policy, linewidth=1)
        colors[policy] = line.get_color()
        axes[1].plot(s["step"], s["largest"], label=policy, color=colors[policy], linewidth=1)
        axes[2].plot(s["step"], s["frag"], label=policy, color=colors[policy], linewidth=1)
    for policy, e in events.items():
        color = colors.get(policy)
        if e["compaction"]:
            xs, ys = zip(*e["compaction"])
            axes[1].scatter(xs, ys, marker="^", color=color, label=f"{policy}: compaction", zorder=3)
        if e["oom"]:
            xs, ys = zip(*e["oom"])
            for ax in axes:
                for x in xs:
                    ax.axvline(x, color=color, linestyle="--", linewidth=1)
            axes[1].scatter(xs, ys, marker="x", s=80, color=color, label=f"{policy}: OOM", zorder=3)
    axes[0].set_ylabel("free_total (GiB)")
    axes[1].set_ylabel("largest_free (GiB)")
    axes[2].set_ylabel("frag_ratio (free_total / largest_free - 1)")
    axes[2].set_xlabel("training step")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(f"{title} (seed {seed}; samples at scans and before watched requests)")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png

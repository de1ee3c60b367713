"""Merge the per-rank scan logs of a run: per step, the worst and the median frag ratio.

A run's log directory holds ``rank_N/scan*.jsonl`` (one per rank, written by
:class:`ms_memopt.scan.ScanLog`); a lone ``scan*.jsonl`` at the top counts as the rank its
records name. Framework-free.

Example:
    >>> import tempfile, json, os
    >>> d = tempfile.mkdtemp()
    >>> for rank, frag in ((0, 0.5), (1, 2.0)):
    ...     os.makedirs(f"{d}/rank_{rank}")
    ...     with open(f"{d}/rank_{rank}/scan.jsonl", "w") as f:
    ...         _ = f.write(json.dumps({"kind": "scan", "step": 100, "rank": rank, "frag_ratio": frag,
    ...                                 "free_total": 10, "largest_free": 4}) + "\\n")
    >>> row = merge_ranks(d).steps[0]
    >>> (row.step, row.ranks, row.frag_max, row.frag_median, row.worst_rank)
    (100, 2, 2.0, 1.25, 1)
"""
from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import InputError
from .scan import read_scan_log

__all__ = ["StepSummary", "MergedRun", "find_scan_logs", "merge_ranks"]

_RANK_DIR = re.compile(r"^rank_(\d+)$")


@dataclass
class StepSummary:
    """One step across ranks; sizes in bytes. ``frag_*`` ignore ranks with nothing free."""

    step: int
    ranks: int
    frag_max: float | None
    frag_median: float | None
    worst_rank: int | None
    largest_free_min: int | None
    free_total_max: int | None
    watch_failures: int
    warnings: int


@dataclass
class MergedRun:
    """Every rank's scans merged by step, plus per-rank counts and source errors."""

    directory: str
    ranks: list[int]
    steps: list[StepSummary]
    records_per_rank: dict[int, int]
    source_errors: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["records_per_rank"] = {str(k): v for k, v in self.records_per_rank.items()}
        return out


def find_scan_logs(directory: str | Path) -> dict[int | None, list[Path]]:
    """``rank -> [scan logs]``: ``rank_N/scan*.jsonl``, and top-level ``scan*.jsonl`` (rank None)."""
    root = Path(directory)
    if not root.is_dir():
        raise InputError("not a directory", source=str(root))
    found: dict[int | None, list[Path]] = {}
    for sub in sorted(root.iterdir()):
        match = _RANK_DIR.match(sub.name)
        if match and sub.is_dir():
            logs = sorted(sub.glob("scan*.jsonl"))
            if logs:
                found[int(match.group(1))] = logs
    top = sorted(root.glob("scan*.jsonl"))
    if top:
        found[None] = top
    return found


def merge_ranks(directory: str | Path) -> MergedRun:
    """Read every rank's scan log under ``directory`` and summarise each step across ranks.

    Raises:
        InputError: no scan logs, or a malformed line (names file and line).
    """
    logs = find_scan_logs(directory)
    if not logs:
        raise InputError("no scan logs (expected rank_N/scan.jsonl)", source=str(directory))
    by_step: dict[int, dict[int, dict]] = {}
    counts: dict[int, int] = {}
    errors: list[dict] = []
    for dir_rank, paths in logs.items():
        for path in paths:
            for rec in read_scan_log(path, kinds=("scan", "source_error")):
                rank = rec.get("rank", dir_rank) if dir_rank is None else dir_rank
                rank = int(rank or 0)
                if rec.get("kind") == "source_error":
                    errors.append(dict(rec, rank=rank))
                    continue
                step = rec.get("step")
                if not isinstance(step, int):
                    raise InputError("a scan record without an integer 'step'", source=str(path))
                by_step.setdefault(step, {})[rank] = rec     # a later record of the same step wins
                counts[rank] = counts.get(rank, 0) + 1
    steps = []
    for step in sorted(by_step):
        recs = by_step[step]
        frags = {rank: rec["frag_ratio"] for rank, rec in recs.items() if rec.get("frag_ratio") is not None}
        worst = max(frags, key=lambda r: (frags[r], -r)) if frags else None
        largest = [rec["largest_free"] for rec in recs.values() if rec.get("largest_free") is not None]
        free = [rec["free_total"] for rec in recs.values() if rec.get("free_total") is not None]
        steps.append(StepSummary(
            step=step, ranks=len(recs),
            frag_max=frags[worst] if worst is not None else None,
            frag_median=statistics.median(frags.values()) if frags else None,
            worst_rank=worst,
            largest_free_min=min(largest) if largest else None,
            free_total_max=max(free) if free else None,
            watch_failures=sum(1 for rec in recs.values()
                               for w in (rec.get("watch") or {}).values() if not w.get("fits", True)),
            warnings=sum(len(rec.get("warnings") or ()) for rec in recs.values())))
    return MergedRun(directory=str(directory), ranks=sorted(counts), steps=steps,
                     records_per_rank=dict(sorted(counts.items())), source_errors=errors)

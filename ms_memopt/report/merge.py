"""Merge the per-rank scan logs of a run: per step, the worst and the median frag ratio.

A run's log directory holds ``rank_N/scan*.jsonl`` (one per rank, written by
:class:`ms_memopt.analysis.scan.ScanLog`); a lone ``scan*.jsonl`` at the top counts as the rank its
records name. Framework-free.

Every record is checked once, when read (:func:`read_scan_records`): a field of the wrong type
(a ``rank`` that is not a non-negative integer, a ``frag_ratio`` or size that is not a finite
number >= 0, a ``watch`` that is not a mapping of name to ``{"fits": bool, ...}``) is an
:class:`~ms_memopt.core.errors.InputError` naming the file and line, like a line that is not JSON.
Such a record was not written by :class:`ms_memopt.analysis.scan.ScanLog`, so the log is not trusted.

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

import math
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ms_memopt.core.errors import InputError
from ms_memopt.core.jsontext import read_json_lines
from ms_memopt.core.units import MAX_VALUE

__all__ = ["StepSummary", "MergedRun", "find_scan_logs", "read_scan_records", "check_scan_record",
           "merge_ranks"]

#: numeric fields of scan and compaction records: ``None`` or a finite number >= 0
_NUMBERS = ("free_total", "largest_free", "frag_ratio", "reserved", "allocated", "largest_free_after",
            "largest_free_before", "bytes_moved", "seconds")

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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_scan_record(record: dict, *, source: str, line: int | None = None) -> dict:
    """Check the field types of one scan-log record; returns it unchanged.

    Raises:
        InputError: a field the report reads has the wrong type (names ``source`` and ``line``).

    Example:
        >>> check_scan_record({"kind": "scan", "step": 3, "frag_ratio": 0.5}, source="s.jsonl")["step"]
        3
    """
    def bad(key: str, expected: str) -> InputError:
        return InputError(f"{key!r} must be {expected}, got {record[key]!r:.60}", source=source, line=line)

    kind = record.get("kind", "scan")
    if not isinstance(kind, str):
        raise bad("kind", "a string")
    if record.get("rank") is not None and not (_is_int(record["rank"]) and record["rank"] >= 0):
        raise bad("rank", "an integer >= 0")
    step = record.get("step")
    if kind in ("scan", "compaction") and not _is_int(step):
        if "step" not in record:
            raise InputError(f"a {kind} record without an integer 'step'", source=source, line=line)
        raise bad("step", "an integer")
    if step is not None and not _is_int(step):
        raise bad("step", "an integer")
    for key in _NUMBERS:
        value = record.get(key)
        # an int is checked as an int: math.isfinite overflows past a float's range
        if value is not None and not (_is_int(value) and 0 <= value <= MAX_VALUE or isinstance(value, float)
                                      and math.isfinite(value) and value >= 0):
            raise bad(key, f"a finite number >= 0 (an integer at most {MAX_VALUE} = 2**63 - 1)")
    watch = record.get("watch")
    if watch is not None:
        if not isinstance(watch, dict) or not all(
                isinstance(w, dict) and isinstance(w.get("fits", True), bool) for w in watch.values()):
            raise bad("watch", 'a mapping of name to {"fits": true|false, ...}')
    if record.get("warnings") is not None and not isinstance(record["warnings"], list):
        raise bad("warnings", "a list")
    extra = record.get("extra")
    if extra is not None and (not isinstance(extra, dict)
                              or not isinstance(extra.get("source_description") or "", str)):
        raise bad("extra", 'a mapping whose "source_description" is a string')
    return record


def read_scan_records(path: str | Path) -> list[tuple[int, dict]]:
    """``(line number, record)`` for every record of a scan log, each checked by
    :func:`check_scan_record`; a torn last line (no newline: a writer killed mid-line) is ignored.

    Raises:
        InputError: unreadable file, a line that is not a JSON object, or a record with a field
        of the wrong type (names file and line).
    """
    return [(number, check_scan_record(record, source=str(path), line=number))
            for number, record in read_json_lines(path)]


def merge_ranks(directory: str | Path, *, progress: bool = False) -> MergedRun:
    """Read every rank's scan log under ``directory`` and summarise each step across ranks;
    ``progress``: a bar on stderr over the logs read (a job of many ranks,
    :func:`ms_memopt.core.progress.progress_bar`).

    Raises:
        InputError: no scan logs, or a malformed line or record (names file and line).
    """
    from ms_memopt.core.progress import progress_bar

    logs = find_scan_logs(directory)
    if not logs:
        raise InputError("no scan logs (expected rank_N/scan.jsonl)", source=str(directory))
    by_step: dict[int, dict[int, dict]] = {}
    counts: dict[int, int] = {}
    errors: list[dict] = []
    files = [(dir_rank, path) for dir_rank, paths in logs.items() for path in paths]
    with progress_bar(len(files), "reading scan logs", "log", enabled=progress and len(files) > 1) as bar:
        for dir_rank, path in files:
            bar.update(1)
            for _, rec in read_scan_records(path):
                kind = rec.get("kind", "scan")
                if kind not in ("scan", "source_error"):
                    continue
                rank = (rec.get("rank") or 0) if dir_rank is None else dir_rank
                if kind == "source_error":
                    errors.append(dict(rec, rank=rank))
                    continue
                step = rec["step"]     # checked: an integer
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

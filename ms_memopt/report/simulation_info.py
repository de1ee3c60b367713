"""``simulation.json``: what ``ms-memopt simulate --out DIR`` knows that its logs do not say.

``timeline.jsonl`` holds every rank's samples; which rank the job is judged by, the heading
and the figures simulate printed are decided by the job, not by the samples. simulate writes
them here, and :func:`ms_memopt.report.build.build_report` reads them, so ``simulate --out DIR``
and a later ``ms-memopt report DIR`` write one and the same report: the same heading, the same
rank in ``fragmentation.png`` and ``memory_map.png``, and the printed table's figures.

``policies`` holds, per policy, the figures of simulate's printed table (:data:`COLUMNS` says
what each one is; sizes in bytes): the job's OOM step and the rank it is judged by (its first
failing rank, or the closest call when every rank survives), that rank's own figures, and the
spread of OOM steps over all ranks.

Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> info = SimulationInfo("Simulation of r.yaml: 10 steps, 2 rank streams", "r.yaml", 10, 2, 0,
    ...                       {"rank": 1, "stage": 0, "seed": 99}, "r.yaml, rank 1", {})
    >>> _ = write_simulation_info(d, info)
    >>> read_simulation_info(d).shown["rank"]
    1
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ms_memopt.core.errors import InputError
from ms_memopt.core.jsontext import parse_json

__all__ = ["SIMULATION_INFO", "COLUMNS", "SimulationInfo", "write_simulation_info", "read_simulation_info"]

SIMULATION_INFO = "simulation.json"

#: the printed table's columns (``ms-memopt simulate``) and the report's: name -> what it is
COLUMNS = {
    "seed": "the job seed (--seed, memopt.workload.seed); each rank draws its own stream seed from it",
    "ranks": "rank streams simulated (stages x data-parallel groups; tensor-parallel peers share one)",
    "job_oom": "the step the job dies at: its first rank to run out of memory ('-': every rank survived)",
    "rank": "the rank the job is judged by: the one that kills it, or, when all survive, the closest call "
            "(smallest largest free block); the columns up to 'peak' are that rank's",
    "stage": "that rank's pipeline stage",
    "oom_kind": "fragmentation (the free memory would have held the request in one piece) or capacity",
    "free@oom": "memory free in that rank's pool when its request failed",
    "oom_ranks": "how many of the simulated ranks ran out of memory within the steps",
    "median": "the median OOM step over all simulated ranks (a survivor counts as later than any step; "
              "'-' when fewer than half fail)",
    "lf_min": "the smallest largest-free block that rank saw (at scans, before watched requests, at "
              "compactions and at its OOM)",
    "frag_max": "that rank's worst frag ratio (free_total / largest_free - 1) at the same moments",
    "compactions": "that rank's compactions",
    "peak": "that rank's peak allocated memory",
}


@dataclass
class SimulationInfo:
    """What simulate decided; sizes in bytes. ``shown``: the rank drawn in the figures
    (``rank``, ``stage``, ``seed``: its stream seed). ``policies``: per policy, the printed
    table's figures (keys of :data:`COLUMNS`, plus ``job_oom_step`` and the rank's ``seed``)."""

    title: str
    recipe: str
    steps: int
    ranks: int
    job_seed: int
    shown: dict
    memory_map_title: str
    policies: dict = field(default_factory=dict)
    #: what the best placement of the run's own steps needs, in words (:func:`~ms_memopt.simulation.bound.bound_sentence`)
    bound: str = ""


def write_simulation_info(directory: str | Path, info: SimulationInfo) -> Path:
    """Write ``directory/simulation.json``."""
    path = Path(directory) / SIMULATION_INFO
    path.write_text(json.dumps(asdict(info), indent=1) + "\n", encoding="utf-8")
    return path


def read_simulation_info(directory: str | Path) -> SimulationInfo | None:
    """``directory/simulation.json``, or ``None`` when simulate did not write one.

    Raises:
        InputError: the file is not JSON or lacks a key (names the file and the key).
    """
    path = Path(directory) / SIMULATION_INFO
    if not path.is_file():
        return None
    data = parse_json(path.read_text(encoding="utf-8"), source=str(path))
    if not isinstance(data, dict):
        raise InputError("expected a JSON object (written by ms-memopt simulate --out)", source=str(path))
    keys = list(SimulationInfo.__dataclass_fields__)
    missing = [k for k in keys if k not in data and k not in ("policies", "bound")]
    if missing:
        raise InputError(f"missing key {missing[0]!r} (written by ms-memopt simulate --out)", source=str(path))
    if not isinstance(data.get("shown"), dict) or not isinstance(data.get("policies", {}), dict):
        raise InputError("'shown' and 'policies' must be objects", source=str(path))
    return SimulationInfo(**{k: data[k] for k in keys if k in data})

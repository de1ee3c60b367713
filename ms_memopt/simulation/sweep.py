"""Sweeps: the job simulation over a grid of recipe settings ("how much HBM, or which
micro-batch count, keeps this job alive?").

A grid is given as ``KEY=V1,V2,...`` settings on dotted recipe key paths
(``memopt.device.hbm=64GB,96GB,128GB``, ``parallel_config.micro_batch_num=8,16``); every
combination is a recipe, validated as any recipe is, and simulated as a job
(:mod:`ms_memopt.simulation.job`). All points' rank streams go to one executor run, so every worker stays
busy. :func:`sweep_rows` flattens the results into one row per point and policy (the table
written as CSV and JSON); :func:`ms_memopt.report.plots.plot_sweep` draws the job OOM step per policy
over the grid.

Example:
    >>> grid = parse_settings(["memopt.device.hbm=64GB,96GB", "parallel_config.micro_batch_num=8,16"])
    >>> [dict(p) for p in grid_points(grid)][:2]
    [{'memopt.device.hbm': '64GB', 'parallel_config.micro_batch_num': 8}, {'memopt.device.hbm': '64GB', 'parallel_config.micro_batch_num': 16}]
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ms_memopt.config.recipe import Recipe, recipe_from_dict
from ms_memopt.core.errors import InputError
from ms_memopt.core.lines import open_text
from ms_memopt.simulation.timing import TIMING_KEYS
from ms_memopt.io.yamltext import parse_yaml

__all__ = ["MAX_GRID_POINTS", "SweepPoint", "apply_setting", "grid_points", "parse_settings", "sweep_recipes", "sweep_rows"]


def parse_settings(items: list[str]) -> dict[str, list[Any]]:
    """``["KEY=V1,V2", ...]`` -> ``{KEY: [V1, V2]}``, each value read as a YAML scalar
    (``8`` an integer, ``true`` a boolean, ``64GB`` a string the recipe reader converts).

    Raises:
        InputError: (key ``--set``) no ``=``, an empty key or value, a key given twice, or a
            value that is not a scalar.
    """
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not all(key.split(".")):
            raise InputError(f"expected KEY=V1,V2,... with a dotted recipe key, got {item!r}", key="--set")
        if key in grid:
            raise InputError(f"{key} is set twice; give all its values in one --set {key}=V1,V2", key="--set")
        values = []
        for raw in text.split(","):
            raw = raw.strip()
            if not raw:
                raise InputError(f"{key}: empty value in {text!r}; expected comma-separated values", key="--set")
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError:
                value = raw
            if isinstance(value, (dict, list)) or value is None:
                raise InputError(f"{key}: {raw!r} is not a single value (a number, size, word or true/false)",
                                 key="--set")
            values.append(value)
        grid[key] = values
    return grid


@dataclass(frozen=True)
class SweepPoint:
    """One combination of the grid: ``settings`` (key -> value, in the order given) and its
    validated recipe."""

    settings: tuple[tuple[str, Any], ...]
    recipe: Recipe

    @property
    def label(self) -> str:
        """``hbm=64GB, micro_batch_num=8`` (the last part of each key)."""
        return ", ".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in self.settings)


#: grid points a sweep may have (each is a whole job; checked before any is built)
MAX_GRID_POINTS = 10_000


def grid_points(grid: dict[str, list[Any]]) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination, the first key varying slowest.

    Raises:
        InputError: more than :data:`MAX_GRID_POINTS` combinations (10**6 points ran silently at 1.9 GB).
    """
    keys = list(grid)
    count = 1
    for key in keys:
        count *= max(1, len(grid[key]))
        if count > MAX_GRID_POINTS:
            sizes = " x ".join(str(len(grid[k])) for k in keys)
            raise InputError(f"a grid of {sizes} settings is more than {MAX_GRID_POINTS:,} points; "
                             "sweep fewer values", key="--set")
    return [tuple(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def apply_setting(data: dict, key: str, value: Any, *, source: str = "<recipe>") -> None:
    """Set ``key`` (dotted) in a parsed recipe mapping, creating missing sections.

    Raises:
        InputError: a part of the path holds a value, not a section.
    """
    node = data
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[:depth + 1])
            raise InputError(f"{where} is a value ({child!r}), not a section, so {key} cannot be set",
                             source=source, key=f"--set {key}")
        node = child
    node[parts[-1]] = value


def _has_key(data: dict, key: str) -> bool:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def sweep_recipes(path: str | Path, grid: dict[str, list[Any]]) -> list[SweepPoint]:
    """The validated recipe of every grid point of the recipe file ``path``.

    A key must be one ms-memopt reads: either already in the file, or one whose values change
    the recipe (MindFormers keys we do not use are ignored by the reader, so a misspelt one
    would otherwise sweep nothing).

    Raises:
        InputError: the file's own errors; a bad value (the recipe reader's message, with the key
            path); a key that nothing reads.
    """
    from ms_memopt.config.recipe import load_recipe

    path = Path(path)
    base = load_recipe(path)                     # the file's own errors first
    with open_text(path, expected="a recipe (YAML)") as handle:
        data = parse_yaml(handle.read(), source=str(path)) or {}
    points = []
    for settings in grid_points(grid):
        point = copy.deepcopy(data)
        for key, value in settings:
            apply_setting(point, key, value, source=str(path))
        try:
            recipe = recipe_from_dict(point, source=str(path))
        except InputError as exc:
            shown = ", ".join(f"{k}={v}" for k, v in settings)
            raise InputError(f"with --set {shown}: {exc.message}", source=exc.source, key=exc.key) from None
        points.append(SweepPoint(settings, recipe))
    for key in grid:
        if _has_key(data, key):
            continue
        if all(p.recipe == base for p in points):
            raise InputError(f"{key} is not a key ms-memopt reads (not in {path.name}, and none of its values "
                             f"changes the recipe); expected e.g. memopt.device.hbm or "
                             f"parallel_config.micro_batch_num (docs/recipes.md)", key="--set")
    return points


def sweep_rows(points: list[SweepPoint], results: list[dict]) -> list[dict]:
    """One row per grid point and policy: the settings, then the job's figures
    (``job_oom_step`` empty when every rank survives)."""
    rows = []
    for point, per_policy in zip(points, results):
        for policy, job in per_policy.items():
            dist = job.distribution()
            closest = job.closest
            row = {key: value for key, value in point.settings}
            row.update({"policy": policy, "steps": job.steps, "ranks": dist["ranks"],
                        "job_oom_step": job.job_oom_step,
                        "job_oom_rank": job.first.stream.rank if job.first else None,
                        "job_oom_stage": job.first.stream.stage if job.first else None,
                        "oom_ranks": dist["oom_ranks"], "oom_step_median": dist["oom_step_median"],
                        "largest_free_min": closest.result.largest_free_min if closest else None,
                        "capacity": point.recipe.capacity})
            # the time model's figures (ms_memopt.simulation.timing; empty when no step completed)
            timing = job.timing() or {}
            row.update({key: timing.get(key) for key in TIMING_KEYS})
            rows.append(row)
    return rows

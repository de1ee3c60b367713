"""One schema for recipes and workloads (issue 25): every ``memopt.workload`` key has one
default, written once in :class:`~ms_memopt.config.recipe.WorkloadConfig`; the simulator's
:class:`~ms_memopt.workload.step.WorkloadSpec`, the recipe loader, docs/recipes.md and
``ms-memopt run``'s sequence lengths all follow it."""
from __future__ import annotations

import ast
import copy
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from ms_memopt.workload import step as wl

from ms_memopt.config.recipe import (
    ExtraAllocsConfig,
    ShapeCacheConfig,
    WorkloadConfig,
    recipe_from_dict,
    schema_keys,
    seq_range,
)
from ms_memopt.core.units import parse_size
from ms_memopt.workload.step import RUN_KEYS, StepWorkload, WorkloadSpec, spec_settings
from ms_memopt.simulation.spec import spec_from_recipe
from docs_table import documented_keys

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ms_memopt"
SCHEMA = schema_keys(WorkloadConfig)          # dotted key -> dataclasses.Field
TINY = {"model": {"model_config": {"num_layers": 2, "hidden_size": 64, "num_heads": 4,
                                   "seq_length": 64, "vocab_size": 256}}}


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _spec_fields() -> dict[str, dataclasses.Field]:
    """WorkloadSpec field name -> field, for the fields that are memopt.workload keys."""
    return {f.name: f for f in dataclasses.fields(WorkloadSpec) if "key" in f.metadata}


def _tiny(**workload) -> dict:
    data = copy.deepcopy(TINY)
    data["memopt"] = {"workload": workload}
    return data


# --- (a) one default per key ------------------------------------------------------------------

def test_every_workload_key_is_a_spec_field_or_a_run_key():
    mapped = {f.metadata["key"]: name for name, f in _spec_fields().items()}
    assert set(mapped) <= set(SCHEMA), "a WorkloadSpec field names a key the schema lacks"
    missing = set(SCHEMA) - set(mapped) - set(RUN_KEYS)
    assert not missing, f"memopt.workload keys the simulator's WorkloadSpec does not carry: {sorted(missing)}"
    assert set(RUN_KEYS) <= set(SCHEMA)


def test_spec_defaults_are_the_schema_defaults_field_by_field():
    spec, config = WorkloadSpec(), WorkloadConfig()
    derived = dict(zip(("seq_min", "seq_max"), seq_range(spec.seq_length)))
    for name, f in _spec_fields().items():
        key = f.metadata["key"]
        want = _default(SCHEMA[key])
        if "default" in SCHEMA[key].metadata:        # derived from other keys (seq_length)
            assert want is None
            want = derived[name]
        assert getattr(spec, name) == want, f"WorkloadSpec.{name} defaults to {getattr(spec, name)!r}, " \
                                            f"memopt.workload.{key} to {want!r}"
    # and WorkloadConfig() itself agrees with its field defaults (no __post_init__ rewriting them)
    assert spec_settings(config) == {name: _default(SCHEMA[f.metadata["key"]]) for name, f in _spec_fields().items()}


def test_a_recipe_without_a_workload_section_simulates_the_default_spec():
    recipe = recipe_from_dict(copy.deepcopy(TINY))
    w = recipe.memopt.workload
    assert w == dataclasses.replace(WorkloadConfig(), seq_min=8, seq_max=64)     # 64 // 8 .. 64
    assert (w.seed, w.steps) == (recipe.train.seed, WorkloadConfig().steps)
    built = spec_from_recipe(recipe)
    plain = WorkloadSpec(seq_length=recipe.model.seq_length)
    assert {n: getattr(built, n) for n in _spec_fields()} == {n: getattr(plain, n) for n in _spec_fields()}


def test_every_recipe_value_reaches_the_spec(tmp_path):
    # each key set to a non-default value arrives in the simulator's spec unchanged
    template = tmp_path / "mine.template.json"
    template.write_text("{}")      # the recipe checks the file is there; the engine reads it
    schedule = tmp_path / "steps.csv"
    schedule.write_text("seq\n16\n")
    values = {"template": str(template), "schedule": str(schedule), "enabled": False, "dynamic_seq": True, "seq_distribution": "lognormal", "seq_min": 16,
              "seq_max": 48, "seq_buckets": [32, 48], "seq_align": 8, "long_tail": 0.25, "comm_jitter": 0.4,
              "moe_load_cv": 0.7, "shape_cache": {"bytes_per_shape": 12345, "max_shapes": 9},
              "extra_allocs": {"probability": 0.5, "size": 4096, "lifetime_steps": 3}}
    spec = spec_from_recipe(recipe_from_dict(_tiny(**values)))
    for name, f in _spec_fields().items():
        head, _, leaf = f.metadata["key"].partition(".")
        given = values[head][leaf] if leaf else values[head]
        assert getattr(spec, name) == (tuple(given) if isinstance(given, list) else given), name
        assert getattr(spec, name) != _default(SCHEMA[f.metadata["key"]]), f"{name}: pick a non-default value"


_SCHEMA_CLASSES = {"WorkloadConfig", "ShapeCacheConfig", "ExtraAllocsConfig"}
# the names under which a workload default could be written again: the spec's field names and
# the schema's own (not the generic ones, enabled / seed / steps / size / probability ..., which
# other settings share)
_NAMES = (set(_spec_fields()) | {k.rpartition(".")[2] for k in SCHEMA}) - {
    "enabled", "seed", "steps", "size", "probability", "lifetime_steps"}


def _is_literal(node: ast.AST | None) -> bool:
    """A value written out (``0.2``, ``64 * 2**20``, ``()``, ``"uniform"``), not read from somewhere."""
    allowed = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.Tuple, ast.List, ast.operator, ast.unaryop, ast.Load)
    return node is not None and all(isinstance(n, allowed) for n in ast.walk(node))


def _field_default(node: ast.AST | None) -> ast.AST | None:
    """The default of ``x: T = <node>``: the node, or ``field(default=...)``'s."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "field":
        return next((k.value for k in node.keywords if k.arg == "default"), None)
    return node


def test_no_workload_default_is_written_a_second_time_in_the_package():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(ROOT)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if path.name == "recipe.py" and cls.name in _SCHEMA_CLASSES:
                continue                                 # the one place
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                        and stmt.target.id in _NAMES and _is_literal(_field_default(stmt.value)):
                    found.append(f"{where}:{stmt.lineno} {cls.name}.{stmt.target.id} = {ast.unparse(stmt.value)}")
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            args = fn.args.args + fn.args.kwonlyargs
            defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + fn.args.defaults + fn.args.kw_defaults
            for arg, default in zip(args, defaults):
                is_none = isinstance(default, ast.Constant) and default.value is None     # "not given"
                if arg.arg in _NAMES and _is_literal(default) and not is_none:
                    found.append(f"{where}:{fn.lineno} {fn.name}({arg.arg}={ast.unparse(default)})")
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            for kw in call.keywords:
                if kw.arg in _NAMES and _is_literal(kw.value):
                    found.append(f"{where}:{call.lineno} {ast.unparse(call.func)}({kw.arg}={ast.unparse(kw.value)})")
    assert not found, "workload defaults written outside recipe.WorkloadConfig:\n" + "\n".join(found)


def test_the_loader_takes_every_workload_default_from_the_schema():
    # recipe._read_workload: no r.get(..., default) with a written-out default
    tree = ast.parse((PACKAGE / "config" / "recipe.py").read_text(encoding="utf-8"))
    reader = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_read_workload")
    literal = [ast.unparse(c) for c in ast.walk(reader) if isinstance(c, ast.Call)
               and getattr(c.func, "attr", None) == "get" and len(c.args) >= 5 and _is_literal(c.args[4])]
    assert not literal, literal
    # and the section's key sets are the dataclasses' fields
    from ms_memopt.config import recipe
    assert recipe._WORKLOAD_KEYS == {f.name for f in dataclasses.fields(WorkloadConfig)}
    assert recipe._SHAPE_CACHE_KEYS == {f.name for f in dataclasses.fields(ShapeCacheConfig)}
    assert recipe._EXTRA_KEYS == {f.name for f in dataclasses.fields(ExtraAllocsConfig)}


# --- (b) docs/recipes.md's table is the schema ----------------------------------------------

def _documented_value(cell: str):
    """A default cell as a value: true/false, none (...), `[]`, `text`, 10 MiB, 0.2, 1000."""
    if cell in ("true", "false"):
        return cell == "true"
    if cell == "none" or cell.startswith("none "):
        return None
    if cell == "`[]`":
        return ()
    if re.fullmatch(r"`[^`]+`", cell):
        return cell.strip("`")
    if re.fullmatch(r"\d+(\.\d+)? [KMGT]i?B", cell):
        return parse_size(cell.replace(" ", ""))
    if re.fullmatch(r"-?\d+", cell):
        return int(cell)
    if re.fullmatch(r"-?\d+\.\d+(e-?\d+)?", cell):
        return float(cell)
    raise AssertionError(f"cannot read the documented default {cell!r}")


def test_docs_table_lists_exactly_the_workload_keys_with_their_defaults():
    documented = documented_keys("workload")
    assert set(documented) == set(SCHEMA), (
        f"undocumented: {sorted(set(SCHEMA) - set(documented))}; "
        f"documented but not keys: {sorted(set(documented) - set(SCHEMA))}")
    for key, f in SCHEMA.items():
        cell = documented[key]
        if "default" in f.metadata:                 # derived: the docs state the rule
            assert cell == f"`{f.metadata['default']}`", f"workload.{key}: docs say {cell}"
            continue
        value, want = _documented_value(cell), _default(f)
        assert value == want, f"workload.{key}: docs say {cell}, the schema {want!r}"
        assert type(value) is type(want) or want is None, f"workload.{key}: {cell} is not a {type(want).__name__}"


def test_docs_table_has_no_allocator_align():
    text = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    assert "| `allocator.align`" not in text


# --- (c) run and the simulator draw the same lengths ----------------------------------------

RULES = [
    dict(dynamic_seq=True, seq_distribution="lognormal", seq_min=8, seq_max=64, seq_align=4, long_tail=0.3),
    dict(dynamic_seq=True, seq_distribution="uniform", seq_min=9, seq_max=62, seq_align=4),
    dict(dynamic_seq=True, seq_distribution="uniform", seq_min=8, seq_max=64, seq_buckets=[16, 32, 48]),
    dict(dynamic_seq=True, seq_distribution="fixed", seq_max=40, seq_align=16),
    dict(dynamic_seq=True, enabled=False),
]


def _simulated_lengths(recipe, steps: int) -> list[int]:
    """The lengths the simulator gives each step of a one-micro-batch stage (one draw per step)."""
    spec = spec_from_recipe(recipe)
    assert spec.micro_batches == 1
    gen = StepWorkload(spec, seed=recipe.memopt.workload.seed)
    gen.prologue_rows()
    out = []
    for step in range(1, steps + 1):
        gen.step_rows(step)
        out.extend(gen.lengths)
    return out


@pytest.mark.parametrize("rules", RULES, ids=lambda r: r.get("seq_distribution", "off"))
@pytest.mark.parametrize("seed", [0, 7])
def test_run_and_simulator_draw_the_same_lengths(rules, seed):
    recipe = recipe_from_dict(_tiny(seed=seed, **rules))
    simulated = _simulated_lengths(recipe, 40)
    run = wl.sequence_lengths(recipe.memopt.workload, 40, recipe.model.seq_length)
    assert (run or [recipe.model.seq_length] * 40) == simulated
    w = recipe.memopt.workload
    for n in simulated:
        if w.enabled and w.seq_buckets:
            assert n in w.seq_buckets
        elif w.enabled:
            assert w.seq_min <= n <= w.seq_max and n % w.seq_align == 0
    if rules.get("seq_distribution") in ("lognormal", "uniform"):
        assert len(set(simulated)) >= 3


def test_standalone_run_uses_the_shared_rule():
    pytest.importorskip("mindspore")
    from ms_memopt.mindspore import standalone

    for rules in RULES:
        recipe = recipe_from_dict(_tiny(**rules))
        assert standalone.sequence_lengths(recipe, 25, 64) == wl.sequence_lengths(recipe.memopt.workload, 25, 64)
    # the shipped demo: 8..32 tokens in multiples of 4, the simulator's draws
    from ms_memopt.config.recipe import load_recipe

    demo = load_recipe(ROOT / "recipes" / "demo_cpu.yaml")
    lengths = standalone.sequence_lengths(demo, 30, demo.model.seq_length)
    rng = np.random.default_rng(demo.memopt.workload.seed)
    assert lengths == [wl.draw_sequence_length(rng, demo.memopt.workload, demo.model.seq_length) for _ in range(30)]
    assert all(8 <= n <= 32 and n % 4 == 0 for n in lengths)


def test_the_100b_recipe_draws_as_before():
    # the simulator's rule is unchanged: rounding down, long_tail uniform; the study's stream
    recipe_path = ROOT / "recipes" / "dense_100b_1024x910c.yaml"
    from ms_memopt.config.recipe import load_recipe

    spec = spec_from_recipe(load_recipe(recipe_path))
    rng = np.random.default_rng(0)
    got = [wl.draw_sequence_length(rng, spec, spec.seq_length) for _ in range(6)]
    rng = np.random.default_rng(0)
    old = []
    for _ in range(6):       # the simulator's rule before issue 25, written out
        if rng.random() < spec.long_tail:
            length = rng.uniform(spec.seq_min, spec.seq_max)
        else:
            length = spec.seq_max - rng.lognormal(np.log(spec.seq_max / 32), 1.0)
        length = int(min(max(length, spec.seq_min), spec.seq_max))
        old.append(max(spec.seq_align, length // spec.seq_align * spec.seq_align))
    assert got == old


def test_event_rows_have_one_definition():
    """A row is a tuple of Event's fields in Event's order, defined once (events.FIELDS): the
    workload's rows rebuild their events, the compiled loop takes its indices from Event at
    import, and no module spells the field order out a second time."""
    import dataclasses
    import re

    from ms_memopt.core.events import FIELDS, ROW_INDEX, Event
    from ms_memopt.workload.step import StepWorkload, WorkloadSpec

    assert FIELDS == tuple(f.name for f in dataclasses.fields(Event))
    assert ROW_INDEX == {name: i for i, name in enumerate(FIELDS)}
    rows_of, events_of = StepWorkload(WorkloadSpec(), seed=0), StepWorkload(WorkloadSpec(), seed=0)
    rows = rows_of.prologue_rows() + rows_of.step_rows(1)
    assert rows and all(len(row) == len(FIELDS) for row in rows)
    assert [Event(*row) for row in rows] == events_of.prologue() + events_of.step(1)
    spelled = re.compile(r'\s*,\s*'.join(f'"{name}"' for name in FIELDS))     # the whole order, by hand
    package = Path(__file__).resolve().parents[1] / "ms_memopt"
    copies = [p for p in package.rglob("*.py") if spelled.search(p.read_text())]
    assert copies == [], f"Event's field order spelled out again in {copies}"

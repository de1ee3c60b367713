"""Bounds on input: what readers refuse beyond any real job, and the messages that say so.

Complements tests/test_reliability.py (which fuzzes every reader): each fix there has its
pinned test; these check the messages and the edges of the bounds themselves.
"""
from __future__ import annotations

import json
import pickle
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ms_memopt.analysis.estimate import estimate
from ms_memopt.config.recipe import LIMITS, recipe_from_dict
from ms_memopt.core.errors import InputError
from ms_memopt.core.jsontext import parse_json
from ms_memopt.core.units import MAX_VALUE, parse_count, parse_size


def _tiny(**model) -> dict:
    config = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "seq_length": 32, "vocab_size": 256}
    config.update(model)
    return {"model": {"model_config": config}, "memopt": {"device": {"hbm": "1MB"}}}


# --- JSON ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, words", [
    ("[" * 100_000, "nested too deeply"),
    ('{"size": ' + "9" * 5000 + "}", "digits"),
    ('{"time": NaN}', "NaN is not a JSON number"),
    ('{"time": -Infinity}', "-Infinity is not a JSON number"),
    ('{"a": 1', "not a JSON value"),
])
def test_parse_json_refuses_with_file_and_line(text, words):
    with pytest.raises(InputError) as info:
        parse_json(text, source="t.jsonl", line=7)
    assert str(info.value).startswith("t.jsonl:7: ") and words in str(info.value), str(info.value)


@pytest.mark.parametrize("time_text", ["NaN", "Infinity", "1e400"])
def test_jsonl_time_must_be_finite(tmp_path, time_text):
    from ms_memopt.core.events import read_jsonl

    path = tmp_path / "t.jsonl"
    path.write_text('{"format": "ms-memopt-events", "version": 1}\n'
                    '{"action": "alloc", "id": 1, "size": 8, "time": ' + time_text + "}\n")
    with pytest.raises(InputError, match=r"t\.jsonl:2: "):
        read_jsonl(path)


def test_scan_log_kind_must_be_a_string(tmp_path):
    from ms_memopt.analysis.scan import read_scan_log

    path = tmp_path / "scan.jsonl"
    path.write_text(json.dumps({"kind": "scan", "step": 1}) + "\n" + json.dumps({"kind": {"a": 1}}) + "\n")
    with pytest.raises(InputError, match=r"scan\.jsonl:2: 'kind' must be a string"):
        read_scan_log(path)


# --- units -----------------------------------------------------------------------------------

def test_size_and_count_bound_is_int64():
    assert parse_size(MAX_VALUE) == MAX_VALUE
    assert parse_count(str(2**62)) == 2**62
    for bad in (MAX_VALUE + 1, 10**400, "1e300TB", "9.3e18B", "10000000TiB"):
        with pytest.raises(InputError, match="too large; expected at most 9223372036854775807"):
            parse_size(bad, source="--capacity")
    with pytest.raises(InputError, match="too large"):
        parse_count("1e300T")


@given(st.integers(min_value=0, max_value=2**70))
def test_integer_sizes_are_exact_or_refused(value):
    if value <= MAX_VALUE:
        assert parse_size(value) == value
    else:
        with pytest.raises(InputError):
            parse_size(value)


def test_units_messages_read_well():
    with pytest.raises(InputError) as info:
        parse_size("1e400", key="memopt.workspace")
    assert "expected a finite size, got '1e400'" in str(info.value)
    with pytest.raises(InputError) as info:
        parse_count(-5)
    assert "expected a non-negative count" in str(info.value)
    with pytest.raises(InputError) as info:
        parse_size(-(10**5000))            # repr of such an int would itself raise
    assert "an integer of about -2**" in str(info.value)


def test_positive_sizes():
    assert parse_size("1B", positive=True) == 1
    with pytest.raises(InputError, match="expected a positive size, got '0'"):
        parse_size("0", source="--capacity", positive=True)


@pytest.mark.parametrize("command", ["plan", "pack"])
def test_zero_capacity_exits_2(tmp_path, command, capsys):
    from ms_memopt.cli import main

    if command == "plan":
        import yaml

        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump(_tiny()))
    else:
        path = tmp_path / "i.csv"
        path.write_text("id,lower,upper,size\na,0,2,8\n")
    assert main([command, str(path), "--capacity", "0"]) == 2
    assert "--capacity: expected a positive size" in capsys.readouterr().err


# --- recipes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["num_layers", "hidden_size", "seq_length", "vocab_size"])
def test_recipe_shape_limits(key):
    data = _tiny(**{key: LIMITS[key] + 1})
    with pytest.raises(InputError) as info:
        recipe_from_dict(data, source="r.yaml")
    assert str(info.value).startswith(f"r.yaml: model.model_config.{key}: got {LIMITS[key] + 1}; "
                                      f"expected at most {LIMITS[key]}"), str(info.value)


def test_micro_batch_limit():
    data = _tiny()
    data["parallel_config"] = {"micro_batch_num": LIMITS["micro_batch_num"] + 1}
    with pytest.raises(InputError, match="parallel_config.micro_batch_num: .*at most 100000"):
        recipe_from_dict(data)


@pytest.mark.parametrize("where, value", [
    ("memopt.seed", 10**30), ("memopt.activation_factor", 10**400), ("memopt.activation_factor", 1e300),
    ("model.model_config.ffn_dim_multiplier", 1e300), ("memopt.compact_when_frag_above", 10**400),
])
def test_huge_numbers_are_input_errors(where, value):
    data = _tiny()
    node = data
    *parents, key = where.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[key] = value
    with pytest.raises(InputError):
        recipe_from_dict(data)


def test_plan_cost_does_not_grow_with_layers():
    """The deepest recipe allowed, with a capacity nothing fits: the whole checkpoint search."""
    started = time.perf_counter()
    result = estimate(recipe_from_dict(_tiny(num_layers=LIMITS["num_layers"])))
    assert result.checkpoint_every is None
    # needs ~0.07 s; the bound catches a search that grows with the layer count, not speed
    assert time.perf_counter() - started < 10.0


# --- snapshots and instances -----------------------------------------------------------------

def test_snapshot_sharing_block_lists_is_refused_quickly(tmp_path):
    from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot

    blocks = [{"size": 512, "state": "inactive"}] * 300
    segments = [{"address": i * 300 * 512, "total_size": 300 * 512, "blocks": blocks} for i in range(300)]
    path = tmp_path / "shared.pickle"
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [[]]}, protocol=4))
    with pytest.raises(InputError, match="90000 blocks in a .*-byte file"):
        read_torch_snapshot(path)


@pytest.mark.parametrize("row, words", [
    ("a,0,3,4611686018427387905", "size 4611686018427387905 is out of range"),
    ("a,-4611686018427387905,3,8", "lower -4611686018427387905 is out of range"),
    ("a,0,3,4611686018427387904\nb,0,3,4611686018427387904", "add up to more than 2**63 - 1"),
])
def test_instance_values_within_int64(tmp_path, row, words):
    from ms_memopt.io.traces.instances import read_instance

    path = tmp_path / "i.csv"
    path.write_text(f"id,lower,upper,size\n{row}\n")
    with pytest.raises(InputError) as info:
        read_instance(path)
    assert str(path) in str(info.value) and words in str(info.value), str(info.value)


@pytest.mark.parametrize("where", ["address", "size", "state"])
def test_snapshot_integers_of_thousands_of_digits(tmp_path, where):
    """Pickles hold integers of any length; messages must not ``repr`` them (4300-digit limit)."""
    from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot

    block = {"address": 0, "size": 512, "state": "inactive"}
    block[where] = -(10**5000) if where == "address" else 10**5000
    snapshot = {"segments": [{"address": 0, "total_size": 512, "blocks": [block]}], "device_traces": [[]]}
    path = tmp_path / "long.pickle"
    path.write_bytes(pickle.dumps(snapshot, protocol=4))
    with pytest.raises(InputError, match=r"an integer of about -?2\*\*16609"):
        read_torch_snapshot(path)


def test_jsonl_time_beyond_float_range(tmp_path):
    from ms_memopt.core.events import read_jsonl

    path = tmp_path / "t.jsonl"
    path.write_text('{"format": "ms-memopt-events", "version": 1}\n'
                    '{"action": "alloc", "id": 1, "size": 8, "time": 1' + "0" * 400 + "}\n")
    with pytest.raises(InputError, match=r"t\.jsonl:2: 'time' must be a finite number"):
        read_jsonl(path)

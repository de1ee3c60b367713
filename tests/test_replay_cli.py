"""``ms-memopt replay``: output fields, exit codes, bad input (each exits 2 with a clear message)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ms_memopt.cli import main

DATA = Path(__file__).resolve().parent / "data"
REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
REQUIRED_FIELDS = {"events", "allocs", "peak_allocated", "peak_reserved", "final_reserved", "final_allocated",
                   "segment_allocs", "ooms", "free_total_end", "largest_free_end", "frag_ratio_end",
                   "frag_ratio_max", "address_match", "events_per_s"}


# The replay command is driven with the real MindSpore pool model (the default for these traces).
MODEL = "mindspore"


def _run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_has_every_field(capsys):
    code, out, _ = _run(["replay", str(DATA / "memory_block_2.10.csv"), "--allocator", MODEL, "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert REQUIRED_FIELDS <= set(result)
    assert result["events"] == 13 and result["allocs"] == 8
    # 2 weights (4 MiB each) + 1 MiB + 2 KiB + 512 KiB + 8 MiB SOMAS block live at t=12..14
    assert result["peak_allocated"] == 8 * 2**20 + 2**20 + 512 * 2**10 + 8 * 2**20
    assert result["allocator"] == "mindspore" and result["segment_allocs"] >= 1
    assert 0.0 <= result["address_match"] <= 1.0
    assert result["format"] == "mindspore-memory-block"


def test_human_output_uses_units(capsys):
    code, out, _ = _run(["replay", str(DATA / "memory_block_2.10.csv"), "--allocator", MODEL], capsys)
    assert code == 0
    assert "peak allocated   17.50 MiB" in out
    assert "OOMs             0" in out


def test_fail_on_oom(capsys):
    argv = ["replay", str(DATA / "memory_block_2.10.csv"), "--allocator", MODEL, "--capacity", "10MiB"]
    code, out, _ = _run(argv + ["--json"], capsys)
    assert code == 0 and json.loads(out)["oom_count"] > 0
    code, out, _ = _run(argv + ["--fail-on-oom"], capsys)
    assert code == 1
    assert "capacity" in out or "fragmentation" in out


def test_default_allocator_is_mindspore_for_csv(capsys):
    code, out, _ = _run(["replay", str(DATA / "memory_block_2.10.csv"), "--json"], capsys)
    assert code == 0
    from ms_memopt.allocators import create

    assert json.loads(out)["allocator"] == create("mindspore").name


@pytest.mark.parametrize("model", ["mindspore", "torch"])
def test_real_models_on_samples(model, capsys):
    for name in ("memory_block_2.10.csv", "events.jsonl"):
        code, out, _ = _run(["replay", str(DATA / name), "--allocator", model, "--json"], capsys)
        assert code == 0
        result = json.loads(out)
        assert result["allocs"] > 0 and result["peak_reserved"] >= result["peak_allocated"]


def test_msmemscope_shared_trace(capsys):
    path = SHARED / "traces" / "msmemscope" / "baseline.csv"
    if not path.exists():
        pytest.skip(f"shared data not present: {path}")
    code, out, _ = _run(["replay", str(path), "--allocator", "torch", "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert result["allocs"] == 19
    assert result["address_match"] == 1.0  # the torch model puts every tensor where torch_npu did


# --- bad input: exit 2 and a message naming the problem ---------------------------------
def _bad(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("name, content, expected", [
    ("empty.csv", b"", "empty file"),
    ("garbage.bin", bytes(range(256)) * 8, "binary"),
    ("unknown.csv", b"foo,bar,baz\n1,2,3\n", "unknown trace format"),
    ("wrong_columns.csv", b"start_time_stamp,end_time_stamp,size,\n1,2,512,\n", "unknown trace format"),
    ("truncated.csv",
     (DATA / "memory_block_2.10.csv").read_bytes()[:-60],
     "truncated row"),
    ("bad_time.csv", b"start_time_stamp,end_time_stamp,device_addr,size,\nabc,2,0x10,512,\n", "start_time_stamp"),
    ("bad_size.csv", b"start_time_stamp,end_time_stamp,device_addr,size,\n1,2,0x10,12KB,\n", "size: expected an integer"),
    ("bad_addr.csv", b"start_time_stamp,end_time_stamp,device_addr,size,\n1,2,0xZZ,512,\n", "device_addr"),
    ("hostile.pickle", b"\x80\x04\x95\x1e\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93\x94"
                       b"\x8c\x04true\x94\x85\x94R\x94.", "hostile.pickle"),
])
def test_bad_trace_exits_2(tmp_path, capsys, name, content, expected):
    path = _bad(tmp_path, name, content)
    code, out, err = _run(["replay", str(path), "--allocator", MODEL], capsys)
    assert code == 2, (out, err)
    assert expected in err and str(path) in err
    assert "Traceback" not in err


def test_hostile_pickle_is_not_executed(tmp_path, capsys):
    marker = tmp_path / "pwned"
    payload = (b"\x80\x04cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.")
    path = _bad(tmp_path, "snapshot.pickle", payload)
    code, _, err = _run(["replay", str(path), "--allocator", MODEL], capsys)
    assert code == 2 and not marker.exists()


@pytest.mark.parametrize("capacity", ["4.2 parsecs", "12XB", "-1GB", "0"])
def test_bad_capacity_exits_2(capsys, capacity):
    code, _, err = _run(["replay", str(DATA / "memory_block_2.10.csv"), "--allocator", MODEL,
                         f"--capacity={capacity}"], capsys)
    assert code == 2 and "--capacity" in err


def test_unknown_allocator_exits_2(capsys):
    code, _, err = _run(["replay", str(DATA / "memory_block_2.10.csv"), "--allocator", "nope"], capsys)
    assert code == 2 and "--allocator" in err and "nope" in err


def test_missing_file_exits_2(tmp_path, capsys):
    code, _, err = _run(["replay", str(tmp_path / "absent.csv"), "--allocator", MODEL], capsys)
    assert code == 2 and "absent.csv" in err


def test_console_exit_code_and_message(tmp_path):
    """The real entry point (a subprocess) maps bad input to exit 2 with a one-line message."""
    path = _bad(tmp_path, "empty.csv", b"")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "ms_memopt", "replay", str(path)], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert "empty file" in proc.stderr and "Traceback" not in proc.stderr


def test_empty_trace_replays(tmp_path, capsys):
    header = ("start_time_stamp,end_time_stamp,device_addr,stream_id,pool_type,size,actual_used_memory,"
              "actual_peak_memory,file_name,line_num,type,producer_task,task_name,node_name,graph_name,"
              "user_tasks,last_user_task,python_stack,is_persistent,is_small,\n")
    path = _bad(tmp_path, "memory_block.csv", header.encode())
    code, out, _ = _run(["replay", str(path), "--allocator", MODEL, "--json"], capsys)
    result = json.loads(out)  # strict JSON: no Infinity even with nothing timed
    assert code == 0 and result["events"] == 0 and result["events_per_s"] in (None, 0.0)


def test_first_oom_is_described(capsys):
    code, out, _ = _run(["replay", str(DATA / "memory_block_2.10.csv"), "--allocator", MODEL,
                         "--capacity", "10MiB"], capsys)
    assert code == 0 and "first OOM" in out and "at event" in out


def test_export_memory_viz(tmp_path, capsys):
    target = tmp_path / "viz.pickle"
    code, _, err = _run(["replay", str(DATA / "memory_block_2.10.csv"), "--export-memory-viz", str(target)], capsys)
    assert code == 0, err
    assert target.stat().st_size > 0


def test_model_that_cannot_restore_exits_2(capsys, monkeypatch):
    from ms_memopt.allocators.base import AllocatorModel
    from ms_memopt.allocators.mindspore import MindSporePool
    from ms_memopt.core.events import Trace
    from ms_memopt.core.layout import Layout

    # the real pool model with the base class's restore, which refuses a recorded starting state
    monkeypatch.setattr(MindSporePool, "restore", AllocatorModel.restore)
    monkeypatch.setattr("ms_memopt.allocators.fast.AVAILABLE", False)   # the reference class, not its C twin
    monkeypatch.setattr("ms_memopt.io.traces.load_trace",
                        lambda path, format=None: Trace([], source=str(path), format="torch-snapshot",
                                                        initial=Layout([])))
    code, _, err = _run(["replay", "snapshot.pickle", "--allocator", MODEL], capsys)
    assert code == 2 and "cannot start from a recorded state" in err and "--allocator" in err

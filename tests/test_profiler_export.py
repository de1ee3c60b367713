"""``replay TRACE --export-profiler DIR`` (issue 44 item 4): the run as the model placed it, written as
torch_npu's profiler output of one rank. Checked against the rules msprof-analyze's ``compare`` applies
when it reads a rank folder (restated here; docs/verified.md has the real run), read back by our own
reader to the byte, and against the real tool when a scratch install is there (``MSPROF_ANALYZE``,
default ``/tmp/msa/bin/msprof-analyze``)."""
from __future__ import annotations

import csv
import json
import os
import re
import sqlite3
import subprocess
from pathlib import Path

import pytest

from ms_memopt.cli import main
from ms_memopt.core.events import Event
from ms_memopt.io.traces.ascend_profiler import read_ascend_profiler
from ms_memopt.io.traces.ascend_profiler.writer import write_profiler_output

T0 = 1736408883694624810        # ns
MiB = 1 << 20


def _recording(tmp_path: Path) -> Path:
    """A torch_npu capture of two steps: weights held, activations freed, one tensor live at the end."""
    events, t = [], T0
    for step in range(2):
        for k in range(6):
            ident = 10 * step + k
            events.append(Event("alloc", id=ident, size=(k + 1) * MiB + 512, time=t, tag=f"aten::op{k % 3}"))
            t += 3000
        for k in range(6 if step == 0 else 5):
            events.append(Event("free", id=10 * step + k, time=t))
            t += 2000
    return write_profiler_output(tmp_path / "in", events, initial={900: 64 * MiB},
                                 steps=[(1, T0, T0 + 30_000), (2, T0 + 30_000, t)])


def _export(tmp_path: Path, capsys, *extra: str) -> tuple[Path, dict]:
    out = tmp_path / "export"
    assert main(["replay", str(_recording(tmp_path)), "--json", "--export-profiler", str(out), *extra]) == 0
    result = json.loads(capsys.readouterr().out)
    return out / "rank0_ascend_pt", result


# ------------------------------------------------------------ msprof-analyze's reading of a rank folder

def _compare_finds(folder: Path) -> dict:
    """What ``compare`` takes from a profiling path (its ``parse_profiling_path``, restated): a
    ``profiler_info_N.json`` in the folder; in ``ASCEND_PROFILER_OUTPUT/`` (else the folder) a file
    named ``ascend_pytorch_profiler*.db`` first, else ``trace_view.json`` or the folder is refused."""
    info = [p.name for p in folder.iterdir() if re.fullmatch(r"profiler_info_[0-9]+\.json", p.name)]
    output = folder / "ASCEND_PROFILER_OUTPUT"
    output = output if output.is_dir() else folder
    dbs = [p for p in output.iterdir() if p.name.startswith("ascend_pytorch_profiler") and p.suffix == ".db"]
    if dbs:
        return {"info": info, "db": dbs[0]}
    assert (output / "trace_view.json").is_file(), "compare refuses a folder with neither a db nor trace_view.json"
    return {"info": info, "trace": output / "trace_view.json", "output": output}


def _spans_of(ops: list[tuple[str, float, float]], times: list[float]) -> list[str | None]:
    """The operator ``compare``'s tree charges each allocation to: the innermost op whose span
    ``[start, end]`` holds its time (None: the root, no operator)."""
    out = []
    for at in times:
        inside = [(end - start, name) for name, start, end in ops if start <= at <= end]
        out.append(min(inside)[1] if inside else None)
    return out


def test_export_is_a_rank_folder_compare_reads_from_its_db(tmp_path, capsys):
    folder, result = _export(tmp_path, capsys)
    found = _compare_finds(folder)
    assert found["info"] == ["profiler_info_0.json"] and found["db"].name == "ascend_pytorch_profiler_0.db"
    db = sqlite3.connect(f"file:{found['db']}?immutable=1", uri=True)
    # the memory query: OP_MEMORY's names through STRING_IDS, ordered by release time
    memory = db.execute("SELECT STRING_IDS.value, OP_MEMORY.size, OP_MEMORY.allocationTime, OP_MEMORY.releaseTime, "
                        "OP_MEMORY.duration FROM OP_MEMORY LEFT JOIN STRING_IDS ON OP_MEMORY.name == STRING_IDS.id "
                        "ORDER BY OP_MEMORY.releaseTime").fetchall()
    assert len(memory) == 12 and all(name and name.startswith("aten::op") for name, *_ in memory)
    assert all(rt is None or rt - at == duration for _, _, at, rt, duration in memory)
    # the operators: PYTORCH_API of type 'op' joined with CONNECTION_IDS and STRING_IDS (tables that must exist)
    ops = db.execute("SELECT PYTORCH_API.startNs, PYTORCH_API.endNs, STRING_IDS.value FROM PYTORCH_API "
                     "LEFT JOIN CONNECTION_IDS ON PYTORCH_API.connectionId=CONNECTION_IDS.id "
                     "LEFT JOIN STRING_IDS ON PYTORCH_API.name=STRING_IDS.id "
                     "LEFT JOIN STRING_IDS AS SHAPES ON PYTORCH_API.inputShapes=SHAPES.id "
                     "LEFT JOIN ENUM_API_TYPE ON PYTORCH_API.type=ENUM_API_TYPE.id WHERE ENUM_API_TYPE.name=?",
                     ("op",)).fetchall()
    spans = [(name, int(start), int(end)) for start, end, name in ops if not name.startswith("ProfilerStep#")]
    assert all(_spans_of(spans, [at for _, _, at, _, _ in memory]))       # every tensor charged to an operator
    assert db.execute("SELECT id FROM STEP_TIME").fetchall() == [(1,), (2,)]
    assert db.execute("SELECT count(*) FROM TASK").fetchone() == (0,)      # there, empty: no device task modelled
    # and our reader reads the db back to the byte: the model's totals, its peak reserved
    trace = read_ascend_profiler(found["db"])
    assert trace.meta["recorded"]["allocated_max_diff"] == 0
    assert trace.meta["recorded"]["peak_reserved"] == result["peak_reserved"]


def test_export_text_is_what_compare_reads_without_the_db(tmp_path, capsys):
    folder, result = _export(tmp_path, capsys)
    (folder / "ASCEND_PROFILER_OUTPUT" / "ascend_pytorch_profiler_0.db").unlink()
    found = _compare_finds(folder)
    events = json.loads(found["trace"].read_text())
    ops = [(e["name"], float(e["ts"]), float(e["ts"]) + e["dur"]) for e in events
           if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    with open(found["output"] / "operator_memory.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {"Name", "Size(KB)", "Allocation Time(us)", "Release Time(us)"} <= set(rows[0])
    times = [float(r["Allocation Time(us)"]) for r in rows]
    assert all(name.startswith("aten::op") for name in _spans_of(
        [op for op in ops if not op[0].startswith("ProfilerStep#")], times))
    with open(found["output"] / "memory_record.csv", newline="") as handle:
        reserved = max(float(r["Total Reserved(MB)"]) for r in csv.DictReader(handle))
    assert round(reserved * MiB) == result["peak_reserved"]                # compare's "Mem Usage"
    trace = read_ascend_profiler(folder)
    assert trace.meta["recorded"]["allocated_max_diff"] == 0 and trace.meta["framework"] == "torch_npu"


def test_export_rows_are_the_models_blocks(tmp_path, capsys):
    """Each row holds the block the model gave (torch_npu: at least the request + 32 B rounded up to
    512 B; a block not split when the rest would be under 1 MiB), not the request: the rows add up
    to the model's totals at every row."""
    folder, _ = _export(tmp_path, capsys, "--allocator", "torch-npu")
    with open(folder / "ASCEND_PROFILER_OUTPUT" / "operator_memory.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    asked = {(k + 1) * MiB + 512 for k in range(6)}         # what the recording's rows held
    sizes = [round(float(row["Size(KB)"]) * 1024) for row in rows]
    assert all(size % 512 == 0 for size in sizes) and set(sizes) - asked, sizes     # some blocks left unsplit
    assert read_ascend_profiler(folder).meta["recorded"]["allocated_max_diff"] == 0


@pytest.mark.parametrize("case", ["file", "exists", "inside input", "fifo", "under a file"])
def test_bad_export_folder_exits_2(tmp_path, capsys, case):
    recording = _recording(tmp_path)
    target = tmp_path / "target"
    if case == "file":
        target.write_text("mine")
    elif case == "exists":
        (target / "rank0_ascend_pt").mkdir(parents=True)
    elif case == "inside input":
        target = recording / "ASCEND_PROFILER_OUTPUT"
    elif case == "fifo":
        os.mkfifo(target)
    else:
        (tmp_path / "plain").write_text("mine")
        target = tmp_path / "plain" / "out"
    assert main(["replay", str(recording), "--export-profiler", str(target)]) == 2
    err = capsys.readouterr().err
    assert "--export-profiler" in err and str(target) in err, err
    if case == "file":
        assert target.read_text() == "mine"


MSPROF_ANALYZE = os.environ.get("MSPROF_ANALYZE", "/tmp/msa/bin/msprof-analyze")


@pytest.mark.skipif(not os.access(MSPROF_ANALYZE, os.X_OK),
                    reason=f"msprof-analyze not installed at {MSPROF_ANALYZE} (pip install msprof-analyze into a "
                           "scratch venv; MSPROF_ANALYZE names it)")
def test_msprof_analyze_compare_reads_two_exports(tmp_path, capsys):
    base, _ = _export(tmp_path / "a", capsys)
    other, _ = _export(tmp_path / "b", capsys, "--allocator", "torch")
    run = subprocess.run([MSPROF_ANALYZE, "compare", "-d", str(base), "-bp", str(other), "-o", str(tmp_path / "cmp"),
                          "--enable_memory_compare", "--force"], capture_output=True, text=True, timeout=300)
    assert "ERROR" not in run.stdout + run.stderr, run.stdout + run.stderr
    assert list((tmp_path / "cmp").glob("performance_comparison_result_*.xlsx"))

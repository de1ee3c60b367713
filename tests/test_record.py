"""``ms-memopt record``: a live recording of the real CPU pool replays exactly."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from ms_memopt.core.events import read_jsonl
from ms_memopt.io.traces import load_trace

WORKLOAD = textwrap.dedent("""
    import sys
    import numpy as np
    import mindspore as ms
    from mindspore import nn, ops
    keep = [ms.Tensor(np.ones((8, 8), np.float32)) * 2]           # long-lived
    net = nn.SequentialCell(nn.Dense(16, 32), nn.ReLU(), nn.Dense(32, 4))
    @ms.jit
    def scale(x):
        return ops.relu(x * 3 + 1).sum()
    for step, rows in enumerate((4, 9, 2, 7)):                     # varying shapes
        x = ms.Tensor(np.random.randn(rows, 16).astype(np.float32))
        out = net(x) + scale(x)
        if step == 1:
            keep.append(out * 1)
        print(f"ms-memopt step {step + 1}", file=sys.stderr, flush=True)
    sys.exit(5)
""")


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ms_memopt", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_record_passes_the_exit_status_and_other_stderr_through(tmp_path):
    out = tmp_path / "none.jsonl"
    proc = _run("record", "--no-progress", "--out", str(out), "--", sys.executable, "-c",
                "import sys; print('hello', file=sys.stderr); sys.exit(3)")
    assert proc.returncode == 3
    assert "hello" in proc.stderr and "no MindSpore pool line" in proc.stderr
    assert not out.exists()
    assert _run("record", "--", str(tmp_path / "missing")).returncode == 127
    bad = _run("record")
    assert bad.returncode == 2 and "expected a command" in bad.stderr


@pytest.mark.mindspore
def test_live_recording_replays_exactly(tmp_path):
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    out = tmp_path / "rec.jsonl"
    raw = tmp_path / "raw.log"
    proc = _run("record", "--no-progress", "--out", str(out), "--raw", str(raw), "--", sys.executable, str(script))
    assert proc.returncode == 5, proc.stderr[-2000:]
    trace = read_jsonl(out)
    assert trace.meta["pool"] == "DynamicMemPoolBestFit"
    assert trace.meta["pool_log"]["skipped_lines"] == 0, trace.meta
    steps_seen = [line[-300:] for line in raw.read_text().splitlines() if "ms-memopt step" in line]
    assert [e.step for e in trace.events if e.action == "step"] == [1, 2, 3, 4], steps_seen
    assert sum(e.action == "segment_alloc" for e in trace.events) >= 1
    assert [e.step for e in load_trace(raw).events if e.action == "step"] == [1, 2, 3, 4]
    for path in (out, raw):          # the events and the raw log read the same
        replayed = _run("replay", str(path), "--json")
        assert replayed.returncode == 0, replayed.stderr
        result = json.loads(replayed.stdout)
        assert result["allocator"] == "mindspore-bestfit"
        assert result["allocs"] > 50
        assert result["address_match"] == 1.0 and result["final_layout_match"] is True, (path.name, result)

"""Scans of the real CPU pool, followed live from this process's own pool log."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys
    from ms_memopt.mindspore import poolcapture
    capture = poolcapture.start(sys.argv[1])
    import numpy as np
    import mindspore as ms
    from ms_memopt.mindspore.sources import make_sources
    print("python stderr still shows", file=sys.stderr)
    held = []
    for rows in (3, 40, 7, 25):                         # varying shapes leave holes
        x = ms.Tensor(np.ones((rows, 64), np.float32))
        y = (x * 2 + 1).sum(axis=1)
        held.append(y * 1)
    sources, reason = make_sources("auto")
    source = sources[0]
    reading = source.read()
    layout = source.layout()
    out = {"source": source.name, "reason": reason, "allocated": reading.allocated,
           "reserved": reading.reserved, "live": len(capture.parser.live),
           "segments": [(s.addr, s.size) for s in layout.segments],
           "live_blocks": sorted((b.addr, b.size) for b in layout.live_blocks()),
           "late": poolcapture.start("/nonexistent/again") is capture}
    capture.stop()
    print(json.dumps(out))
""")


@pytest.mark.mindspore
def test_scan_source_reads_the_real_pool_and_matches_a_replay_of_its_log(tmp_path):
    script = tmp_path / "live.py"
    script.write_text(SCRIPT)
    log = tmp_path / "pool.log"
    proc = subprocess.run([sys.executable, str(script), str(log)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "python stderr still shows" in proc.stderr
    assert "Alloc memory details" not in proc.stderr      # the pool's lines went to the log only
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["source"] == "pool-log" and "real pool" in got["reason"]
    assert got["late"] is True
    assert got["reserved"] == 1 << 30 and got["live"] >= 4 and got["allocated"] > 0
    # the log left behind is a complete pool log: replayed, it ends in the layout the scan saw
    from ms_memopt.allocators import create
    from ms_memopt.replay.replay import replay
    from ms_memopt.io.traces import load_trace
    trace = load_trace(log)
    result = replay(trace, create("mindspore-bestfit"))
    assert result.address_match == 1.0
    assert [tuple(s) for s in got["segments"]] == [(s.addr, s.size) for s in trace.final.segments]
    # nothing ran after the scan, so the scan saw the pool the whole log ends in
    assert [tuple(b) for b in got["live_blocks"]] == sorted((b.addr, b.size) for b in trace.final.live_blocks())


def test_capture_refuses_after_mindspore_is_imported(tmp_path):
    code = textwrap.dedent(f"""
        import sys, types
        sys.modules["mindspore"] = types.ModuleType("mindspore")     # as if imported already
        from ms_memopt.mindspore import poolcapture
        assert poolcapture.start({str(tmp_path / 'p.log')!r}) is None
        print(poolcapture.unavailable_reason())
        print("refused:", poolcapture.active())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "imported before" in proc.stdout and "refused: None" in proc.stdout
    assert not (tmp_path / "p.log").exists()


MARKS = textwrap.dedent("""
    import sys
    from ms_memopt.mindspore import poolcapture
    capture = poolcapture.start(sys.argv[1])
    import numpy as np
    import mindspore as ms
    from ms_memopt.mindspore import mark_step
    mark_step()
    for rows in (8, 16, 8):
        x = ms.Tensor(np.ones((rows, 64), np.float32))
        y = (x * 2 + 1) * 3
        y.asnumpy()
        mark_step(seq=rows, batch=1)
    capture.poll()
    capture.stop()
""")


@pytest.mark.mindspore
def test_marks_go_to_the_process_s_own_pool_log_and_are_a_recording(tmp_path):
    """`ms-memopt run` follows its own pool log; mark_step writes its step lines there (not to
    the terminal), so the log is a recording `ms-memopt learn` takes."""
    script = tmp_path / "marks.py"
    script.write_text(MARKS)
    log = tmp_path / "pool.log"
    proc = subprocess.run([sys.executable, str(script), str(log)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ms-memopt step" not in proc.stderr
    from ms_memopt.io.traces import load_trace
    steps = [e for e in load_trace(log).events if e.action == "step"]
    assert [(e.step, e.tag) for e in steps] == [(0, None), (1, "dims:seq=8,batch=1"), (2, "dims:seq=16,batch=1"),
                                                (3, "dims:seq=8,batch=1")]

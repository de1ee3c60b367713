"""Two msrun workers on CPU (loopback) with LayoutScanCallback: one scan log per rank, merged
by ``ms-memopt report``. Bounded: the run is killed after a timeout."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ms_memopt.analysis.scan import read_scan_log
from ms_memopt.report.merge import merge_ranks

pytestmark = [pytest.mark.msrun, pytest.mark.mindspore, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path("/work/main/.venv/bin")

_WORKER = textwrap.dedent("""
    import sys
    import numpy as np
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore import nn
    from mindspore.communication import get_group_size, get_rank, init
    from mindspore.train import Model
    from ms_memopt.mindspore.scan_callback import LayoutScanCallback

    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    rank = get_rank()
    rng = np.random.default_rng(rank)
    # rank 1 sees a bigger batch: its activations, and its shadow pool, differ
    batch = 4 if rank == 0 else 8
    data = ds.NumpySlicesDataset({"x": rng.standard_normal((6 * batch, 16)).astype(np.float32),
                                  "y": rng.integers(0, 4, 6 * batch).astype(np.int32)}, shuffle=False).batch(batch)
    net = nn.SequentialCell([nn.Dense(16, 32), nn.ReLU(), nn.Dense(32, 4)])
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    cb = LayoutScanCallback(every=2, log_dir=sys.argv[1], watch={"allreduce": "64KiB"},
                            model_options={"options": {"increase_size": 4096}})
    Model(net, loss, opt).train(1, data, callbacks=[cb], dataset_sink_mode=False)
    print("rank", rank, "of", get_group_size(), "scans", len(cb.records), flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_msrun_two_workers_one_log_per_rank_and_report_merges(tmp_path):
    msrun = VENV_BIN / "msrun" if (VENV_BIN / "msrun").exists() else shutil.which("msrun")
    if msrun is None:
        pytest.skip("msrun not found")
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    memlog = tmp_path / "memlog"
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONPATH=str(REPO),
               GLOG_v="3")
    cmd = [str(msrun), "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "--join=True", "--cluster_time_out=300",
           f"--log_dir={tmp_path / 'msrun_logs'}", str(script), str(memlog)]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        pytest.fail("msrun did not finish within 600 s")
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in (tmp_path / "msrun_logs").glob("*.log"))
    assert proc.returncode == 0, out.decode(errors="replace")[-2000:] + logs
    per_rank = {rank: read_scan_log(memlog / f"rank_{rank}" / "scan.jsonl") for rank in (0, 1)}
    for rank, records in per_rank.items():
        assert [r["step"] for r in records] == [1, 2, 4, 6], (rank, records)
        assert all(r["rank"] == rank and r["source"] == "model" for r in records)
    assert per_rank[1][-1]["extra"]["activation_bytes"] > per_rank[0][-1]["extra"]["activation_bytes"]
    merged = merge_ranks(memlog)
    assert merged.ranks == [0, 1] and [s.step for s in merged.steps] == [1, 2, 4, 6]
    assert all(s.ranks == 2 for s in merged.steps)
    report = subprocess.run([sys.executable, "-m", "ms_memopt", "report", str(memlog), "--json"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    steps = json.loads(report.stdout)["steps"]
    assert [s["ranks"] for s in steps] == [2, 2, 2, 2]
    for s in steps:
        assert s["worst_rank"] in (0, 1) or s["frag_max"] is None

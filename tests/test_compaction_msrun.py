"""Two CPU workers under msrun on loopback: compaction in lockstep, and a dead peer fails fast.

Each test starts ``msrun`` with a tiny data-parallel job (bounded by a subprocess timeout; the
whole process group is killed if it ever hangs) and reads what the workers wrote.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mindspore")
pytestmark = [pytest.mark.msrun, pytest.mark.mindspore, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]

WORKER = r'''
import json, os, sys, time
import numpy as np
import mindspore as ms
from mindspore import nn
from mindspore.communication import init, get_rank, get_group_size
from mindspore.train import Model, Callback
from ms_memopt.mindspore.compaction import CompactionCallback, BarrierTimeout

out = sys.argv[1]
die_rank = int(sys.argv[2])          # -1: nobody dies
die_mode = sys.argv[3]               # "exit0": leaves quietly; "hang": stops responding
timeout = float(sys.argv[4])
init()
rank = get_rank()
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
ms.set_seed(0)
net = nn.SequentialCell(nn.Dense(16, 32), nn.ReLU(), nn.Dense(32, 4))
opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
model = Model(nn.WithLossCell(net, nn.MSELoss()), optimizer=opt)
rng = np.random.default_rng(rank)     # each rank its own shard
data = ms.dataset.NumpySlicesDataset({"x": rng.standard_normal((48, 16)).astype(np.float32),
                                      "y": rng.standard_normal((48, 4)).astype(np.float32)},
                                     shuffle=False).batch(8)

class Die(Callback):
    def on_train_step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        # every rank marks the end of its step's collectives; the rank that dies waits for its peer's
        # mark first, so that it leaves at the compaction barrier and not inside the peer's last
        # gradient AllReduce (a ring send to a gone peer fails in MindSpore, not in the barrier)
        open(os.path.join(out, f"step{step}_rank{rank}.done"), "w").close()
        if rank == die_rank and step == 2:
            peer = os.path.join(out, f"step2_rank{1 - rank}.done")
            deadline = time.monotonic() + 300
            while not os.path.exists(peer) and time.monotonic() < deadline:
                time.sleep(0.05)
            print(f"rank {rank}: {die_mode} on purpose before the compaction barrier", flush=True)
            if die_mode == "hang":
                time.sleep(3600)
            os._exit(0)

compaction = CompactionCallback(every=2, barrier_timeout=timeout, log_dir=out)
t0 = time.monotonic()
try:
    model.train(1, data, callbacks=[Die(), compaction], dataset_sink_mode=False)
except BarrierTimeout as exc:
    with open(os.path.join(out, f"error_{rank}.txt"), "w") as f:
        f.write(f"{time.monotonic() - t0:.2f}\n{exc}\n")
    print(f"rank {rank}: {exc}", flush=True)
    os._exit(4)       # communication teardown with a dead peer could block: leave now
np.savez(os.path.join(out, f"params_{rank}.npz"), *[p.asnumpy() for p in net.trainable_params()])
with open(os.path.join(out, f"steps_{rank}.json"), "w") as f:
    json.dump([r["step"] for r in compaction.records], f)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _msrun(tmp_path: Path, die_rank: int, die_mode: str, barrier_timeout: float, limit: float):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["GLOG_v"] = "3"
    msrun = Path(venv_bin) / "msrun"
    if not msrun.exists():
        pytest.skip("msrun is not installed next to this Python")
    port = _free_port()
    # the barrier store's default port (master port + 11) may be some other socket's ephemeral port
    env["MS_MEMOPT_STORE_PORT"] = str(next(p for p in iter(_free_port, None) if p != port))
    cmd = [str(msrun), "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1",
           f"--master_port={port}", "--join=True", "--cluster_time_out=300",
           f"--log_dir={tmp_path / 'logs'}", str(script), str(out), str(die_rank), die_mode, str(barrier_timeout)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in (tmp_path / "logs").glob("*.log"))
        pytest.fail(f"msrun did not finish within {limit} s\n{logs}")
    return proc.returncode, output.decode(errors="replace"), out, time.monotonic() - started


def test_both_ranks_compact_at_the_same_steps_and_stay_identical(tmp_path):
    code, output, out, _ = _msrun(tmp_path, -1, "none", barrier_timeout=60, limit=600)
    assert code == 0, output[-3000:]
    steps = [json.loads((out / f"steps_{r}.json").read_text()) for r in (0, 1)]
    assert steps[0] == steps[1] == [2, 4, 6]
    p0, p1 = (np.load(out / f"params_{r}.npz") for r in (0, 1))
    assert all(np.array_equal(p0[k], p1[k]) for k in p0.files)
    records = [json.loads(line) for r in (0, 1) for line in (out / f"rank_{r}" / "scan.jsonl").read_text().splitlines()]
    assert sorted((r["rank"], r["step"]) for r in records) == [(r, s) for r in (0, 1) for s in (2, 4, 6)]
    assert all(r["live"]["verified"] and r["bytes_moved"] > 0 for r in records)


@pytest.mark.parametrize("die_rank, die_mode, survivor, expect", [
    (1, "hang", 0, "1/2 ranks arrived"),          # a hung peer: the store host times out
    (0, "exit0", 1, "rank 0"),                   # the store host itself is gone
])
def test_missing_peer_makes_the_survivor_fail_within_the_timeout(tmp_path, die_rank, die_mode, survivor, expect):
    """A rank that leaves (exit status 0, so msrun does not kill the job) or hangs before a
    compaction barrier: the other rank raises BarrierTimeout within the timeout. (A worker that
    crashes with a non-zero status is killed together with the job by msrun itself.)"""
    timeout = 8.0
    code, output, out, elapsed = _msrun(tmp_path, die_rank, die_mode, barrier_timeout=timeout, limit=600)
    error = out / f"error_{survivor}.txt"
    assert error.exists(), output[-3000:]
    waited, message = error.read_text().split("\n", 1)
    assert f"rank {survivor}: compaction barrier at step 2" in message or "barrier store" in message
    assert expect in message
    # the survivor gave up: after the timeout, plus training time before step 2 (which a loaded
    # machine stretches; the bound only tells a timeout from a hang)
    assert timeout <= float(waited) < timeout + 200
    assert not (out / f"params_{survivor}.npz").exists()

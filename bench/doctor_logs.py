"""Crash-log reading speed: ``ms-memopt doctor LOG`` and ``doctor LOGDIR`` on generated job logs.

Two figures (issue: the first minute after the crash):

* one log read at >= 200 MB/s on one core: a MindSpore/MindFormers training log of ``--log-mb`` MB
  (step lines, INFO and WARNING lines of the runtime, a few Python logger lines), one OOM report
  (the dynamic pool's failure with its GLOG_v=1 state and the runtime's line) at its end;
* a folder of ``--ranks`` logs of ``--rank-mb`` MB each (msrun's ``worker_N.log``) read in <= 15 s on
  2 cores by ``diagnose_logdir`` on local worker processes, one rank's OOM among the others' HCCL
  timeouts; the peak resident memory of this process and of its workers, which streaming keeps
  bounded by the workers, not by the folder.

The logs are written once into ``--dir`` (default a temporary folder, removed after) and read from
the page cache: the figures are the reader's, not the disk's. Prints a table, then as the last line
one JSON object: ``{"one_log_mb_per_s", "one_log_mb", "folder_seconds", "folder_ranks", "folder_mb",
"folder_mb_per_s", "workers", "peak_rss_mb_self", "peak_rss_mb_workers", "first_rank", "verdict"}``.

Usage: python bench/doctor_logs.py [--log-mb 256] [--ranks 1024] [--rank-mb 2] [--workers 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_memopt.doctor.crash_logs import diagnose_logdir  # noqa: E402
from ms_memopt.io.oom_logs import read_oom_log  # noqa: E402

MiB, GiB = 2**20, 2**30


def _training_lines(n_bytes: int, start_step: int = 1) -> bytes:
    """Lines as a MindFormers run on Ascend prints them, ``n_bytes`` of them."""
    block = []
    step = start_step
    for i in range(200):
        block.append(f"[INFO] DEVICE(4242,ffff9c2b,python):2026-03-01-10:{i % 60:02d}:07.123.456 "
                     f"[mindspore/ccsrc/plugin/ascend/res_manager/ascend_stream_manager.cc:311] SyncStream] "
                     f"sync stream {i % 7} done")
        block.append(f"[WARNING] PRE_ACT(4242,ffff9c2b,python):2026-03-01-10:{i % 60:02d}:07.223.456 "
                     f"[mindspore/ccsrc/runtime/graph_scheduler/actor/kernel_actor.cc:88] Run] the op "
                     f"Default/network-GPT/layer{i % 48}/MatMul-op{i} has an empty input, skipped")
        if i % 20 == 0:
            block.append(f"2026-03-01 10:{i % 60:02d}:08,000 - mindformers[mindformers/core/callback/callback.py:"
                         f"411] - INFO - {{ Epoch:[  1/  1], step:[{step:5d}/ 9999], loss: 2.{i:03d}, "
                         f"per_step_time: 4700ms, lr: 1e-05, overflow cond: False, loss_scale: 1.0 }}")
            step += 1
    text = ("\n".join(block) + "\n").encode()
    return (text * (n_bytes // len(text) + 1))[:n_bytes].rsplit(b"\n", 1)[0] + b"\n"


def _oom(when: str = "2026-03-01-10:41:05.000.000") -> bytes:
    head = f"(4242,ffff9c2b,python):{when} [mindspore/ccsrc/runtime/memory/mem_pool/"
    return ("\n".join([
        f"[WARNING] PRE_ACT{head}abstract_dynamic_mem_pool.cc:712 CalMemBlockAllocSize] Memory not enough: current free "
        f"memory size[0] is smaller than required size[4509715660].",
        f"[INFO] PRE_ACT{head}abstract_dynamic_mem_pool.cc:1065 DumpDynamicMemPoolStateInfo] The dynamic memory pool"
        f"[Ascend] stat info : {{\"in used mem\":71680.00MB,\"peak used mem\":81920.00MB,\"alloc mem\":86016.00MB,"
        f"\"idle mem\":14336.00MB,\"used by event mem\":0.00MB,\"eager free mem\":0.00MB}}, actual peak used "
        f"mem:83968M. Weight used size:12000M, constant value used size:0M, kernel output used size:59680M, other "
        f"used size:0M.",
        f"[ERROR] ME{head}../graph_scheduler/actor/memory_manager_actor.cc:390 SetOpMemoryAllocFailedInfo] "
        f"Device(id:0) memory isn't enough and alloc failed, kernel name: Default/AllReduce-op1, alloc size: "
        f"4509715660B.", ""]) + "\n").encode()


def _hccl(rank: int) -> bytes:
    return (f"[ERROR] DISTRIBUTED(4242,ffff9c2b,python):2026-03-01-10:51:07.000.000 [mindspore/ccsrc/plugin/"
            f"ascend/hccl_adapter/hccl_adapter.cc:1 Wait] HCCL timeout: EI0002 The wait execution of the Notify "
            f"register times out. rank {rank}\n").encode()


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (workers may hang under a fork server, not under us directly)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class _RssWatch(threading.Thread):
    """Samples the resident memory of this process and of its descendants every 0.2 s (Linux /proc)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = False
        self.self_peak = 0.0
        self.child_peak = 0.0
        self.cpu: dict[int, float] = {}       # pid -> CPU seconds last seen (user + system)

    def run(self) -> None:
        while not self.stop:
            self.self_peak = max(self.self_peak, _rss_mb(os.getpid()))
            kids = _descendants(os.getpid())
            self.child_peak = max(self.child_peak, sum(_rss_mb(p) for p in kids))
            for pid in kids:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    self.cpu[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                except (OSError, IndexError, ValueError):
                    pass
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log-mb", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--rank-mb", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dir", default=None, help="write the logs here (kept); default: a temporary folder")
    args = parser.parse_args()

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="doctor_logs_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        one = root / "worker_0.log"
        one.write_bytes(_training_lines(args.log_mb * MiB) + _oom())
        size = one.stat().st_size
        read_oom_log(one)                      # page cache warm
        best = None
        for _ in range(3):
            t0 = time.process_time()
            scan = read_oom_log(one)
            dt = time.process_time() - t0
            best = dt if best is None else min(best, dt)
        assert scan.reports, "the OOM at the end of the log was not found"
        one_rate = size / MiB / best

        folder = root / "msrun_log"
        folder.mkdir(exist_ok=True)
        body = _training_lines(int(args.rank_mb * MiB))
        bad = min(104, args.ranks - 1)
        for rank in range(args.ranks):
            (folder / f"worker_{rank}.log").write_bytes(body + (_oom() if rank == bad else _hccl(rank)))
        folder_bytes = sum(p.stat().st_size for p in folder.iterdir())
        base_rss = _rss_mb(os.getpid())
        watch = _RssWatch()
        watch.start()
        t0 = time.perf_counter()
        job = diagnose_logdir(folder, workers=args.workers)
        folder_s = time.perf_counter() - t0
        watch.stop = True
        watch.join()
        self_rss, child_rss = watch.self_peak, watch.child_peak
        worker_cpu = sum(watch.cpu.values())
        load = os.getloadavg()[0]
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    rows = [("one log", f"{size / MiB:,.0f} MB", f"{best:.2f} s CPU", f"{one_rate:,.0f} MB/s", ">= 200 MB/s"),
            (f"{args.ranks} logs", f"{folder_bytes / MiB:,.0f} MB", f"{folder_s:.2f} s wall",
             f"{folder_bytes / MiB / folder_s:,.0f} MB/s", f"<= 15 s on {args.workers} workers")]
    print(f"{'what':<12} {'size':>10} {'time':>14} {'rate':>12}  target")
    for row in rows:
        print(f"{row[0]:<12} {row[1]:>10} {row[2]:>14} {row[3]:>12}  {row[4]}")
    print(f"peak RSS while reading the folder: this process {self_rss:,.0f} MB (at the start {base_rss:,.0f} MB), "
          f"all workers together {child_rss:,.0f} MB")
    print(f"workers' CPU: {worker_cpu:.1f} s in all ({worker_cpu / args.workers:.1f} s each if shared evenly); "
          f"load average {load:.1f} on {os.cpu_count()} cores while it ran (other processes take their share)")
    print(f"verdict: {job.text[:160]}")
    print(json.dumps({"one_log_mb_per_s": round(one_rate, 1), "one_log_mb": round(size / MiB, 1),
                      "folder_seconds": round(folder_s, 2), "folder_ranks": args.ranks,
                      "folder_mb": round(folder_bytes / MiB, 1), "folder_mb_per_s": round(folder_bytes / MiB / folder_s, 1),
                      "workers": args.workers, "peak_rss_mb_self": round(self_rss, 1),
                      "peak_rss_mb_workers": round(child_rss, 1), "workers_cpu_seconds": round(worker_cpu, 2),
                      "load_average": round(load, 1), "first_rank": job.first[0] if job.first else None,
                      "verdict": job.first_diagnosis.verdict.kind if job.first else None}))


if __name__ == "__main__":
    main()

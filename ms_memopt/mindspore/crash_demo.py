"""A real MindSpore OOM from fragmentation on CPU, for ``make demo`` and for ``doctor``'s tests.

MindSpore 2.10's CPU pool ignores every cap it offers (``ms.runtime.set_memory(max_size=...)``,
``ms.set_context(max_device_memory=...)``: docs/doctor.md), so the cap here is the process's
address space (``RLIMIT_AS``), set once the pool holds two 1 GiB blocks: it cannot map a third.
Eight 240 MiB tensors fill the two blocks, every other one is freed
(four 240 MiB holes, about 1 GiB idle), then a 400 MiB request finds no hole and no room for a
block: MindSpore prints its own OOM (``Memory not enough: alloc size[0] is smaller than required
size[419430400]``, and at ``GLOG_v=1`` the pool's state). Run it with
``GLOG_v=1 python -m ms_memopt.mindspore.crash_demo > worker_0.log 2>&1``; it exits non-zero.

:func:`run_crash` runs it in a child process and returns the log's path.

Example:
    >>> log = run_crash(Path("out/crash"))                  # doctest: +SKIP
    >>> from ms_memopt.doctor.crash_logs import diagnose_log
    >>> diagnose_log(log).verdict.kind                      # doctest: +SKIP
    'fragmentation'
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["run_crash", "main"]

MiB = 2**20
#: address space allowed beyond the warmed-up process: less than one more 1 GiB pool block
HEADROOM = 512 * MiB


def _vmsize() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


def main() -> int:
    """The failing run itself (MindSpore imported here)."""
    import resource

    import mindspore as ms
    from mindspore import ops

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.runtime.launch_blocking()
    # warm-up: the pool grows its two 1 GiB blocks and MindSpore starts its threads (their stacks and
    # malloc arenas take address space), all before the cap; the blocks stay in the pool, idle
    warm = [ops.zeros((240 * MiB // 4,), ms.float32) for _ in range(8)]
    del warm
    cap = _vmsize() + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
    print(f"address space capped at {cap // MiB} MiB: no third pool block", flush=True)
    keep = [ops.zeros((240 * MiB // 4,), ms.float32) for _ in range(8)]    # the same two blocks, full
    print("epoch: 1 step: 1, loss is 0.0", flush=True)     # a step line, as LossMonitor prints it
    del keep[1::2]                                 # four 240 MiB holes between live tensors
    big = ops.zeros((400 * MiB // 4,), ms.float32)  # no hole holds it, no block can be added
    print("no OOM:", big.shape, flush=True)
    return 0


def run_crash(out: Path, *, glog: int = 1, timeout: float = 300) -> Path:
    """Run :func:`main` in a child process with ``GLOG_v=glog``; its stdout and stderr go to
    ``out/worker_0.log`` (msrun's name), which is returned."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "worker_0.log"
    env = dict(os.environ, GLOG_v=str(glog))
    with open(log, "wb") as handle:
        subprocess.run([sys.executable, "-m", "ms_memopt.mindspore.crash_demo"], stdout=handle,
                       stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False)
    return log


if __name__ == "__main__":
    sys.exit(main())

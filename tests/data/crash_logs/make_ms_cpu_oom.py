"""A real MindSpore CPU OOM from fragmentation: the pool's idle holes add up to the request, none holds it,
and the address-space cap (RLIMIT_AS) refuses the new pool block."""
import resource, sys
import mindspore as ms
from mindspore import ops
ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
ms.runtime.launch_blocking()
MiB = 2**20
def vmsize():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
warm = ops.ones((4,), ms.float32) + 1          # the pool's first block exists now
print("VmSize after warm-up", vmsize() // MiB, "MiB", flush=True)
head = int(sys.argv[1]) * MiB if len(sys.argv) > 1 else 2300 * MiB
resource.setrlimit(resource.RLIMIT_AS, (vmsize() + head, resource.RLIM_INFINITY))
print("address space capped at", (vmsize() + head) // MiB, "MiB", flush=True)
n = 240 * MiB // 4
keep = []
for i in range(8):
    keep.append(ops.zeros((n,), ms.float32))
    print("allocated", i + 1, "x 240 MiB; VmSize", vmsize() // MiB, "MiB", flush=True)
del keep[1::2]          # every other one freed: 4 holes of 240 MiB between live tensors
print("freed 4 x 240 MiB", flush=True)
big = ops.zeros((400 * MiB // 4,), ms.float32)   # 400 MiB: no hole holds it; idle memory would
print("400 MiB allocated (no OOM)", flush=True)

"""Which device-memory pool this job has, and what that means for fragmentation.

MindSpore 2.10 picks one of three pools, and the choice decides whether holes can kill a job:

* **CPU**: ``DynamicMemPoolBestFit`` (best fit in 1 GiB blocks; seen here in the pool log).
* **Ascend with VMM** (``enable_vmm``): the pool reserves a large virtual range and maps physical
  memory in 2 MiB chunks on demand, unmapping idle chunks ("eager free"). Physical memory does
  not fragment; only virtual addresses do, and they are plentiful. ``init_size`` is not used
  ("Skip initialization of memory pool since vmm enabled"), and ``empty_cache`` unmaps idle
  pages. On 2.10 VMM is on by default where the driver is 24.0.0 or newer ("Driver version is
  less than 24.0.0, vmm is disabled by default": ``CheckVmmDriverVersion`` in
  ``plugin/ascend/res_manager/mem_manager/ascend_vmm_adapter``; strings of the 2.10 wheel's
  ``libmindspore_ascend_res_manager.so``).
* **Ascend without VMM**: the best-fit pool in blocks that never merge, where a fragmentation
  OOM can happen (``MS_ALLOC_CONF=enable_vmm:False``, ``older_pool:True``, drivers older than
  24.0.0, 910A, and the field report's CANN 7.0 stack).

:func:`detect_pool` reads what the job says about itself: the device target, ``MS_ALLOC_CONF``,
the Ascend driver's ``version.info``, the execution mode and ``memory_optimize_level`` (SOMAS
static reuse in graph mode). Every conclusion carries its basis, because some of them (the VMM
default) follow MindSpore's source and were never seen on a device here.

Example:
    >>> info = detect_pool()                         # doctest: +SKIP
    >>> info.kind, info.vmm, info.mode               # doctest: +SKIP
    ('cpu-bestfit', False, 'pynative')
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["PoolInfo", "detect_pool", "parse_alloc_conf", "driver_version", "VMM_MIN_DRIVER"]

#: the first Ascend driver on which MindSpore 2.10 turns VMM on by default
VMM_MIN_DRIVER = (24, 0, 0)
_DRIVER_INFO = ("/usr/local/Ascend/driver/version.info",)


@dataclass(frozen=True)
class PoolInfo:
    """The pool of this process, as :func:`detect_pool` found it.

    Attributes:
        device: ``"CPU"``, ``"Ascend"``, ``"GPU"``.
        kind: ``"cpu-bestfit"``, ``"ascend-vmm"``, ``"ascend-bestfit"`` or ``"gpu"``.
        vmm: physical memory is mapped on demand (fragmentation of holes cannot cause OOMs).
        mode: ``"pynative"`` or ``"graph"``.
        somas: graph mode with ``memory_optimize_level`` O1 (static reuse planned at compile time).
        basis: how ``vmm`` was decided (the setting or fact it rests on).
    """

    device: str
    kind: str
    vmm: bool
    mode: str
    somas: bool
    basis: str

    @property
    def holes_decide_ooms(self) -> bool:
        """Whether the layout's holes can make a request fail (False under VMM)."""
        return not self.vmm

    def explain(self) -> str:
        """One paragraph for reports: what fragmentation means on this pool."""
        if self.vmm:
            return ("VMM pool: physical memory is mapped in 2 MiB pages on demand and idle pages are unmapped, "
                    "so holes in the layout do not decide OOMs here; watch memory in use against the device's "
                    "capacity (max_device_memory) instead. Compaction and pool-mode reservation are not needed "
                    f"and are skipped. ({self.basis})")
        if self.device == "CPU":
            return ("CPU best-fit pool (DynamicMemPoolBestFit, 1 GiB blocks); host memory, it does not OOM "
                    "from the pool here: replay its log through a model with a capacity to see fragmentation.")
        return ("best-fit pool without VMM: free ranges in different blocks never merge, so a large request can "
                "fail with much memory free; watch largest_free against the watched requests. Remedies: "
                "MS_ALLOC_CONF=enable_vmm:True (driver >= 24.0.0), pool mode, or a larger init_size set in the "
                f"launch script. ({self.basis})")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["holes_decide_ooms"] = self.holes_decide_ooms
        return out


def parse_alloc_conf(text: str | None = None) -> dict[str, str]:
    """``MS_ALLOC_CONF`` (``"enable_vmm:True,older_pool:False"``) as a dict; keys lower-case.

    Example:
        >>> parse_alloc_conf("enable_vmm:False, memory_tracker:True")
        {'enable_vmm': 'False', 'memory_tracker': 'True'}
    """
    text = os.environ.get("MS_ALLOC_CONF", "") if text is None else text
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition(":")
        if sep and key.strip():
            out[key.strip().lower()] = value.strip()
    return out


def driver_version(paths: tuple[str, ...] = _DRIVER_INFO) -> tuple[int, ...] | None:
    """The Ascend driver version from its ``version.info`` (``Version=24.1.rc2`` -> (24, 1)),
    or ``None`` when there is none (no Ascend driver installed).

    Example:
        >>> driver_version(("/nonexistent",)) is None
        True
    """
    for path in paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        match = re.search(r"^\s*Version\s*=\s*([0-9][0-9A-Za-z.]*)", text, re.M)
        if match:
            return tuple(int(p) for p in re.findall(r"\d+", match.group(1).split(".rc")[0].split(".RC")[0]))
    return None


def _true(value: str) -> bool:
    return value.strip().lower() in ("true", "1", "on", "yes")


def _vmm(device: str, conf: dict[str, str], driver: tuple[int, ...] | None) -> tuple[bool, str]:
    if device != "Ascend":
        return False, f"device {device}: no VMM"
    if "enable_vmm" in conf:
        return _true(conf["enable_vmm"]), f"MS_ALLOC_CONF enable_vmm:{conf['enable_vmm']}"
    if _true(conf.get("older_pool", "false")):
        return False, "MS_ALLOC_CONF older_pool:True (the best-fit pool)"
    if driver is None:
        return False, "no Ascend driver version.info found; assuming no VMM"
    if driver[:3] < VMM_MIN_DRIVER:
        return False, f"driver {'.'.join(map(str, driver))} < 24.0.0: MindSpore 2.10 leaves VMM off"
    return True, (f"driver {'.'.join(map(str, driver))} >= 24.0.0: VMM is MindSpore 2.10's default "
                  "(from its source; not seen on a device here)")


def detect_pool(*, device: str | None = None, mode: str | None = None, optimize_level: object = None,
                alloc_conf: str | None = None, driver: tuple[int, ...] | None | str = "read") -> PoolInfo:
    """The pool of this process (see the module docstring). Arguments override what is read
    from MindSpore's context and the environment (for tests and for describing another job).

    Example:
        >>> detect_pool(device="Ascend", mode="graph", optimize_level="O1",
        ...             alloc_conf="enable_vmm:False", driver=None).kind
        'ascend-bestfit'
    """
    if device is None or mode is None or optimize_level is None:
        import mindspore as ms

        device = device or ms.get_context("device_target")
        if mode is None:
            mode = "graph" if ms.get_context("mode") == ms.GRAPH_MODE else "pynative"
        if optimize_level is None:
            optimize_level = ms.get_context("memory_optimize_level")
    conf = parse_alloc_conf(alloc_conf)
    if driver == "read":
        driver = driver_version() if device == "Ascend" else None
    vmm, basis = _vmm(device, conf, driver)
    kind = {"CPU": "cpu-bestfit", "GPU": "gpu"}.get(device, "ascend-vmm" if vmm else "ascend-bestfit")
    somas = mode == "graph" and str(optimize_level) in ("1", "O1")
    return PoolInfo(device=device, kind=kind, vmm=vmm, mode=mode, somas=somas, basis=basis)

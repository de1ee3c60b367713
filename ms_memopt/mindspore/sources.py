"""Live memory sources for layout scans: device pool (Ascend/GPU), shadow model, arenas.

* :class:`DeviceSource` — the real device pool. Totals from ``ms.runtime.memory_stats()``
  (reserved, allocated, idle, eager-free, pool blocks with their base addresses in
  ``blocks_info``). The largest free block, which no public MindSpore API returns, from:
  (1) the pool's debug dump ``MemoryDebugInfo<N>.txt`` when a fresh one exists (MindSpore
  writes it on allocation failure and, with ``MS_ALLOC_CONF`` ``defrag_memory_step_freq``
  containing ``dump``, at every defrag step), reconstructed into a layout by
  ``ms_memopt.traces.ms_debug_dump.read_pool_debug_dump``; else (2) a bounded allocation
  probe: a binary search over request sizes, each one allocated and freed right away (at most
  ``probe_limit`` tries, none larger than the idle memory). Every device call goes through a
  small :class:`DeviceMemoryAPI`, so tests can fake a device.
* :class:`ShadowModelSource` — anywhere (CPU included): the training process's real tensors
  fed as alloc/free events into an allocator model (``mindspore`` by default): parameters and
  optimizer states (persistent pool) once, then each scanned step's activations (outputs of
  leaf Cells, seen through forward hooks) and gradients (one per trainable parameter), in the
  order a step makes them. Records say ``source: "model"``.
* :class:`ArenaSource` — ms-memopt-owned regions (pool mode, compaction arenas): their exact
  ``layout()``.

:func:`make_sources` turns ``source="auto" | "device" | "model" | "arena"`` into an ordered list
(the first is used, the others take over if it fails) and says why.
"""
from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

from ..allocators import create
from ..errors import InputError
from ..layout import Layout
from ..scan import Reading, Source
from ..traces.ms_debug_dump import address_of, read_pool_debug_dump

__all__ = ["DeviceMemoryAPI", "MindSporeDeviceAPI", "DeviceSource", "ShadowModelSource", "ArenaSource",
           "make_sources", "SOURCES"]

logger = logging.getLogger("ms_memopt.scan")

SOURCES = ("auto", "device", "model", "arena")
MiB = 1 << 20


# --- device ----------------------------------------------------------------------------------
class DeviceMemoryAPI:
    """The device calls a :class:`DeviceSource` makes; subclass to fake a device in tests."""

    def device_target(self) -> str:
        """``"Ascend"``, ``"GPU"`` or ``"CPU"``."""
        raise NotImplementedError

    def memory_stats(self) -> dict:
        """``ms.runtime.memory_stats()``'s dict (sizes in bytes)."""
        raise NotImplementedError

    def capacity(self) -> int | None:
        """Device memory the pool may use, bytes, when known."""
        return None

    def debug_dump_files(self) -> list[Path]:
        """Pool debug dumps (``MemoryDebugInfo*.txt``) written so far, any order."""
        return []

    def try_alloc(self, nbytes: int) -> bool:
        """Allocate ``nbytes`` on the device and free it; True when it came from a free block
        (without growing the pool)."""
        raise NotImplementedError


class MindSporeDeviceAPI(DeviceMemoryAPI):
    """The real calls (Ascend/GPU; on CPU every statistic is 0)."""

    def __init__(self, tracker_dir: str | Path | None = None) -> None:
        self.tracker_dir = Path(tracker_dir) if tracker_dir else _tracker_path_from_env()

    def device_target(self) -> str:
        import mindspore as ms
        return str(ms.get_context("device_target"))

    def memory_stats(self) -> dict:
        import mindspore as ms
        return ms.runtime.memory_stats()

    def capacity(self) -> int | None:
        import mindspore as ms
        try:
            return int(ms.hal.get_device_properties(0).total_memory)
        except Exception:  # not every backend reports it (CPU does not)
            return None

    def debug_dump_files(self) -> list[Path]:
        roots = [self.tracker_dir] if self.tracker_dir else []
        roots.append(Path.cwd())
        found = []
        for root in roots:
            found += [Path(p) for p in glob.glob(str(root / "**" / "MemoryDebugInfo*.txt"), recursive=True)]
        return found

    def try_alloc(self, nbytes: int) -> bool:
        import mindspore as ms
        from mindspore import mint
        before = self.memory_stats().get("total_reserved_memory", 0)
        tensor = mint.empty((nbytes,), dtype=ms.uint8)
        grown = self.memory_stats().get("total_reserved_memory", 0) > before
        del tensor
        return not grown


def _tracker_path_from_env() -> Path | None:
    conf = os.environ.get("MS_ALLOC_CONF", "")
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "memory_tracker_path" and value.strip():
            return Path(value.strip())
    return None


def _block_address(obj) -> int | None:
    """A block base from ``blocks_info`` (a PyCapsule on a device, an int in tests); ``None`` when unreadable."""
    try:
        return address_of(obj)
    except InputError:  # an unnamed or null capsule, or another object: the base stays unknown
        return None


def block_bases(stats: dict) -> list[tuple[int | None, int, int, str]]:
    """``(base, size, stream, pool)`` of every pool block listed in ``memory_stats()``."""
    out = []
    for pool, key in (("common", "common_mem_pool_stats"), ("persistent", "persistent_mem_pool_stats")):
        info = (stats.get(key) or {}).get("blocks_info") or {}
        for base, block in info.items():
            out.append((_block_address(base), int(block.get("block_memory_size", 0)),
                        int(block.get("block_stream_id", 0)), pool))
    return out


class DeviceSource(Source):
    """The device pool through :class:`DeviceMemoryAPI` (see the module docstring).

    Args:
        api: the device calls (default: the real ones).
        largest: ``"auto"`` (fresh dump, else probe), ``"dump"``, ``"probe"`` or ``"none"``.
        probe_limit: most allocations one probe scan makes.
        probe_granularity: the probe's resolution, bytes.
    """

    name = "device"

    def __init__(self, api: DeviceMemoryAPI | None = None, *, largest: str = "auto", probe_limit: int = 16,
                 probe_granularity: int = 2 * MiB) -> None:
        if largest not in ("auto", "dump", "probe", "none"):
            raise InputError(f"largest must be auto, dump, probe or none, got {largest!r}", key="largest")
        self.api = api or MindSporeDeviceAPI()
        self.largest = largest
        self.probe_limit = probe_limit
        self.probe_granularity = probe_granularity
        self._last_dump_mtime = 0.0

    def describe(self) -> str:
        return (f"device: ms.runtime.memory_stats() totals; largest free block from "
                f"{'a fresh pool debug dump, else ' if self.largest in ('auto', 'dump') else ''}"
                f"{'a bounded allocation probe' if self.largest in ('auto', 'probe') else ''}"
                f"{'not measured' if self.largest == 'none' else ''}")

    def read(self) -> Reading:
        stats = self.api.memory_stats()
        reserved = int(stats.get("total_reserved_memory", 0))
        allocated = int(stats.get("total_allocated_memory", 0))
        capacity = self.api.capacity()
        blocks = block_bases(stats)
        extra = {"idle": int(stats.get("total_idle_memory", 0)),
                 "eager_free": int(stats.get("total_eager_free_memory", 0)),
                 "blocks": len(blocks),
                 "largest_block": max((b[1] for b in blocks), default=0)}
        device_free = None if capacity is None else max(capacity - reserved, 0)
        if self.largest in ("auto", "dump"):
            layout, path = self._fresh_dump(blocks)
            if layout is not None:
                reading = Reading.from_layout(layout)
                reading.device_free = device_free if device_free is not None else reading.device_free
                reading.extra.update(extra, largest_from=f"dump:{path.name}",
                                     dump_reserved=reading.reserved)
                # the stats are current; the dump is as of its writing
                reading.reserved, reading.allocated = reserved or reading.reserved, allocated or reading.allocated
                reading.free_total = reading.reserved - reading.allocated
                return reading
            if self.largest == "dump":
                return Reading(reserved, allocated, reserved - allocated, None, device_free, None,
                               dict(extra, largest_from="none: no fresh dump"))
        if self.largest in ("auto", "probe"):
            largest, tries = self._probe(min(reserved - allocated, extra["largest_block"] or reserved))
            extra.update(largest_from="probe", probe_allocations=tries)
            return Reading(reserved, allocated, reserved - allocated, largest, device_free, None, extra)
        return Reading(reserved, allocated, reserved - allocated, None, device_free, None,
                       dict(extra, largest_from="none"))

    def _fresh_dump(self, blocks) -> tuple[Layout | None, Path | None]:
        files = [(p.stat().st_mtime, p) for p in self.api.debug_dump_files() if p.exists()]
        if not files:
            return None, None
        mtime, path = max(files)
        if mtime <= self._last_dump_mtime:
            return None, None
        self._last_dump_mtime = mtime
        try:
            return read_pool_debug_dump(path), path
        except Exception as exc:  # an unreadable dump: this scan falls back to the probe
            logger.warning("cannot use the pool debug dump %s: %s: %s", path, type(exc).__name__, exc)
            return None, None

    def _probe(self, upper: int) -> tuple[int, int]:
        """Largest size (multiple of the granularity) the pool serves from a hole: binary search."""
        step = self.probe_granularity
        lo, hi = 0, max(upper, 0) // step
        tries = 0
        while lo < hi and tries < self.probe_limit:
            mid = (lo + hi + 1) // 2
            tries += 1
            if self.api.try_alloc(mid * step):
                lo = mid
            else:
                hi = mid - 1
        return lo * step, tries


# --- shadow model ------------------------------------------------------------------------------
_ITEMSIZE: dict = {}


def _itemsize(dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        import numpy as np
        from mindspore import dtype_to_nptype
        try:
            size = np.dtype(dtype_to_nptype(dtype)).itemsize
        except Exception:  # bfloat16 and other types numpy lacks
            size = 2 if "16" in str(dtype) else 4
        _ITEMSIZE[dtype] = size
    return size


def _nbytes(obj) -> int:
    """Bytes of a Tensor (from shape and dtype: no device sync), or of the Tensors inside a
    tuple/list/dict."""
    if obj is None:
        return 0
    shape, dtype = getattr(obj, "shape", None), getattr(obj, "dtype", None)
    if shape is not None and dtype is not None and not isinstance(obj, (tuple, list, dict)):
        count = 1
        for dim in shape:
            count *= int(dim)
        return count * _itemsize(dtype)
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    return 0


class ShadowModelSource(Source):
    """The process's real tensors replayed through an allocator model (``source: "model"``).

    Args:
        network: the Cell trained (``Model``'s train network, or your net); forward hooks are
            put on its leaf Cells (optimizers excluded) to see activation sizes.
        optimizer: its optimizer; parameters it holds beyond the network's are optimizer states.
        allocator: the model's name (``"mindspore"``) and ``options`` for it.
        capacity: device memory for the model, bytes (``None``: unbounded, no ``device_free``).

    Activations are seen only when hooks fire (PyNative); hooks are attached only for the
    steps that will be scanned (the first step, then the step before each scan re-arms them),
    so steps in between run without them. A step is replayed as: activations
    allocated in forward order, then freed in reverse order with the gradients allocated in
    between (backward), then the gradients freed after the optimizer; the scan measures the
    pool at the step's end, like a device scan would, and adds the step's peak in ``extra``.
    """

    name = "model"

    def __init__(self, network, optimizer=None, *, allocator: str = "mindspore", capacity: int | None = None,
                 options: dict | None = None) -> None:
        self.network = network
        self.optimizer = optimizer
        self.allocator_name = allocator
        self.model = create(allocator, capacity=capacity, **(options or {}))
        self._activations: list[int] = []
        self._last_step_activations: list[int] = []
        self._handles = []
        self._persistent_done = False
        self._grads: list[int] = []
        self._attach()

    def describe(self) -> str:
        return (f"model: the process's tensors (parameters, optimizer states, gradients, activations via "
                f"Cell forward hooks) replayed through the {self.allocator_name!r} allocator model")

    def _attach(self) -> None:
        from mindspore import nn
        if self.network is None or self._handles:
            return
        for _, cell in self.network.cells_and_names():
            if isinstance(cell, nn.Optimizer) or any(True for _ in cell.cells()):
                continue
            self._handles.append(cell.register_forward_hook(self._hook))

    def _hook(self, cell, inputs, outputs) -> None:
        self._activations.append(_nbytes(outputs))

    def step_end(self, step: int) -> None:
        """Called after every step: keep this step's activations, start the next list."""
        if self._activations:
            self._last_step_activations = self._activations
            self._activations = []

    def arm(self, active: bool) -> None:
        """Hooks on for a step that will be scanned, off otherwise."""
        if active:
            self._attach()
        else:
            self._detach()

    def _detach(self) -> None:
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:  # a handle of a freed Cell
                pass
        self._handles.clear()

    def _params(self) -> tuple[list[int], list[int]]:
        """(persistent sizes: parameters + optimizer states, gradient sizes)."""
        seen: dict[int, int] = {}
        grads: list[int] = []
        opt_params = set()
        if self.optimizer is not None:
            for p in getattr(self.optimizer, "parameters", ()) or ():
                opt_params.add(id(p))
        for cell in (self.network, self.optimizer):
            if cell is None:
                continue
            for p in cell.get_parameters():
                if id(p) not in seen:
                    seen[id(p)] = _nbytes(p)
        if opt_params:
            grads = [seen.get(id(p), _nbytes(p)) for p in self.optimizer.parameters]
        elif self.network is not None:
            grads = [_nbytes(p) for p in self.network.trainable_params()]
        return list(seen.values()), grads

    def layout(self) -> Layout:
        return self.model.layout()

    def read(self) -> Reading:
        model = self.model
        if not self._persistent_done:
            persistent, self._grads = self._params()
            for size in persistent:
                model.malloc(size, pool="persistent", tag="parameter")
            self._persistent_done = True
        acts = self._activations or self._last_step_activations
        peak_before = model.peak_allocated
        model.peak_allocated = model.allocated
        peak_reserved_before = model.reserved
        act_addrs = [model.malloc(size, tag="activation") for size in acts if size > 0]
        grads = list(reversed(self._grads))
        grad_addrs = []
        per_free = max(1, -(-len(grads) // max(1, len(act_addrs))))
        for addr in reversed(act_addrs):
            for _ in range(per_free):
                if grads:
                    grad_addrs.append(model.malloc(grads.pop(0), tag="gradient"))
            if addr is not None:
                model.free(addr)
        for size in grads:
            grad_addrs.append(model.malloc(size, tag="gradient"))
        step_peak = model.peak_allocated
        for addr in grad_addrs:
            if addr is not None:
                model.free(addr)
        model.peak_allocated = max(peak_before, step_peak)
        reading = Reading.from_metrics(model.metrics())
        reading.largest_free = model.largest_free() if model.virtual else reading.largest_free
        reading.extra.update(allocator=self.allocator_name, step_peak_allocated=step_peak,
                             peak_reserved=model.peak_reserved, reserved_growth=model.reserved - peak_reserved_before,
                             activations_observed=len(acts), activation_bytes=sum(acts),
                             gradient_bytes=sum(self._grads), model_ooms=len(model.ooms))
        return reading

    def close(self) -> None:
        self._detach()


# --- arenas --------------------------------------------------------------------------------------
class ArenaSource(Source):
    """ms-memopt-owned regions (pool mode, compaction arenas): their exact ``layout()`` merged."""

    name = "arena"

    def __init__(self, arenas: Sequence) -> None:
        if not arenas:
            raise InputError("the arena source needs at least one object with a layout() method", key="arenas")
        for arena in arenas:
            if not callable(getattr(arena, "layout", None)):
                raise InputError(f"{type(arena).__name__} has no layout() method", key="arenas")
        self.arenas = list(arenas)

    def describe(self) -> str:
        return f"arena: exact layout of {len(self.arenas)} ms-memopt region(s)"

    def read(self) -> Reading:
        segments = []
        capacity = 0
        known = True
        for arena in self.arenas:
            layout = arena.layout()
            segments.extend(layout.segments)
            if layout.capacity is None:
                known = False
            else:
                capacity += layout.capacity
        return Reading.from_layout(Layout(sorted(segments, key=lambda s: s.addr),
                                          capacity=capacity if known else None))


# --- choosing -----------------------------------------------------------------------------------
def make_sources(source: str | Source | Iterable[Source] = "auto", *, network=None, optimizer=None,
                 arenas: Sequence = (), device_api: DeviceMemoryAPI | None = None,
                 capacity: int | None = None, model_options: dict | None = None,
                 device_options: dict | None = None) -> tuple[list[Source], str]:
    """The sources to try, best first, and why the first was chosen.

    ``auto``: the device pool on Ascend/GPU; else the arenas when some are given; else the
    shadow model. The shadow model is always appended as a fallback when a network is known.

    Raises:
        InputError: unknown source name, or a named source that cannot work here.
    """
    if isinstance(source, Source):
        return [source], f"given source {source.name!r}"
    if not isinstance(source, str):
        sources = list(source)
        if not all(isinstance(s, Source) for s in sources):
            raise InputError("expected a source name or Source objects", key="source")
        return sources, "given sources"
    if source not in SOURCES:
        raise InputError(f"unknown source {source!r}; expected one of {', '.join(SOURCES)}", key="source")

    def shadow() -> ShadowModelSource:
        return ShadowModelSource(network, optimizer, capacity=capacity, **(model_options or {}))

    def device() -> DeviceSource:
        return DeviceSource(device_api, **(device_options or {}))

    if source == "device":
        return [device()], "source='device'"
    if source == "arena":
        return [ArenaSource(arenas)], "source='arena'"
    if source == "model":
        if network is None:
            raise InputError("the model source needs the network", key="source")
        return [shadow()], "source='model'"
    api = device_api or MindSporeDeviceAPI()
    try:
        target = api.device_target()
    except Exception as exc:  # no context yet: treat as CPU
        target = f"unknown ({exc})"
    chosen: list[Source] = []
    if target in ("Ascend", "GPU"):
        chosen.append(DeviceSource(api, **(device_options or {})))
        reason = f"auto: device target {target}, the pool's own statistics"
    elif arenas:
        chosen.append(ArenaSource(arenas))
        reason = f"auto: device target {target} has no pool statistics; ms-memopt arenas report exact layouts"
    else:
        reason = f"auto: device target {target} has no pool statistics; shadow allocator model"
    if network is not None:
        chosen.append(shadow())
    if not chosen:
        raise InputError("source='auto' found nothing to scan: pass the network, arenas or a Source", key="source")
    return chosen, reason


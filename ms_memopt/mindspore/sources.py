"""Live memory sources for layout scans: device pool (Ascend/GPU), shadow model, arenas.

* :class:`DeviceSource` — the real device pool. Totals from ``ms.runtime.memory_stats()``
  (reserved, allocated, idle, eager-free, pool blocks with their base addresses in
  ``blocks_info``). The largest free block, which no public MindSpore API returns, from:
  (1) the pool's debug dump ``MemoryDebugInfo<N>.txt`` when a fresh one exists (MindSpore
  writes it on allocation failure and, with ``MS_ALLOC_CONF`` ``defrag_memory_step_freq``
  containing ``dump``, at every defrag step), reconstructed into a layout by
  ``ms_memopt.io.traces.ms_debug_dump.read_pool_debug_dump``; else (2) a bounded allocation
  probe: a binary search over request sizes, each one allocated and freed right away (at most
  ``probe_limit`` tries, none larger than the idle memory). Every device call goes through a
  small :class:`DeviceMemoryAPI`, so tests can fake a device.
* :class:`ShadowModelSource` — anywhere (CPU included): the training process's real tensors
  fed as alloc/free events into an allocator model (``mindspore`` by default): parameters and
  optimizer states (persistent pool) once, then each scanned step's activations (outputs of
  leaf Cells, seen through forward hooks; inside a recompute group freed when the group
  returns, its recompute in backward replayed as one transient group) and gradients (one per
  trainable parameter), in the order a step makes them. Records say ``source: "model"``.
* :class:`ArenaSource` — ms-memopt-owned regions (pool mode, compaction arenas): their exact
  ``layout()``.

:func:`make_sources` turns ``source="auto" | "device" | "model" | "arena"`` into an ordered list
(the first is used, the others take over if it fails) and says why.
"""
from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ms_memopt.allocators import create
from ms_memopt.analysis.scan import Reading, Source
from ms_memopt.core.errors import InputError
from ms_memopt.core.layout import Layout
from ms_memopt.io.traces.ms_debug_dump import address_of, read_pool_debug_dump
from ms_memopt.mindspore.cells import is_outside_forward, split_training_cell

__all__ = ["DeviceMemoryAPI", "MindSporeDeviceAPI", "DeviceSource", "ShadowModelSource", "ObservedEvent",
           "ArenaSource", "make_sources", "SOURCES"]

logger = logging.getLogger("ms_memopt.analysis.scan")

SOURCES = ("auto", "device", "model", "arena", "pool-log")
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
        (without growing the pool). A try that grew the pool must give the growth back where
        the pool allows it, and set :attr:`growth_kept` when it could not."""
        raise NotImplementedError

    #: a probe grew the pool and the growth could not be given back (later probes would land in it)
    growth_kept: bool = False


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
        """The device's memory, capped by ``max_device_memory`` (what the pool may take)."""
        import mindspore as ms
        try:
            total = int(ms.hal.get_device_properties(0).total_memory)
        except Exception:  # not every backend reports it (CPU does not)
            return None
        try:
            cap = int(float(str(ms.get_context("max_device_memory")).upper().removesuffix("GB")) * (1 << 30))
        except (TypeError, ValueError):
            return total
        return min(total, cap)

    def debug_dump_files(self) -> list[Path]:
        roots = [self.tracker_dir] if self.tracker_dir else []
        roots.append(Path.cwd())
        found = []
        for root in roots:
            found += [Path(p) for p in glob.glob(str(root / "**" / "MemoryDebugInfo*.txt"), recursive=True)]
        return own_rank_dumps(found, _this_rank())

    def try_alloc(self, nbytes: int) -> bool:
        import mindspore as ms
        from mindspore import mint
        before = self.memory_stats().get("total_reserved_memory", 0)
        tensor = mint.empty((nbytes,), dtype=ms.uint8)
        grown = self.memory_stats().get("total_reserved_memory", 0) > before
        del tensor
        if grown:
            # give the block back (the enhanced pool frees idle blocks; the best-fit pool keeps
            # it and only warns, so probing must stop: later tries would land in it)
            ms.runtime.empty_cache()
            self.growth_kept = self.memory_stats().get("total_reserved_memory", 0) > before
        return not grown


def _this_rank() -> int:
    for name in ("RANK_ID", "MS_NODE_ID", "RANK"):
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 0


def own_rank_dumps(paths: list[Path], rank: int) -> list[Path]:
    """The dumps of this rank: a dump under a ``rank_N`` folder of another rank is not ours.

    Example:
        >>> [str(p) for p in own_rank_dumps([Path("t/rank_0/a.txt"), Path("t/rank_1/b.txt"), Path("c.txt")], 1)]
        ['t/rank_1/b.txt', 'c.txt']
    """
    out = []
    for path in paths:
        ranks = [part for part in path.parts if part.startswith("rank_") and part[5:].isdigit()]
        if not ranks or int(ranks[-1][5:]) == rank:
            out.append(path)
    return out


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
        vmm: the pool maps memory on demand (``PoolInfo.vmm``): no dump or probe is read, a
            probe would only measure mapped idle pages; ``largest_free`` is what can still be
            mapped, ``capacity - allocated`` (eager-freed pages count as free), and
            ``extra.largest_from`` says so.
    """

    name = "device"

    def __init__(self, api: DeviceMemoryAPI | None = None, *, largest: str = "auto", probe_limit: int = 16,
                 probe_granularity: int = 2 * MiB, vmm: bool = False) -> None:
        if largest not in ("auto", "dump", "probe", "none"):
            raise InputError(f"largest must be auto, dump, probe or none, got {largest!r}", key="largest")
        self.api = api or MindSporeDeviceAPI()
        self.largest = largest
        self.probe_limit = probe_limit
        self.probe_granularity = probe_granularity
        self.vmm = vmm
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
        if self.vmm:
            mappable = None if capacity is None else max(capacity - allocated, 0)
            return Reading(reserved, allocated, reserved - allocated, mappable, device_free, None,
                           dict(extra, largest_from="vmm: capacity - allocated, what can still be mapped; "
                                                    "holes do not decide OOMs under VMM"))
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
        if self.largest in ("auto", "probe") and self.api.growth_kept:
            return Reading(reserved, allocated, reserved - allocated, None, device_free, None,
                           dict(extra, largest_from="none: a probe grew the pool and the pool kept the block, "
                                                    "so probing stopped"))
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
                if self.api.growth_kept:   # the next tries would land in the block this one grew
                    break
        return lo * step, tries


# --- shadow model ------------------------------------------------------------------------------
_ITEMSIZE: dict = {}


def _itemsize(dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        from mindspore.common.dtype import type_size_in_bytes
        try:
            size = int(type_size_in_bytes(dtype))
        except Exception:  # not a MindSpore dtype
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


def _tensors(obj) -> list:
    """The Tensors in a Cell's inputs (a tuple, possibly nested)."""
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return [obj] if getattr(obj, "shape", None) is not None and getattr(obj, "dtype", None) is not None else []


def _recompute_machinery(network) -> set[int]:
    """ids of the Cells MindSpore adds for ``Cell.recompute()`` (a ``_RecomputeCell`` and its
    ``_WrapCell``): they re-enter the recomputed Cell's ``construct`` and are no layer of the
    model (hooked as a leaf, the ``_WrapCell`` counted each group's output once in forward and
    once more in backward)."""
    machinery: set[int] = set()
    for _, cell in network.cells_and_names():
        inner = getattr(cell, "_recompute_cell", None)
        if inner is not None and hasattr(inner, "cells_and_names"):
            machinery.update(id(c) for _, c in inner.cells_and_names())
    return machinery


def _leaves_and_groups(network) -> tuple[list[tuple[str, object, str | None]], list[tuple[str, object]]]:
    """``([(leaf name, leaf, group name or None)], [(group name, group)])``; optimizers and
    learning-rate schedules excluded (:func:`~ms_memopt.mindspore.cells.is_outside_forward`).

    A *group* is an outermost Cell with ``Cell.recompute()`` set (``_recompute_cell``, e.g. pool
    mode's ``RecomputeGroup``) that holds Cells; its leaves carry its name. A leaf that itself
    has recompute set stays an ordinary leaf: MindSpore keeps a recomputed Cell's output.
    Names are the Cells' paths in ``network`` (``network.blocks.0.layers.1.fc1``).
    """
    machinery = _recompute_machinery(network)
    leaves: list = []
    groups: list = []
    seen: set[int] = set()

    def walk(name: str, cell, group: str | None) -> None:
        if id(cell) in seen or id(cell) in machinery or is_outside_forward(cell):
            return
        seen.add(id(cell))
        children = [(n, c) for n, c in cell.name_cells().items() if id(c) not in machinery]
        if not children:
            leaves.append((name, cell, group))
            return
        if group is None and getattr(cell, "_recompute_cell", None) is not None:
            group = name
            groups.append((name, cell))
        for child_name, child in children:
            walk(f"{name}.{child_name}" if name else child_name, child, group)

    walk("", network, None)
    return leaves, groups


@dataclass
class ObservedEvent:
    """One thing the shadow source's hooks saw during a step, in the order it happened.

    ``kind``:

    * ``"output"``: a leaf Cell's output outside any recompute group (kept until backward);
    * ``"group_enter"``: a recompute group starts its forward; ``nbytes`` = its tensor inputs
      not already kept by an earlier group this forward (the boundary it keeps for backward);
    * ``"group_output"``: a leaf's output inside a group's forward (freed when the group returns);
    * ``"group_exit"``: the group returned in forward;
    * ``"recompute"``: a leaf's output inside a group while that group is not running its
      forward: the group being recomputed in backward.

    ``cell`` is the path of the Cell that made it in the network (the group's for enter/exit),
    ``group`` the recompute group's path or ``None``; ``nbytes`` from shape and dtype.
    """

    kind: str
    cell: str
    group: str | None
    nbytes: int


FORWARD_OUTPUTS = ("output", "group_output")


class _GroupRun:
    """One forward run of a recompute group in the replayed step (allocator addresses inside)."""

    def __init__(self, boundary: int, addr) -> None:
        self.boundary, self.addr = boundary, addr
        self.inner: list[tuple[int, object]] = []     # (bytes, addr) alive during its forward
        self.forward_sizes: list[int] = []
        self.recomputed: list[int] = []


class ShadowModelSource(Source):
    """The process's real tensors replayed through an allocator model (``source: "model"``).

    Args:
        network: the Cell trained (``Model``'s train network, or your net). When it is a
            train-one-step cell (``network`` and ``optimizer`` attributes, e.g. MindFormers'
            ``MFTrainOneStepCell``) hooks go on its inner network and gradients are that
            network's trainable parameters (:func:`~ms_memopt.mindspore.cells.split_training_cell`).
            Forward hooks are put on the leaf Cells (optimizers and learning-rate schedules
            excluded) to see activation sizes, on its
            recompute groups (Cells with ``Cell.recompute()`` set, e.g. pool mode's
            ``RecomputeGroup``) to see where each group's forward starts and ends, and a
            pre-hook on ``network`` itself to see a forward start.
        optimizer: its optimizer; parameters it holds beyond the network's are optimizer states.
        allocator: the model's name (``"mindspore"``) and ``options`` for it.
        capacity: device memory for the model, bytes (``None``: unbounded, no ``device_free``).

    **Graph mode** (``GRAPH_MODE``, MindFormers' usual mode): no hook is attached, because
    MindSpore compiles a Cell's hooks into the graph (a Python hook of ours made the compile
    fail). Scans then replay parameters, optimizer states and gradients only, and the reading
    says ``activations: "not observed: graph mode"``.

    Activations are seen only when hooks fire (PyNative); hooks are attached only for the
    steps that will be scanned (the first step, then the step before each scan re-arms them),
    so steps in between run without them. Each hook records which Cell made the output
    (:class:`ObservedEvent`, :meth:`observed`); an output that *is* one of the Cell's inputs
    (``Passthrough``, ``nn.Identity``) is no new tensor and is not recorded. Tensors made by
    functional ops inside a ``construct`` (attention scores, residual adds) are not Cell
    outputs and are not seen: compare figures of this source with each other (with / without
    recompute), not with the estimator's bytes.

    A step is replayed as: activations allocated in forward order, except that inside a
    recompute group the outputs are freed when the group returns and only the group's tensor
    inputs (its boundary) stay; then backward, in reverse order: a plain activation is freed
    (gradients allocated in between); a group allocates what its recompute made (the outputs
    seen again during backward; its forward outputs if none were seen), frees them, then its
    boundary. The peak is thus the kept boundaries plus one group, the composition of
    ``ms_memopt.analysis.estimate.recompute_group_bytes``; without recompute it is every output.
    Gradients are freed after the optimizer; the scan measures the pool at the step's end,
    like a device scan would, and adds the step's peak and the activation figures in ``extra``.

    Forward or recompute: a group's own hooks fire only around its forward call (MindSpore
    2.10 recomputes by calling the group's ``construct`` from the backward pass, not the
    Cell; a test pins this), so a leaf of a group that fires while its group is not inside
    its forward is being recomputed. As a guard for versions that would call the Cell again,
    a group entered a second time in one forward (since the network's pre-hook or
    :meth:`step_end`) counts as recomputing too; a shared group called twice in one forward
    would be misread that way.
    """

    name = "model"

    def __init__(self, network, optimizer=None, *, allocator: str = "mindspore", capacity: int | None = None,
                 options: dict | None = None) -> None:
        parts = split_training_cell(network, optimizer)
        self.network = network
        self.forward_network = parts.network
        self.optimizer = parts.optimizer
        self.allocator_name = allocator
        self.model = create(allocator, capacity=capacity, **(options or {}))
        self._events: list[ObservedEvent] = []
        self._last_step_events: list[ObservedEvent] = []
        self._group_state: dict[str, str] = {}   # group name -> "forward" | "done" | "recompute"
        self._kept_inputs: set[int] = set()       # ids of tensors a group already keeps this forward
        self._handles = []
        self._persistent_done = False
        self._grads: list[int] = []
        self._attach()

    def describe(self) -> str:
        return (f"model: the process's tensors (parameters, optimizer states, gradients, activations via "
                f"Cell forward hooks, recompute groups keeping only their inputs) replayed through the "
                f"{self.allocator_name!r} allocator model")

    # --- hooks ---------------------------------------------------------------------------------
    @staticmethod
    def graph_mode() -> bool:
        """True when Cells run compiled (``GRAPH_MODE``): hooks would be compiled into the graph."""
        import mindspore as ms
        return ms.get_context("mode") == ms.GRAPH_MODE

    def _attach(self) -> None:
        if self.forward_network is None or self._handles or self.graph_mode():
            return
        leaves, groups = _leaves_and_groups(self.forward_network)
        if groups:  # only needed to tell a new forward from a recompute
            self._handles.append(self.forward_network.register_forward_pre_hook(self._forward_begins))
        for name, group in groups:
            self._handles.append(group.register_forward_pre_hook(self._group_enter_hook(name)))
            self._handles.append(group.register_forward_hook(self._group_exit_hook(name)))
        for name, leaf, group in leaves:
            self._handles.append(leaf.register_forward_hook(self._leaf_hook(name, group)))

    def _forward_begins(self, cell, inputs) -> None:
        self._group_state.clear()
        self._kept_inputs.clear()

    def _group_enter_hook(self, name: str):
        def hook(cell, inputs) -> None:
            if name in self._group_state:  # entered before in this forward: a recompute
                self._group_state[name] = "recompute"
                return
            self._group_state[name] = "forward"
            fresh = {id(t): t for t in _tensors(inputs) if id(t) not in self._kept_inputs}
            self._kept_inputs.update(fresh)
            self._events.append(ObservedEvent("group_enter", name, name, sum(_nbytes(t) for t in fresh.values())))
        return hook

    def _group_exit_hook(self, name: str):
        def hook(cell, inputs, outputs) -> None:
            if self._group_state.get(name) == "forward":
                self._events.append(ObservedEvent("group_exit", name, name, 0))
            self._group_state[name] = "done"
        return hook

    def _leaf_hook(self, name: str, group: str | None):
        def hook(cell, inputs, outputs) -> None:
            if any(outputs is arg for arg in inputs):
                return
            if group is None:
                kind = "output"
            else:
                kind = "group_output" if self._group_state.get(group) == "forward" else "recompute"
            self._events.append(ObservedEvent(kind, name, group, _nbytes(outputs)))
        return hook

    def step_end(self, step: int) -> None:
        """Called after every step: keep this step's observations, start the next list."""
        if self._events:
            self._last_step_events = self._events
            self._events = []
        self._forward_begins(None, ())

    def observed(self) -> list[ObservedEvent]:
        """What the hooks saw of the current step (or, when nothing yet, of the last one)."""
        return list(self._events or self._last_step_events)

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

    # --- replay ------------------------------------------------------------------------------
    def _params(self) -> tuple[list[int], list[int]]:
        """(persistent sizes: parameters + optimizer states, gradient sizes).

        Gradients: one per trainable parameter of the forward network; without a network,
        one per parameter the optimizer updates. Never the optimizer's own states (a
        train-one-step cell's ``trainable_params()`` also lists ``adam_m``/``adam_v``)."""
        seen: dict[int, int] = {}
        for cell in (self.network, self.optimizer):
            if cell is None:
                continue
            for p in cell.get_parameters():
                if id(p) not in seen:
                    seen[id(p)] = _nbytes(p)
        if self.forward_network is not None:
            grads = [_nbytes(p) for p in self.forward_network.trainable_params()]
        else:
            grads = [_nbytes(p) for p in getattr(self.optimizer, "parameters", ()) or ()]
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
        events = self.observed()
        peak_before = model.peak_allocated
        model.peak_allocated = model.allocated
        peak_reserved_before = model.reserved
        replay = _ActivationReplay(model)
        kept = replay.forward(events)
        kept_bytes = replay.live
        grad_addrs = replay.backward(kept, list(reversed(self._grads)))
        step_peak = model.peak_allocated
        for addr in grad_addrs:
            if addr is not None:
                model.free(addr)
        model.peak_allocated = max(peak_before, step_peak)
        forward = [e.nbytes for e in events if e.kind in FORWARD_OUTPUTS]
        reading = Reading.from_metrics(model.metrics())
        reading.largest_free = model.largest_free() if model.virtual else reading.largest_free
        reading.extra.update(allocator=self.allocator_name, step_peak_allocated=step_peak,
                             peak_reserved=model.peak_reserved, reserved_growth=model.reserved - peak_reserved_before,
                             activations_observed=len(forward), activation_bytes=sum(forward),
                             activation_peak_bytes=replay.peak, activation_kept_bytes=kept_bytes,
                             activations_recomputed=sum(1 for e in events if e.kind == "recompute"),
                             recompute_groups=sum(1 for e in events if e.kind == "group_enter"),
                             gradient_bytes=sum(self._grads), model_ooms=len(model.ooms))
        if not self._handles and self.graph_mode():
            reading.extra["activations"] = "not observed: graph mode (Cell hooks would be compiled into the graph)"
        return reading

    def close(self) -> None:
        self._detach()


class _ActivationReplay:
    """One step's activations through an allocator model; ``live``/``peak`` in bytes.

    ``live`` counts the activation bytes the step holds (requested sizes, also when the
    model could not place them), ``peak`` its largest value.
    """

    def __init__(self, model) -> None:
        self.model = model
        self.live = 0
        self.peak = 0

    def _alloc(self, size: int):
        self.live += size
        self.peak = max(self.peak, self.live)
        return self.model.malloc(size, tag="activation")

    def forward(self, events: list[ObservedEvent]) -> list:
        """Allocate in forward order; returns what stays for backward, in forward order:
        ``(bytes, addr)`` for a plain output, a :class:`_GroupRun` per group forward."""
        kept: list = []
        running: dict[str, _GroupRun] = {}
        last: dict[str, _GroupRun] = {}
        for event in events:
            if event.kind == "output" or (event.kind == "group_output" and event.group not in running):
                if event.nbytes > 0:
                    kept.append((event.nbytes, self._alloc(event.nbytes)))
            elif event.kind == "group_enter":
                run = _GroupRun(event.nbytes, self._alloc(event.nbytes) if event.nbytes > 0 else None)
                kept.append(run)
                running[event.group] = last[event.group] = run
            elif event.kind == "group_output":
                run = running[event.group]
                run.forward_sizes.append(event.nbytes)
                if event.nbytes > 0:
                    run.inner.append((event.nbytes, self._alloc(event.nbytes)))
            elif event.kind == "group_exit" and event.group in running:
                run = running.pop(event.group)
                self._free_all(run.inner)
                run.inner = []
            elif event.kind == "recompute" and event.group in last:
                last[event.group].recomputed.append(event.nbytes)
        return kept

    def _free_all(self, blocks) -> None:
        for size, addr in reversed(blocks):
            self.live -= size
            if addr is not None:
                self.model.free(addr)

    def backward(self, kept: list, grads: list[int]) -> list:
        """Free in reverse, each group recomputed first; gradients (sizes, in the order they
        are made) allocated evenly in between. Returns the gradients' addresses."""
        frees = 0
        for entry in kept:
            if isinstance(entry, _GroupRun):
                redo = entry.recomputed or entry.forward_sizes
                frees += len(entry.inner) + sum(1 for s in redo if s > 0) + (entry.boundary > 0)
            else:
                frees += 1
        per_free = max(1, -(-len(grads) // max(1, frees)))
        grad_addrs = []

        def release(size: int, addr) -> None:
            for _ in range(per_free):
                if grads:
                    grad_addrs.append(self.model.malloc(grads.pop(0), tag="gradient"))
            self.live -= size
            if addr is not None:
                self.model.free(addr)

        for entry in reversed(kept):
            if not isinstance(entry, _GroupRun):
                release(*entry)
                continue
            for block in reversed(entry.inner):  # a forward whose group_exit was not seen
                release(*block)
            redo = [(s, self._alloc(s)) for s in (entry.recomputed or entry.forward_sizes) if s > 0]
            for block in reversed(redo):
                release(*block)
            if entry.boundary > 0:
                release(entry.boundary, entry.addr)
        for size in grads:
            grad_addrs.append(self.model.malloc(size, tag="gradient"))
        return grad_addrs


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
def _pool_log():
    """A source on this process's pool log when :mod:`ms_memopt.mindspore.poolcapture` follows it."""
    from ms_memopt.mindspore import poolcapture
    from ms_memopt.mindspore.pool_log_source import PoolLogSource
    return PoolLogSource() if poolcapture.active() is not None else None


def _pool_log_missing() -> str:
    from ms_memopt.mindspore import poolcapture
    return poolcapture.unavailable_reason()


def make_sources(source: str | Source | Iterable[Source] = "auto", *, network=None, optimizer=None,
                 arenas: Sequence = (), device_api: DeviceMemoryAPI | None = None,
                 capacity: int | None = None, model_options: dict | None = None,
                 device_options: dict | None = None) -> tuple[list[Source], str]:
    """The sources to try, best first, and why the first was chosen.

    ``auto``: the device pool on Ascend/GPU; else the arenas when some are given; else (CPU)
    the real pool followed live from its log when :func:`ms_memopt.mindspore.poolcapture.start` ran
    before ``import mindspore`` (``ms-memopt run`` and ``make demo`` do); else the shadow
    model. The shadow model is always appended as a fallback when a network is known.

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
    if source == "pool-log":
        from ms_memopt.mindspore.pool_log_source import PoolLogSource
        try:
            return [PoolLogSource()], "source='pool-log'"
        except ValueError as exc:
            raise InputError(str(exc), key="source") from None
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
        options = dict(device_options or {})
        if target == "Ascend" and "vmm" not in options:
            from ms_memopt.mindspore.pool_info import detect_pool
            options["vmm"] = detect_pool(device=target).vmm
        chosen.append(DeviceSource(api, **options))
        reason = f"auto: device target {target}, the pool's own statistics"
    elif arenas:
        chosen.append(ArenaSource(arenas))
        reason = f"auto: device target {target} has no pool statistics; ms-memopt arenas report exact layouts"
    elif (real_pool := _pool_log()) is not None:
        chosen.append(real_pool)
        reason = f"auto: device target {target}; the real pool, followed live from its log (VLOG_v=12906)"
    else:
        reason = (f"auto: device target {target} has no pool statistics and the real pool's log is not "
                  f"captured ({_pool_log_missing()}); shadow allocator model")
    if network is not None:
        chosen.append(shadow())
    if not chosen:
        raise InputError("source='auto' found nothing to scan: pass the network, arenas or a Source", key="source")
    return chosen, reason


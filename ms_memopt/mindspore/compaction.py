"""Live compaction of a MindSpore job, the ``CompactionCallback`` and a bounded barrier.

**Live compaction** (:func:`live_compact`) relocates a job's long-lived tensors — parameters,
optimizer states, anything :func:`register`-ed — through public MindSpore APIs:

1. *evacuate*: a host copy of every tensor (``asnumpy``);
2. *release*: drop each tensor's device storage (``untyped_storage().resize_(0)``) and let the
   pool give idle memory back (``mindspore.runtime.empty_cache()``);
3. *restore* in a planned order (largest first by default, so they land together at low
   addresses of a best-fit pool) with ``Parameter.set_data(new_tensor)``: the Parameter
   objects stay the same, so every reference (network, optimizer, your code) stays valid;
4. *recompile*: compiled graphs keep the device storage their weights had when they were
   compiled. PyNative: graphs compiled by ``@jit`` — the optimizers' ``construct``, a
   ``jit``-decorated train step — would keep updating the old storage after ``set_data``
   (seen on CPU: the weights froze, or an error when that storage was released). Graph mode:
   the runtime re-binds a weight whose value was replaced, but kernels of the compiled graph
   may still read the released storage (MindFormers' LLaMA under ``Trainer``, CPU: "For
   TensorMove, the size of 'input' and the size of 'output' should be same" at the next
   step). The public ``mindspore.ms_memory_recycle()`` drops every compiled graph, so each
   recompiles against the new storage on its next call; this is done whenever storage was
   released (and always in PyNative). The price is one compilation at the next step (tiny
   LLaMA on CPU: ~8-14 s against ~30 ms steps; see docs/compaction.md).
5. *verify* (default): every tensor reads back its host copy bit for bit.

An exception while restoring puts every not-yet-restored tensor back from its host copy before
it propagates, so no live tensor is lost.

**CompactionCallback** runs it every ``every`` steps (optionally only when a fragmentation
reading exceeds a threshold), also compacts registered :class:`~ms_memopt.analysis.arena.Arena`s, and
under ``msrun`` puts every rank behind a :class:`StoreBarrier` first: all ranks agree to
compact at the same step (if any rank wants to, all do), no rank moves memory while a
collective of another rank is in flight, and a rank that does not arrive within
``barrier_timeout`` seconds makes the others fail with :class:`BarrierTimeout` instead of
hanging. Each compaction appends a ``"kind": "compaction"`` record to the scan log.

Verified on CPU (MindSpore 2.10, PyNative and ``Model.train``; 2 workers under ``msrun``);
untested on Ascend.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor
from mindspore.train import Callback

from ms_memopt.analysis.arena import Arena
from ms_memopt.analysis.scan import SCAN_LOG_NAME, ScanLog, check_forecast_within, record_mark, recording
from ms_memopt.core.errors import InputError
from ms_memopt.core.metrics import measure
from ms_memopt.mindspore.cells import training_parts
from ms_memopt.mindspore.pool_info import PoolInfo, detect_pool
from ms_memopt.mindspore.pool_log_source import wait_for_queued_ops
from ms_memopt.mindspore.regions import is_pinned

__all__ = ["live_compact", "restore_regions", "LiveCompactionReport", "register", "unregister", "registered",
           "long_lived_tensors", "CompactionCallback", "StoreBarrier", "BarrierTimeout",
           "CompactionError", "MindSporeArenaBackend"]

logger = logging.getLogger("ms_memopt.analysis.compaction")


class CompactionError(RuntimeError):
    """A compaction could not run safely, or a tensor read back different bytes."""


class BarrierTimeout(RuntimeError):
    """Not every rank reached the compaction barrier in time (a rank died or hung)."""


# --- the registry -----------------------------------------------------------------------------

# weak: registering a Parameter does not keep it alive
_REGISTRY: "weakref.WeakValueDictionary[int, Parameter]" = weakref.WeakValueDictionary()


def register(*tensors: Parameter) -> None:
    """Make ``tensors`` (Parameters) part of every live compaction, beside the network's.
    The registry holds weak references: a Parameter nobody else holds drops out."""
    for t in tensors:
        if not isinstance(t, Parameter):
            raise TypeError(f"only Parameters can be relocated in place, got {type(t).__name__}")
        _REGISTRY[id(t)] = t


def unregister(*tensors: Parameter) -> None:
    for t in tensors:
        _REGISTRY.pop(id(t), None)


def registered() -> list[Parameter]:
    return list(_REGISTRY.values())


def long_lived_tensors(*cells: Any, extra: Iterable[Parameter] = ()) -> list[Parameter]:
    """The Parameters of ``cells`` (a network, a train-one-step cell, an optimizer: their
    weights and optimizer states), then ``extra`` and the registered ones, each once."""
    seen: dict[int, Parameter] = {}
    for cell in cells:
        if cell is None:
            continue
        params = cell.get_parameters() if hasattr(cell, "get_parameters") else cell
        for p in params:
            seen.setdefault(id(p), p)
    for p in list(extra) + registered():
        seen.setdefault(id(p), p)
    return list(seen.values())


def restore_regions(*cells: Any) -> bool:
    """Ask every optimizer among ``cells`` and their sub-cells that keeps contiguous regions
    (:class:`~ms_memopt.mindspore.fused_adamw.FusedAdamW`: ``restore_regions()``) to bring
    back tensors that were given their own storage (a checkpoint load's ``set_data``); returns
    whether any moved. The values are copied into the region, which is never formed a second
    time. When anything moved, compiled graphs are dropped so that they bind to the regions
    again (graph mode has no Python step that would notice).

    Live compaction itself leaves region members where they are (:mod:`.regions`).
    """
    seen: set[int] = set()
    moved = False
    for cell in cells:
        if cell is None or not hasattr(cell, "cells_and_names"):
            continue
        for _, sub in cell.cells_and_names():
            restore = getattr(sub, "restore_regions", None)
            if id(sub) in seen or not callable(restore):
                continue
            seen.add(id(sub))
            moved = bool(restore()) or moved
    if moved:
        _recompile_graphs()
    return moved


# --- live compaction --------------------------------------------------------------------------

@dataclass
class LiveCompactionReport:
    """One live compaction; sizes in bytes, times in seconds. ``device_*`` come from
    ``mindspore.runtime.memory_reserved/allocated`` (0 on CPU)."""

    tensors: int
    bytes: int
    #: tensors left where they are: members of a region ``FusedAdamW`` or pool mode formed
    skipped_in_regions: int = 0
    seconds: float = 0.0
    evacuate_seconds: float = 0.0
    restore_seconds: float = 0.0
    verified: bool = False
    recompiled: bool = False
    device_reserved_before: int = 0
    device_reserved_after: int = 0
    device_allocated_before: int = 0
    device_allocated_after: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _device_target() -> str:
    try:
        return ms.get_context("device_target")
    except Exception:  # pragma: no cover - very old contexts
        return "CPU"


def _memory(kind: str) -> int:
    try:
        return int(getattr(ms.runtime, f"memory_{kind}")())
    except Exception:
        return 0


def _recompile_graphs() -> None:
    """Make every ``@jit`` graph recompile on its next call, against its weights' current
    storage. ``mindspore.ms_memory_recycle`` (public) deletes the compiled graphs and their
    resources (it is meant for releasing a finished model's graphs); PyNative op and grad
    caches are cleared too, which is safe between steps."""
    ms.ms_memory_recycle()


def _synchronize() -> None:
    """Wait for the device's streams (there are none to wait for on CPU, where
    ``mindspore.runtime.synchronize`` only logs "CPU device is not supported")."""
    if _device_target() != "CPU":
        ms.runtime.synchronize()


def _pynative() -> bool:
    return ms.get_context("mode") == ms.PYNATIVE_MODE


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equality (NaN payloads and -0.0 included), any dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return np.array_equal(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                          np.ascontiguousarray(b).reshape(-1).view(np.uint8))


def live_compact(tensors: Sequence[Parameter], *, order: str = "size", verify: bool = True,
                 release: bool = True, recompile: bool | None = None) -> LiveCompactionReport:
    """Relocate ``tensors`` (Parameters) so they land together in freshly allocated memory.

    Call between steps (after the optimizer, before the next forward), with no computation in
    flight. ``order``: ``"size"`` (largest first) or ``"given"``. ``release=False`` skips
    dropping the old storage first (the new copies are then allocated beside the old ones).
    ``recompile``: make compiled graphs recompile afterwards (``mindspore.ms_memory_recycle``);
    ``None`` (default) does so when it is needed: in PyNative (``@jit`` graphs keep the old
    storage) and, in graph mode, whenever the old storage was released (``release=True``).

    Example:
        >>> net = mindspore.nn.Dense(4, 2)                                   # doctest: +SKIP
        >>> live_compact(long_lived_tensors(net)).bytes                     # doctest: +SKIP
        40
    """
    params = list({id(t): t for t in tensors}.values())
    for p in params:
        if not isinstance(p, Parameter):
            raise TypeError(f"only Parameters can be relocated in place, got {type(p).__name__}")
    # a region member shares its storage with the whole region: never relocated on its own
    pinned = [p for p in params if is_pinned(p)]
    params = [p for p in params if not is_pinned(p)]
    if not params:
        return LiveCompactionReport(tensors=0, bytes=0, skipped_in_regions=len(pinned))
    if order not in ("size", "given"):
        raise ValueError(f"order must be 'size' or 'given', got {order!r}")
    if recompile is None:
        recompile = release or _pynative()
    t0 = time.perf_counter()
    _synchronize()
    reserved_before, allocated_before = _memory("reserved"), _memory("allocated")
    hosts = [p.asnumpy().copy() for p in params]
    t1 = time.perf_counter()
    sequence = list(range(len(params)))
    if order == "size":
        sequence.sort(key=lambda i: -hosts[i].nbytes)
    restored: set[int] = set()
    try:
        if release:
            for p in params:
                p.untyped_storage().resize_(0)
            ms.runtime.empty_cache()
        target = _device_target()
        for i in sequence:
            fresh = Tensor(hosts[i])
            if target != "CPU" and hasattr(fresh, "move_to"):
                fresh = fresh.move_to(target, blocking=True)   # allocate now, in plan order
            params[i].set_data(fresh)
            restored.add(i)
    except BaseException:
        for i in range(len(params)):
            if i not in restored:
                try:
                    params[i].set_data(Tensor(hosts[i]))
                except Exception:  # pragma: no cover - nothing more we can do
                    logger.exception("could not restore %s from its host copy", params[i].name)
        if recompile:
            _recompile_graphs()   # some tensors did move: the graphs must not keep the old storage
        raise
    if recompile:
        _recompile_graphs()
    t2 = time.perf_counter()
    if verify:
        for p, h in zip(params, hosts):
            if not _same_bits(p.asnumpy(), h):
                raise CompactionError(f"parameter {p.name} changed during compaction")
    return LiveCompactionReport(
        tensors=len(params), bytes=int(sum(h.nbytes for h in hosts)), skipped_in_regions=len(pinned),
        seconds=time.perf_counter() - t0, evacuate_seconds=t1 - t0, restore_seconds=t2 - t1,
        verified=verify, recompiled=bool(recompile),
        device_reserved_before=reserved_before, device_reserved_after=_memory("reserved"),
        device_allocated_before=allocated_before, device_allocated_after=_memory("allocated"))


# --- an arena on a MindSpore tensor ------------------------------------------------------------

class MindSporeArenaBackend:
    """An :class:`~ms_memopt.analysis.arena.Arena` backend on one ``uint8`` MindSpore tensor (device
    memory on Ascend).

    ``move`` copies slice to slice with ``__setitem__``. MindSpore's slice copy refuses
    overlapping ranges (CPU: "memcpy_s error"), so an overlapping move goes in chunks no longer
    than the shift (no chunk overlaps its own source; ascending when moving down), or, when
    that would take more than ``max_chunks`` copies, through a staging clone of the source.
    ``view`` returns a tensor sharing the buffer (``__setitem__`` on it reaches the buffer; on
    CPU other in-place ops on views do not — see ../shared/MINDSPORE_NOTES.md).
    """

    def __init__(self, capacity: int, *, max_chunks: int = 8) -> None:
        self.capacity = int(capacity)
        self.max_chunks = max_chunks
        self.buffer = ms.ops.zeros((self.capacity,), ms.uint8)

    def move(self, src: int, dst: int, nbytes: int) -> None:
        if src < 0 or dst < 0 or src + nbytes > self.capacity or dst + nbytes > self.capacity:
            raise IndexError(f"move of {nbytes} bytes {src:#x} -> {dst:#x} leaves the arena")
        if nbytes == 0 or src == dst:
            return
        shift = abs(src - dst)
        if shift >= nbytes:
            self.buffer[dst:dst + nbytes] = self.buffer[src:src + nbytes]
            return
        if -(-nbytes // shift) > self.max_chunks:
            staged = ms.mint.clone(self.buffer[src:src + nbytes])
            self.buffer[dst:dst + nbytes] = staged
            return
        # overlapping: ascending chunks when moving down, descending when moving up
        starts = range(0, nbytes, shift) if dst < src else reversed(range(0, nbytes, shift))
        for offset in starts:
            length = min(shift, nbytes - offset)
            self.buffer[dst + offset:dst + offset + length] = self.buffer[src + offset:src + offset + length]

    def view(self, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> Tensor:
        return self.buffer[offset:offset + nbytes].view(_ms_dtype(dtype)).reshape(shape)

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buffer[offset:offset + nbytes].asnumpy().copy()

    def write(self, offset: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.buffer[offset:offset + raw.size] = Tensor(raw)


def _ms_dtype(dtype: Any) -> Any:
    """A numpy dtype (or name) as a MindSpore dtype; MindSpore dtypes pass through."""
    if isinstance(dtype, ms.dtype.Type):
        return dtype
    return ms.dtype.pytype_to_dtype(np.dtype(dtype).type)


# --- a barrier that cannot hang ----------------------------------------------------------------

def _call_with_deadline(fn: Callable[[], Any], seconds: float, what: str) -> Any:
    """Run ``fn`` in a daemon thread; raise :class:`BarrierTimeout` if it takes longer (a store
    call to a dead peer may block; a daemon thread does not keep the process alive)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name="ms_memopt-barrier", daemon=True)
    thread.start()
    thread.join(max(seconds, 0.0))
    if thread.is_alive():
        raise BarrierTimeout(f"{what}: no answer within {seconds:.1f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


#: the TCPStore this process opened for each (host, port); see :func:`_process_store`
_STORES: dict[tuple[str, int], Any] = {}
#: one lock per address, held while its store is opened: a retry after a timed-out connection
#: waits for the first attempt (still running in its daemon thread) instead of opening a second
#: store on the same port; other addresses do not wait for it
_OPENING: dict[tuple[str, int], threading.Lock] = {}
_OPENING_LOCK = threading.Lock()
#: how many barriers this process made for each (host, port, prefix): their keys never meet
_BARRIERS_MADE: dict[tuple[str, int, str], itertools.count] = {}


def _process_store(host: str, port: int, *, world_size: int, is_master: bool, timeout: float) -> Any:
    """The ``TCPStore`` of this process for ``host:port``, opened once and never destroyed.

    Never destroyed, because MindSpore 2.10's store client can crash the process it lives in
    when it is: its destructor (``TCPClient::Finalize``) races the client's own receive thread,
    and when the master's process has already ended, as it does at the end of an ``msrun`` job,
    the client's process died of SIGSEGV at exit in 12 of 40 runs here (two processes, one
    barrier each; 1 of 30 even when the client went first). Stores that stay alive until the
    process ends (the kernel closes their sockets) gave 0 of 30. One store per address also
    lets a second barrier on the same port (a second ``CompactionCallback``) share it instead of
    failing to bind.
    """
    with _OPENING_LOCK:
        opening = _OPENING.setdefault((host, port), threading.Lock())
    with opening:
        store = _STORES.get((host, port))
        if store is None:
            from mindspore.mint.distributed import TCPStore

            store = TCPStore(host, port, world_size=world_size, is_master=is_master,
                             timeout=timedelta(seconds=timeout))
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))    # survives interpreter teardown
            _STORES[(host, port)] = store
        return store


class StoreBarrier:
    """A bounded barrier over MindSpore's ``mindspore.mint.distributed.TCPStore`` (rank 0 hosts
    it). :meth:`agree` is a barrier that also ORs one boolean across ranks.

    Args:
        rank, world_size: this rank and the number of ranks.
        host, port: where rank 0 serves the store (default: ``MS_SCHED_HOST`` and
            ``MS_SCHED_PORT + 11``, or ``MS_MEMOPT_STORE_PORT``); rank 0 must run on ``host``.
        timeout: seconds every rank waits for the others at each barrier (and at connection).
    """

    def __init__(self, rank: int, world_size: int, *, host: str | None = None,
                 port: int | None = None, timeout: float = 60.0, prefix: str = "ms_memopt/analysis/compaction") -> None:
        self.rank = rank
        self.world_size = world_size
        self.host = host or os.environ.get("MS_SCHED_HOST", "127.0.0.1")
        if port is None:
            port = int(os.environ.get("MS_MEMOPT_STORE_PORT", 0)) or int(os.environ.get("MS_SCHED_PORT", 8118)) + 11
        self.port = port
        self.timeout = timeout
        self.prefix = prefix
        # every rank makes its barriers in the same order, so the n-th one has the same keys everywhere
        made = _BARRIERS_MADE.setdefault((self.host, self.port, prefix), itertools.count())
        self._keys = f"{prefix}/{next(made)}"
        self._store = None
        self._round = 0

    @classmethod
    def from_environment(cls, **kwargs: Any) -> "StoreBarrier | None":
        """The barrier for this ``msrun`` job, or ``None`` when there is only one rank."""
        rank, world = _rank_and_world()
        return cls(rank, world, **kwargs) if world > 1 else None

    def _connect(self, deadline: float) -> Any:
        if self._store is None:
            def make():
                return _process_store(self.host, self.port, world_size=self.world_size,
                                      is_master=self.rank == 0, timeout=self.timeout)
            self._store = _call_with_deadline(
                make, deadline - time.monotonic(),
                f"rank {self.rank}: connecting to the compaction barrier store at {self.host}:{self.port}")
        return self._store

    def agree(self, step: int, value: bool = True) -> bool:
        """Wait until every rank called ``agree`` for this round; return True if any passed True.

        Raises :class:`BarrierTimeout` naming the missing ranks when they do not all arrive
        within ``timeout`` seconds (or the store cannot be reached).
        """
        deadline = time.monotonic() + self.timeout
        self._round += 1
        key = f"{self._keys}/{self._round}"
        what = f"rank {self.rank}: compaction barrier at step {step}"
        try:
            store = self._connect(deadline)
            _call_with_deadline(lambda: store.set(f"{key}/vote/{self.rank}", "1" if value else "0"),
                                deadline - time.monotonic(), what)
            _call_with_deadline(lambda: store.add(f"{key}/count", 1), deadline - time.monotonic(), what)
            while True:
                arrived = _call_with_deadline(lambda: store.add(f"{key}/count", 0),
                                              deadline - time.monotonic(), what)
                if arrived >= self.world_size:
                    break
                if time.monotonic() >= deadline:
                    raise BarrierTimeout(f"{what}: {arrived}/{self.world_size} ranks arrived")
                time.sleep(0.02)
            votes = [_call_with_deadline(lambda r=r: store.get(f"{key}/vote/{r}"),
                                         deadline - time.monotonic(), what)
                     for r in range(self.world_size)]
        except BarrierTimeout as exc:
            raise BarrierTimeout(f"{exc} within {self.timeout:.0f} s (barrier_timeout); a rank died "
                                 f"or hung before compacting — giving up instead of hanging") from None
        except Exception as exc:
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise BarrierTimeout(f"{what}: the barrier store failed ({first_line}); rank 0, which "
                                 f"hosts it at {self.host}:{self.port}, probably died") from exc
        return any(_as_text(v) == "1" for v in votes)


def _as_text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def _rank_and_world() -> tuple[int, int]:
    try:
        from mindspore.communication import get_group_size, get_rank
        return int(get_rank()), int(get_group_size())
    except Exception:
        return int(os.environ.get("RANK_ID", 0)), int(os.environ.get("RANK_SIZE", 1))


# --- the callback -----------------------------------------------------------------------------

class CompactionCallback(Callback):
    """Compact every ``every`` steps, after the optimizer and before the next forward.

    Args:
        every: steps between compactions (at steps ``every``, ``2*every``, ...).
        when_frag_above: compact only when ``frag_fn()`` (default: the worst frag ratio of the
            registered arenas) exceeds this; under ``msrun``, all ranks compact if any rank's
            reading exceeds it. ``None``: always.
        frag_fn: returns the last scan's frag ratio (``None`` when unknown), e.g. from a
            ``LayoutScanCallback``.
        when_forecast_within: compact only when the forecast says a watched request may stop
            fitting in one piece within this many steps (:meth:`Forecast.warns
            <ms_memopt.analysis.forecast.Forecast.warns>`); with ``when_frag_above`` too, either one
            suffices. Checked at every due step, so pair it with a small ``every`` (e.g. the
            scan interval). ``None``: not a condition.
        forecast_from: where the forecast comes from: a ``LayoutScanCallback`` or a
            :class:`~ms_memopt.analysis.scan.Scanner` (anything with ``forecast()`` and
            ``reset_forecast(step)``; reset after each compaction, the old trend being gone).
            Required with ``when_forecast_within``.
        arenas: :class:`~ms_memopt.analysis.arena.Arena` objects to compact too.
        layout_fn: returns the device pool's current :class:`~ms_memopt.core.layout.Layout` (e.g. a
            scan source's); the record's before/after figures are measured on it. Default: the
            real pool followed from its log when :func:`ms_memopt.mindspore.poolcapture.start` ran
            before ``import mindspore`` (the source the scans read then too), else the most
            fragmented arena's figures (``None`` without arenas: MindSpore has no public API for
            the pool's largest free block).
        live: relocate the network's and optimizer's Parameters (plus registered ones).
            ``"auto"`` (default): on CPU only. On Ascend a Parameter lives in the pool's
            *persistent* memory (``set_from_persistent_mem(tensor->is_parameter())``), and a
            relocated copy (``move_to``) is a new, common-pool allocation: relocation would pull
            the weights into the pool that fragments, and cannot merge the common pool's holes.
            There the record says so (``live_skipped``) and names the remedy for the job's
            pool (:class:`~ms_memopt.mindspore.pool_info.PoolInfo`); arenas are still compacted.
            Members of a ``FusedAdamW`` or pool-mode region are never relocated (they are
            contiguous already, and their storage is the region's).
        tensors: more Parameters to relocate.
        log_dir: the scans' log directory: records go to ``log_dir/rank_N/scan.jsonl``, beside
            a ``LayoutScanCallback``'s scans with the same ``log_dir``; ``None``: no log.
        barrier_timeout: seconds a rank waits for the others before :class:`BarrierTimeout`.
        barrier: a barrier with ``agree(step, value) -> bool`` (default: a :class:`StoreBarrier`
            under ``msrun`` with more than one rank, else none).
        verify: read every relocated tensor back and compare with its host copy.

    For a custom loop call :meth:`step` after each optimizer step. Under ``Model.train`` the
    network and optimizer come from the callback parameters; under MindFormers' ``Trainer``
    ``cb_params.optimizer`` is ``None`` and the optimizer is found inside the training cell
    (:func:`~ms_memopt.mindspore.cells.training_parts`).
    """

    def __init__(self, every: int = 500, when_frag_above: float | None = None, *,
                 frag_fn: Callable[[], float | None] | None = None,
                 when_forecast_within: int | None = None, forecast_from: Any = None,
                 arenas: Sequence[Arena] = (),
                 layout_fn: Callable[[], Any] | None = None,
                 live: bool | str = "auto", tensors: Sequence[Parameter] = (),
                 log_dir: str | os.PathLike | None = None,
                 barrier_timeout: float = 60.0, barrier: Any = "auto", verify: bool = True) -> None:
        super().__init__()
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        check_forecast_within(when_forecast_within, "when_forecast_within")
        if when_forecast_within is not None and not callable(getattr(forecast_from, "forecast", None)):
            raise InputError("when_forecast_within needs forecast_from: a LayoutScanCallback or Scanner "
                             "with watched requests", key="forecast_from")
        self.every = every
        self.when_frag_above = when_frag_above
        self.when_forecast_within = when_forecast_within
        self.forecast_from = forecast_from
        self.frag_fn = frag_fn
        self.arenas = list(arenas)
        self.layout_fn = layout_fn
        if live not in (True, False, "auto"):
            raise ValueError(f"live must be True, False or 'auto', got {live!r}")
        self.live = live
        self._pool: PoolInfo | None = None
        self.tensors = list(tensors)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.barrier_timeout = barrier_timeout
        self._barrier = barrier
        self.verify = verify
        self.records: list[dict] = []

    @property
    def pool(self) -> PoolInfo:
        """The job's pool (detected once, at the first compaction)."""
        if self._pool is None:
            self._pool = detect_pool()
        return self._pool

    def _live_skipped(self) -> str | None:
        """Why this job's Parameters are not relocated, or ``None`` when they are."""
        if self.live is False:
            return "live=False"
        if self.live is True or self.pool.device == "CPU":
            return None
        if self.pool.vmm:
            return ("VMM pool: physical memory is mapped on demand and does not fragment; relocating Parameters "
                    "would only move them from persistent into common memory. Nothing to do.")
        return ("Parameters live in the persistent pool on Ascend and a relocated copy would be a common-pool "
                "allocation: no relocation through MindSpore 2.10's public API both keeps them persistent and "
                "merges the common pool's holes. Remedies that work on this pool: MS_ALLOC_CONF=enable_vmm:True "
                "(driver >= 24.0.0), pool mode, or a larger init_size set in the launch script; "
                "see `ms-memopt doctor` on a recording.")

    @property
    def barrier(self) -> Any:
        if self._barrier == "auto":
            self._barrier = StoreBarrier.from_environment(timeout=self.barrier_timeout)
        return self._barrier

    def log_path(self, rank: int) -> Path | None:
        """Where this rank's records go: ``log_dir/rank_N/scan.jsonl`` (``None`` without a log)."""
        return self.log_dir / f"rank_{rank}" / SCAN_LOG_NAME if self.log_dir is not None else None

    def on_train_step_end(self, run_context: Any) -> None:
        cb = run_context.original_args()
        parts = training_parts(cb)
        self.step(int(cb.cur_step_num), network=parts.train_network, optimizer=parts.optimizer)

    def _frag(self) -> float | None:
        if self.frag_fn is not None:
            return self.frag_fn()
        ratios = [a.frag_ratio() for a in self.arenas]
        ratios = [r for r in ratios if r is not None]
        return max(ratios) if ratios else None

    def _want(self) -> bool:
        """This rank's vote at a due step: no condition given -> compact; else any condition."""
        if self.when_frag_above is None and self.when_forecast_within is None:
            return True
        if self.when_frag_above is not None:
            frag = self._frag()
            if frag is not None and frag > self.when_frag_above:
                return True
        if self.when_forecast_within is not None:
            fc = self.forecast_from.forecast()
            if fc is not None and fc.warns(self.when_forecast_within):
                logger.info("compaction: forecast %s", fc.describe())
                return True
        return False

    def step(self, step: int, *, network: Any = None, optimizer: Any = None) -> dict | None:
        """Compact if ``step`` is due; returns the scan-log record, or ``None``."""
        if step % self.every:
            return None
        want = self._want()
        rank, _ = _rank_and_world()
        barrier = self.barrier
        if barrier is not None:
            _synchronize()   # this rank's collectives of the step are done
            want = barrier.agree(step, want)
        if not want:
            return None
        record = self._compact(step, rank, network, optimizer)
        reset = getattr(self.forecast_from, "reset_forecast", None)
        if reset is not None:
            reset(step)
        if barrier is not None:
            barrier.agree(step, True)  # nobody starts the next step while a peer still moves memory
        return record

    def _pool_layout_fn(self) -> Callable[[], Any] | None:
        """``layout_fn``, or the real pool's layout from its log when that is followed."""
        if self.layout_fn is not None:
            return self.layout_fn
        from ms_memopt.mindspore import poolcapture

        if poolcapture.active() is None:
            return None
        from ms_memopt.mindspore.pool_log_source import PoolLogSource

        return PoolLogSource().layout

    def _compact(self, step: int, rank: int, network: Any, optimizer: Any) -> dict:
        layout_fn = self._pool_layout_fn()
        pool_before = measure(layout_fn()) if layout_fn is not None else None
        record_mark("compaction_begin")      # only under ms-memopt record: the pool log's window
        t0 = time.perf_counter()
        arena_reports = [a.compact() for a in self.arenas]
        live_report = None
        skipped = self._live_skipped()
        if skipped is None:
            tensors = long_lived_tensors(network, optimizer, extra=self.tensors)
            if tensors:
                live_report = live_compact(tensors, verify=self.verify)
        moved = live_report is not None and live_report.tensors > 0
        regions_restored = restore_regions(network, optimizer) if moved else False
        seconds = time.perf_counter() - t0
        if recording():
            wait_for_queued_ops()      # the pool calls the compaction queued come before its end mark
        record_mark("compaction_end")
        pool_after = measure(layout_fn()) if layout_fn is not None else None
        # the record's before/after figures are the most fragmented arena's (all are listed)
        worst = max(arena_reports, key=lambda r: (r.frag_ratio_before is not None, r.frag_ratio_before or 0.0),
                    default=None)
        record = {
            "kind": "compaction", "step": step, "rank": rank, "time": time.time(),
            "frag_ratio_before": worst.frag_ratio_before if worst else None,
            "frag_ratio_after": worst.frag_ratio_after if worst else None,
            "largest_free_before": worst.largest_free_before if worst else None,
            "largest_free_after": worst.largest_free_after if worst else None,
            "free_total": worst.free_total if worst else None,
            "bytes_moved": sum(r.bytes_moved for r in arena_reports) + (live_report.bytes if live_report else 0),
            "seconds": seconds,
            "arenas": [r.to_dict() for r in arena_reports],
            "live": live_report.to_dict() if live_report else None,
            "live_skipped": skipped if self.live is not False else None,
            "regions_restored": regions_restored,
            "pool": self.pool.to_dict(),
        }
        if pool_before is not None:
            record.update(frag_ratio_before=pool_before.frag_ratio, frag_ratio_after=pool_after.frag_ratio,
                          largest_free_before=pool_before.largest_free,
                          largest_free_after=pool_after.largest_free, free_total=pool_after.free_total)
        self.records.append(record)
        log_path = self.log_path(rank)
        if log_path is not None:
            with ScanLog(log_path) as log:  # shared with the scans: one append per record
                log.write(record)
        logger.info("compaction at step %d on rank %d: %d bytes moved in %.3f s", step, rank,
                    record["bytes_moved"], seconds)
        return record

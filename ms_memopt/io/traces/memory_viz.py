"""Export events and a layout in PyTorch's memory snapshot format, for pytorch.org/memory_viz.

The file is what ``torch.cuda.memory._dump_snapshot()`` writes: a pickle of
``{"device_traces": [[...]], "segments": [...], "allocator_settings": {...}}`` holding only
builtin types, written as a stream (:class:`SnapshotWriter`: entries in batches, the final
segments at the end; ``max_entries`` keeps the newest, as PyTorch's ``_record_memory_history``), so :func:`~ms_memopt.io.traces.torch_snapshot.read_torch_snapshot` (and PyTorch's
viewer) can load it. ``segments`` is the layout (live blocks ``active_allocated``, free ones
``inactive``); ``device_traces[0]`` the events: each ``alloc``, each free as
``free_requested`` + ``free_completed``, ``segment_alloc`` / ``segment_free`` (``segment_map`` /
``segment_unmap`` for expandable segments). As torch_npu writes them, an entry carries the
requested size (:func:`trace_size`: for a MindSpore pool, the tensor its runtime pads to the
block), a block its ``size`` and ``requested_size``.

We have no stack traces, so each block's one frame names what it is: its tag (``parameter``,
``activation``, ``allreduce``, ``shape_cache``, ...) as the frame's function in file
``ms-memopt``, which the viewer shows where it would show the allocating stack (an untagged
block says ``untagged``, never "allocated before _record_history was enabled"). A compaction's
moves are the block's free at its old address and alloc at the new one, both named
``<tag> (moved by compaction)``. When the events hold no segment events (a simulation or a
model replay), each segment of the final layout gets a ``segment_alloc`` just before the first
alloc inside it, so a pool grown in blocks is shown growing.

Each ``alloc`` also carries a ``category``, the block's purpose (its tag; ``untagged`` without
one), the key PyTorch's viewer colours by and names in its legend (``torch.cuda._memory_viz``
writes it for profiler categories). ``blockers``: ids of allocations to show in a category of
their own, ``blocker: <tag>`` (``ms-memopt doctor`` marks the blocks in the way).

Which allocator made the recording: ``allocator_settings`` (PyTorch's dict of its allocator's
configuration, which neither its viewer ``MemoryViz.js`` nor ``torch.cuda._memory_viz`` reads)
holds ``written_by: ms-memopt`` and, under the key ``ms_memopt`` (:data:`RECORDED_BY`), the
allocator model that placed the blocks (``mindspore``, ``torch``, ...), its options, and what made the
events (``ms-memopt simulate``: the recipe, policy, rank, stage, seed and capacity). The reader
(:func:`~ms_memopt.io.traces.torch_snapshot.read_torch_snapshot`) puts it in ``Trace.meta``,
and ``replay`` and ``doctor`` replay through that model by default. So that model replays the
events as they were made, each ``alloc`` and free entry also carries what PyTorch's format has no
field for and its tools ignore: ``ms_memopt_pool`` (MindSpore's ``persistent`` pool, where
parameters and optimizer states go) and ``ms_memopt_step`` (the training step; the reader puts a
``step`` event at each step's end, where compaction and ``empty_cache`` act).

A recording's events are exported as a model placed them, with the segments it took and gave
back: :mod:`ms_memopt.replay.viz_export`.

Example:
    >>> from ms_memopt.core.events import Event
    >>> from ms_memopt.core.layout import Block, Layout, Segment
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "viz.pickle")
    >>> seg = Segment(0x200000, 2 << 20, [Block(0x200000, 512, True), Block(0x200200, (2 << 20) - 512, False)])
    >>> write_memory_viz(path, [Event("alloc", id=1, size=500, addr=0x200000)], Layout([seg]))
    >>> from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot
    >>> [e.action for e in read_torch_snapshot(path).events]   # the segment's mapping is in the trace too
    ['segment_alloc', 'alloc']
"""
from __future__ import annotations

import bisect
import io
import pickle
from collections import deque
from pathlib import Path
from typing import Iterable

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import SEGMENT_ACTIONS, Event, Trace
from ms_memopt.core.layout import Layout, Segment

__all__ = ["write_memory_viz", "snapshot_dict", "SnapshotWriter", "trace_size", "PADDED_MODELS",
           "EXPANDABLE_MODELS", "RECORDED_BY", "POOL_KEY", "STEP_KEY", "check_export_path", "check_max_entries"]

#: the key of ``allocator_settings`` that says which allocator model made the events (a dict)
RECORDED_BY = "ms_memopt"
#: keys of an alloc or free entry: the event's pool (``persistent``) and training step
POOL_KEY, STEP_KEY = "ms_memopt_pool", "ms_memopt_step"

_SMALL_SEGMENT = 2 << 20


def _segment_type(pool: str, size: int) -> str:
    if pool in ("small", "large"):
        return pool
    return "small" if size <= _SMALL_SEGMENT else "large"


_FILE = "ms-memopt"
_UNTAGGED = "untagged"
_MOVED = "compaction"   # the tag the simulator gives a compaction's free + alloc of one block


def _frames(name: str) -> list[dict]:
    """One frame naming the block, where the viewer shows the allocating stack."""
    return [{"filename": _FILE, "line": 0, "name": name}]


def _segment_starts(events: list[Event], layout: Layout, initial: Layout | None) -> dict:
    """Address of the first alloc inside each segment of ``layout`` that ``initial`` does not
    hold already -> that segment, when the events record no segment events of their own (else
    an empty dict: the recorded ones win)."""
    if any(e.action in SEGMENT_ACTIONS for e in events):
        return {}
    existing = {seg.addr for seg in initial.segments} if initial is not None else set()
    segments = sorted((seg for seg in layout.segments if seg.addr not in existing), key=lambda s: s.addr)
    bases = [seg.addr for seg in segments]
    starts: dict[int, Segment] = {}
    seen: set[int] = set()
    for event in events:
        if event.action != "alloc" or event.addr is None:
            continue
        at = bisect.bisect_right(bases, event.addr) - 1
        if at < 0 or at in seen or event.addr >= segments[at].addr + segments[at].size:
            continue
        seen.add(at)
        starts[event.addr] = segments[at]
    return starts


#: allocator models handed sizes MindSpore's runtime padded already: its pools, and pool mode (the
#: project's regions on MindSpore), which align them to 512 B and add no pad of their own
PADDED_MODELS = ("mindspore", "mindspore-bestfit", "mindspore-vmm", "pool")
#: models that map memory into a reserved range (torch's expandable segments, MindSpore's VMM):
#: their segments grow and shrink as ``segment_map`` / ``segment_unmap``
EXPANDABLE_MODELS = ("torch-expandable", "torch-npu-expandable", "mindspore-vmm")
_ALIGN, _PAD = 512, 32          # MindSpore's GetCommonAlignSize and torch_npu's round_size: (n + 32) up to 512 B


def trace_size(size: int, allocator: str | None) -> int:
    """The requested size a trace entry carries for a request of ``size`` bytes (bytes).

    PyTorch and torch_npu record the size the caller asked for (``record_trace(ALLOC, ptr,
    orig_size)``); torch_npu's allocator pads it to ``(size + 32)`` rounded up to 512 B, and
    readers of the format (MindStudio Insight's converter) rebuild the block by that rule. A
    MindSpore pool is asked for sizes its runtime padded already by the same rule
    (``GetCommonAlignSize``): the pool's 512-aligned block less 32 B is the largest tensor padded
    to it, the size that rebuilds the same block. Other models (or none): ``size`` itself.

    Example:
        >>> trace_size(4096, "torch-npu"), trace_size(4096, "mindspore"), trace_size(1000, "mindspore-vmm")
        (4096, 4064, 992)
    """
    if allocator in PADDED_MODELS:
        return max(-(-max(size, 1) // _ALIGN) * _ALIGN - _PAD, 0)
    return int(size)


def _body(obj) -> bytes:
    """``obj`` pickled (protocol 2) without its header and STOP, so that pieces written apart make
    one pickle: each piece's memo indices start at 0 and are only read inside the piece."""
    buffer = io.BytesIO()
    pickle.Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()[2:-1]


def _appends(entries: list) -> bytes:
    """``entries`` as opcodes that append them to the list on top of the unpickler's stack."""
    body = _body(entries)
    return body[3:] if body[1:3] == b"q\x00" else body[1:]      # the new list and its memo slot dropped


class SnapshotWriter:
    """A PyTorch memory snapshot written as a stream: trace entries go to the file as the events
    come (:meth:`add`), the final segments at :meth:`close`; memory holds one batch of entries and
    the live blocks' names and sizes, whatever the length of the run.

    Args:
        path: the ``.pickle`` file (parent directories are created).
        allocator: the model that placed the events (:func:`trace_size`; ``None``: sizes as given).
        device: the device index the snapshot describes.
        blockers: allocation ids shown in a category of their own (``blocker: <tag>``).
        max_entries: keep only the newest N trace entries, as PyTorch's
            ``_record_memory_history(max_entries=N)`` (they wait in memory until :meth:`close`).

    Example:
        >>> import os, tempfile
        >>> from ms_memopt.core.layout import Block, Layout, Segment
        >>> path = os.path.join(tempfile.mkdtemp(), "s.pickle")
        >>> w = SnapshotWriter(path, allocator="torch-npu")
        >>> w.add(Event("segment_alloc", size=2 << 20, addr=0x200000))
        >>> w.add(Event("alloc", id=1, size=500, addr=0x200000))
        >>> w.close(Layout([Segment(0x200000, 2 << 20, [Block(0x200000, 1024, True),
        ...                                            Block(0x200400, (2 << 20) - 1024, False)])]))
        >>> from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot
        >>> [(e.action, e.size) for e in read_torch_snapshot(path).events]
        [('segment_alloc', 2097152), ('alloc', 500)]
    """

    _BATCH = 4096

    def __init__(self, path: str | Path, *, allocator: str | None = None, device: int = 0,
                 blockers: Iterable[int] = (), max_entries: int | None = None) -> None:
        self.path = Path(path)
        self.allocator, self.device = allocator, int(device)
        self.blockers = set(blockers)
        self.entries = 0                        # trace entries written (or kept)
        self._ring = deque(maxlen=max_entries) if max_entries is not None else None
        self._batch: list[dict] = []
        self._addr_of: dict[int, int] = {}      # live id -> address
        self._tag_of: dict[int, str] = {}       # live id -> name
        self._live: dict[int, tuple[str, int, int]] = {}   # address -> (name, requested size, stream)
        self._frames: dict[str, list] = {}      # name -> its one frame list (shared: pickled once per batch)
        self._padded = allocator in PADDED_MODELS
        self._moving: dict[int, tuple[int, int]] = {}  # id -> (requested size, stream) of a block being moved
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb")
        self._file.write(b"\x80\x02}(" + _body("device_traces") + b"](" + b"]" * (self.device + 1))

    def _emit(self, entry: dict) -> None:
        self.entries += 1
        if self._ring is not None:
            self._ring.append(entry)
            return
        self._batch.append(entry)
        if len(self._batch) >= self._BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            self._file.write(_appends(self._batch))
            self._batch = []

    def _frames_of(self, name: str) -> list[dict]:
        frames = self._frames.get(name)
        if frames is None:
            frames = self._frames[name] = _frames(name)
        return frames

    def add(self, event: Event, index: int | None = None) -> None:
        """One event with its address: ``alloc``; ``free`` (its address may come from the alloc,
        by id), written as ``free_requested`` + ``free_completed``; a segment event. Others are skipped.

        Raises:
            InputError: an ``alloc`` without an address (event ``index`` named).
        """
        action = event.action
        size = int(event.size)
        if self._padded and action in ("alloc", "free"):
            size = trace_size(size, self.allocator)
        base = {"addr": event.addr, "size": size, "stream": int(event.stream)}
        if event.time is not None:
            base["time_us"] = int(round(event.time * 1e6))
        if action in ("alloc", "free"):
            if event.pool is not None:
                base[POOL_KEY] = str(event.pool)
            if event.step is not None:
                base[STEP_KEY] = int(event.step)
        if action == "alloc":
            if event.addr is None:
                raise InputError(f"event {index if index is not None else self.entries}: alloc of id {event.id} "
                                 "has no address (a recording's events are placed by a model before export)",
                                 key="--export-memory-viz")
            name = event.tag or self._tag_of.get(event.id, _UNTAGGED)
            if event.tag == _MOVED:
                name = f"{self._tag_of.get(event.id, _UNTAGGED)} (moved by compaction)"
            if event.id is not None:
                self._addr_of[event.id] = event.addr
                if event.tag != _MOVED:
                    self._tag_of[event.id] = name
            stream = int(event.stream)
            if event.tag == _MOVED:     # a compaction's move entry: the block's own request, not its size
                size, stream = self._moving.pop(event.id, (size, stream))
                base["size"], base["stream"] = size, stream
            self._live[event.addr] = (name, size, stream)
            category = f"blocker: {name}" if event.id in self.blockers else name
            self._emit({"action": "alloc", **base, "frames": self._frames_of(name), "category": category})
        elif action == "free":
            addr = event.addr if event.addr is not None else self._addr_of.get(event.id)
            if addr is None:
                return  # freed before the trace began and never placed: nothing to draw
            base["addr"] = addr
            name, requested, stream = self._live.pop(addr, (None, size, int(event.stream)))
            base["size"], base["stream"] = requested, stream    # as PyTorch frees: the block's own
            if event.tag == _MOVED:
                name = f"{self._tag_of.get(event.id, _UNTAGGED)} (moved by compaction)"
                self._moving[event.id] = (requested, stream)
            else:
                self._addr_of.pop(event.id, None)
                name = event.tag or self._tag_of.pop(event.id, None) or name or _UNTAGGED
            frames = self._frames_of(name)
            self._emit({"action": "free_requested", **base, "frames": frames})
            self._emit({"action": "free_completed", **base, "frames": frames})
        elif action in SEGMENT_ACTIONS and event.addr is not None:   # expandable segments' maps too
            self._emit({"action": action, **base, "frames": _frames((event.pool or "device") + " pool segment")})

    def close(self, layout: Layout, recorded_by: dict | None = None) -> None:
        """Write the final state (``layout``: the segments and blocks at the end of the events)
        and ``allocator_settings`` (``recorded_by`` under :data:`RECORDED_BY`), and close the file."""
        if self._ring is not None:
            self._batch = list(self._ring)
            self._ring.clear()
        self._flush()
        expandable = self.allocator in EXPANDABLE_MODELS
        segments = []
        for seg in sorted(layout.segments, key=lambda s: s.addr):
            blocks = []
            for b in seg.blocks:
                name, requested, _stream = self._live.get(b.addr, (None, trace_size(b.size, self.allocator), 0))
                blocks.append({"address": b.addr, "size": b.size, "requested_size": requested if b.live else 0,
                               "state": "active_allocated" if b.live else "inactive",
                               "frames": _frames(b.tag or name or _UNTAGGED) if b.live else []})
            allocated = sum(b.size for b in seg.blocks if b.live)
            segments.append({
                "device": self.device, "address": seg.addr, "total_size": seg.size,
                "allocated_size": allocated, "active_size": allocated,
                "requested_size": sum(b["requested_size"] for b in blocks),
                "stream": seg.stream, "segment_type": _segment_type(seg.pool, seg.size),
                "segment_pool_id": (0, 0), "is_expandable": expandable, "frames": [], "blocks": blocks,
            })
        settings: dict = {"PYTORCH_CUDA_ALLOC_CONF": "", "written_by": "ms-memopt"}
        if recorded_by:
            settings[RECORDED_BY] = dict(recorded_by)
        self._file.write(b"e" + _body("segments") + _body(segments) + _body("allocator_settings")
                         + _body(settings) + b"u.")
        self._file.close()

    def abort(self) -> None:
        """Close and remove a file that will not be finished."""
        self._file.close()
        self.path.unlink(missing_ok=True)


def snapshot_dict(events: Iterable[Event], layout: Layout, *, device: int = 0,
                  initial: Layout | None = None, blockers: Iterable[int] = (),
                  recorded_by: dict | None = None) -> dict:
    """The snapshot as a dict of builtin types (what :func:`write_memory_viz` writes; read back).

    Example:
        >>> snapshot_dict([], Layout())["device_traces"]
        [[]]
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "snapshot.pickle"
        write_memory_viz(path, list(events), layout, device=device, blockers=blockers, recorded_by=recorded_by,
                         initial=initial)
        with open(path, "rb") as handle:
            return pickle.load(handle)


def write_memory_viz(path: str | Path, trace_or_events: Trace | Iterable[Event], layout: Layout | None = None,
                     *, device: int = 0, blockers: Iterable[int] = (), recorded_by: dict | None = None,
                     initial: Layout | None = None, max_entries: int | None = None) -> None:
    """Write ``trace_or_events`` and ``layout`` as a PyTorch memory snapshot pickle.

    Args:
        path: the ``.pickle`` file to write (parent directories are created).
        trace_or_events: a :class:`Trace` (its events; ``final`` when ``layout`` is ``None``)
            or a list of events with addresses.
        layout: the segments and blocks at the end of the events.
        device: the device index the snapshot describes.
        blockers: allocation ids shown in a category of their own (``blocker: <tag>``).
        recorded_by: the allocator model that placed the events and its options
            (``{"allocator": "mindspore", "allocator_options": {"increase_size": 1073741824}}``),
            plus what made them; read back as ``Trace.meta["allocator"]`` (module doc); its
            ``allocator`` decides the trace entries' sizes (:func:`trace_size`).
        initial: the layout before the first event (a snapshot taken mid-run): its segments
            existed already and get no inferred ``segment_alloc``.
        max_entries: keep the newest N trace entries (:class:`SnapshotWriter`).
    """
    if isinstance(trace_or_events, Trace):
        events = trace_or_events.events
        initial = trace_or_events.initial if initial is None else initial
        if layout is None:
            layout = trace_or_events.final
    else:
        events = trace_or_events
    events = list(events)
    layout = layout or Layout()
    grow = _segment_starts(events, layout, initial)
    writer = SnapshotWriter(path, allocator=(recorded_by or {}).get("allocator"), device=device,
                            blockers=blockers, max_entries=max_entries)
    try:
        for index, event in enumerate(events):
            if grow and event.action == "alloc" and event.addr in grow:
                seg = grow.pop(event.addr)
                writer.add(Event("segment_alloc", size=seg.size, addr=seg.addr, stream=seg.stream, pool=seg.pool))
            writer.add(event, index)
    except BaseException:
        writer.abort()
        raise
    writer.close(layout, recorded_by)


def check_max_entries(max_entries: int | None, export: str | None) -> None:
    """``--export-max-entries N``: a positive count, given with ``--export-memory-viz``.

    Raises:
        InputError: naming ``--export-max-entries``.

    Example:
        >>> check_max_entries(100000, "out.pickle")
    """
    if max_entries is None:
        return
    if max_entries < 1:
        raise InputError(f"expected a positive number of trace entries, got {max_entries}", key="--export-max-entries")
    if not export:
        raise InputError("bounds the trace of --export-memory-viz; give that too", key="--export-max-entries")


def check_export_path(path: str | Path) -> None:
    """A recording path that does not exist, where ``simulate --export-memory-viz FILE.pickle``
    with several policies wrote one file per policy (``FILE.<policy>.pickle``) instead: an
    :class:`InputError` naming those files, so the next command can be given one of them.

    Raises:
        InputError: ``path`` is missing and per-policy files of it exist.
    """
    path = Path(path)
    if path.exists() or not path.suffix:
        return
    written = sorted(path.parent.glob(f"{path.stem}.*{path.suffix}"))
    if written:
        raise InputError("no such file; simulate --export-memory-viz wrote one file per policy: "
                         + ", ".join(str(p) for p in written) + " (give one of them)", source=str(path))

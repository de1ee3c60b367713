"""The one event loop: every driver of an allocator model feeds its events through :func:`drive`.

Replay (:func:`ms_memopt.replay.replay.replay`), its what-ifs (:mod:`ms_memopt.replay.whatif`,
through replay), placed events (:func:`ms_memopt.replay.replay.placed_events`), the simulator
(:class:`ms_memopt.simulation.simulate` ``_Run.feed``) and so the job (:mod:`ms_memopt.simulation.job`)
differ only in what they do *around* the model's calls; that is what the hooks are for:

==============  ==================================================================================
``on_watch``    ``(index, event, model)`` just before an allocation whose tag is in ``watch``
``on_alloc``    ``(index, event, addr)`` after every allocation (``addr`` ``None``: it failed)
``on_free``     ``(index, event, addr)`` after every free of a tensor the model placed
``on_evict``    ``(index, [(tensor id, addr), ...])`` after a pool-mode cache evicted tensors
                (with ``forget_evicted``; they are gone from ``addr_of`` already)
``on_step``     ``(index, event, model) -> model`` at a ``step`` event; the model returned goes on
                (a policy such as compaction swaps it)
``on_mark``     ``(index, event, model) -> model`` at a ``mark`` event, *instead of*
                ``model.note_mark(tag, size)`` (the hook calls it when it wants it)
``on_sample``   ``(index, model)`` after every ``sample_every``-th event and every ``step`` event;
                its time is not counted in :attr:`DriveResult.seconds`
``on_oom``      ``(index, event, model) -> model`` at an allocation that failed: a model returned
                (a last-resort compaction) is asked for the same request once more, and when it
                serves it the failure is forgotten (its OOM record dropped)
==============  ==================================================================================

A model with a compiled fast path (:func:`ms_memopt.allocators.fast.batch_runner`) runs the
stretches of allocations and frees between the other events, the watched requests and the
samples in one C call; this module is the only caller of it and the only reader of what it
returns. ``on_alloc``, ``on_free`` and ``on_evict`` see every call, so with any of them the
pure-Python path runs every event; both paths give identical results (tests/test_loop.py).

Events are :class:`~ms_memopt.core.events.Event` objects or rows (tuples of Event's fields, in
:data:`~ms_memopt.core.events.FIELDS` order, what the simulator's workload yields); the loop reads
either through :data:`~ms_memopt.core.events.ROW_INDEX`, so a new Event field changes nothing here.

Example:
    >>> from ms_memopt.allocators import create
    >>> from ms_memopt.core.events import Event
    >>> run = drive([Event("alloc", id=1, size=4096), Event("free", id=1)], create("mindspore"))
    >>> run.allocs, run.stopped_at, run.oom_index
    (1, 2, None)
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from operator import attrgetter, itemgetter

from ms_memopt.allocators.base import AllocatorModel
from ms_memopt.allocators.fast import batch_runner
from ms_memopt.core.events import ROW_INDEX

__all__ = ["DriveResult", "drive", "drive_chunks", "CHUNK_EVENTS"]

_READ = ("action", "id", "size", "addr", "stream", "pool", "tag")
_READ_ROW = itemgetter(*(ROW_INDEX[name] for name in _READ))
_READ_EVENT = attrgetter(*_READ)


@dataclass
class DriveResult:
    """What :func:`drive` did; sizes in bytes, times in seconds.

    ``model`` is the model at the end (``on_step``/``on_mark`` may have swapped it);
    ``stopped_at`` the index of the first event not run (``stop`` when every event ran, the
    failed allocation's with ``stop_on_oom``); ``allocs`` counts allocation requests (the
    failed ones too); ``known``/``matched`` the allocations with a recorded address and those the
    model placed there; ``oom_index`` the first failed allocation's index. ``seconds`` and
    ``cpu_seconds`` (this process's CPU time) leave out the sampling hook.
    """

    model: AllocatorModel
    stopped_at: int = 0
    allocs: int = 0
    known: int = 0
    matched: int = 0
    oom_index: int | None = None
    samples: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    #: trace id -> the model's address after the run (the dict passed as ``addr_of``)
    addr_of: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def address_match(self) -> float | None:
        """The fraction of allocations with a recorded address placed at it (``None``: none recorded)."""
        return self.matched / self.known if self.known else None


def drive(events: Sequence, model: AllocatorModel, *, start: int = 0, stop: int | None = None,
          addr_of: dict[int, int] | None = None, streams: bool = True, stop_on_oom: bool = False,
          forget_evicted: bool = False, watch: dict | set | None = None,
          on_watch: Callable | None = None, on_alloc: Callable | None = None, on_free: Callable | None = None,
          on_evict: Callable | None = None, on_step: Callable | None = None, on_mark: Callable | None = None,
          sample_every: int = 0, on_sample: Callable | None = None, on_oom: Callable | None = None) -> DriveResult:
    """Feed ``events[start:stop]`` to ``model`` (the hooks: module docstring).

    Args:
        events: Events or rows (see the module docstring); a list runs fastest.
        model: the allocator model (a restored one to start from a recorded state).
        start, stop: the events to run (``stop`` ``None``: to the end).
        addr_of: trace tensor id -> the model's address; updated in place (frees look the
            address up here, so a model that places differently from the recording frees right).
        streams: pass each event's ``stream`` to ``malloc`` (replay); ``False``: stream 0 (the
            simulator, whose rows carry none).
        stop_on_oom: stop at the first failed allocation (a job dies there); otherwise it is
            recorded (``model.ooms[-1].event_index``) and the loop goes on.
        forget_evicted: drop from ``addr_of`` the tensors a pool-mode cache evicts (their later
            frees must not hit new blocks); ``on_evict`` sees them.
        watch: request tags ``on_watch`` is called before.
        sample_every: call ``on_sample`` after every this many events and at every ``step``
            event (0: never).

    Returns:
        A :class:`DriveResult`.

    Example:
        >>> from ms_memopt.allocators import create
        >>> from ms_memopt.core.events import Event
        >>> seen = []
        >>> run = drive([Event("alloc", id=7, size=512)], create("torch"),
        ...             on_alloc=lambda i, e, addr: seen.append((i, e.id, addr is not None)))
        >>> seen, list(run.addr_of)
        ([(0, 7, True)], [7])
    """
    if not isinstance(events, list):
        events = list(events)
    count = len(events) if stop is None else max(0, min(stop, len(events)))
    addr_of = {} if addr_of is None else addr_of
    result = DriveResult(model=model, stopped_at=start, addr_of=addr_of)
    if start >= count:
        return result
    read = _READ_ROW if isinstance(events[start], tuple) else _READ_EVENT
    if not watch or on_watch is None:
        watch = None
    elif not isinstance(watch, dict):       # the compiled loop looks tags up in a dict
        watch = dict.fromkeys(watch)
    every = sample_every if on_sample is not None and sample_every and sample_every > 0 else 0
    # every call seen by a hook, or the compiled loop (which calls nothing back) for stretches
    compiled = on_alloc is None and on_free is None and on_evict is None
    forget = bool(forget_evicted)
    run = batch_runner(model) if compiled else None
    malloc, free = model.malloc, model.free
    drain = getattr(model, "drain_evicted", None) if forget else None
    allocs = known = matched = 0
    oom_seen = len(model.ooms)
    oom_index = None
    hook_wall = hook_cpu = 0.0
    wall, cpu = time.perf_counter(), time.process_time()

    def sample(at: int) -> None:
        nonlocal hook_wall, hook_cpu
        w, c = time.perf_counter(), time.process_time()
        on_sample(at, model)
        result.samples += 1
        hook_wall += time.perf_counter() - w
        hook_cpu += time.process_time() - c

    index = start
    while index < count:
        failed = False          # the allocation at index failed (in the compiled loop or here)
        if run is not None:
            end = count if not every else min(count, index - index % every + every)
            index, n_allocs, n_known, n_matched, oom = run(events, index, end, addr_of, watch, streams, forget)
            allocs += n_allocs
            known += n_known
            matched += n_matched
            if oom:
                failed = True
            elif index == end:
                if every and end % every == 0:
                    sample(end - 1)
                continue
        event = events[index]
        action, tid, size, recorded, stream, pool, tag = read(event)
        if failed:
            pass                # the compiled loop ran it and the model recorded the OOM
        elif action == "alloc":
            if watch is not None and tag is not None and tag in watch:
                on_watch(index, event, model)
            allocs += 1
            addr = (malloc(size, stream=stream, pool=pool, tag=tag) if streams
                    else malloc(size, pool=pool, tag=tag))
            if addr is None:
                failed = True
            else:
                if drain is not None:
                    gone = drain()
                    if gone:        # the evicted tensors go first (the new one may sit at their address)
                        _forget(addr_of, gone, index, on_evict)
                addr_of[tid] = addr
                if recorded is not None:
                    known += 1
                    matched += addr == recorded
            if on_alloc is not None:
                on_alloc(index, event, addr)
        elif action == "free":
            addr = addr_of.pop(tid, None)
            if addr is not None:
                free(addr)
                if on_free is not None:
                    on_free(index, event, addr)
        elif action == "mark":
            if on_mark is None:
                model.note_mark(tag, size)
            else:
                model = _swap(on_mark(index, event, model), model)
        elif action == "step":
            if on_step is not None:
                model = _swap(on_step(index, event, model), model)
        elif action == "segment_alloc":
            model.note_segment_alloc(recorded, size, stream)
        elif action == "segment_free":
            model.release_segment(recorded, size, stream)
        elif action == "segment_map":
            model.note_segment_map(recorded, size, stream)
        elif action == "segment_unmap":
            model.unmap_range(recorded, size, stream)
        elif action == "empty_cache":
            model.empty_cache()
        if model is not result.model:       # a policy swapped it: look its methods up anew
            result.model = model
            malloc, free = model.malloc, model.free
            drain = getattr(model, "drain_evicted", None) if forget else None
            run = batch_runner(model) if compiled else None
        if len(model.ooms) > oom_seen:
            model.ooms[-1].event_index = index
            oom_seen = len(model.ooms)
        if failed and on_oom is not None and action == "alloc":
            retried = on_oom(index, event, model)
            if retried is not None:
                model = result.model = retried
                malloc, free = model.malloc, model.free
                drain = getattr(model, "drain_evicted", None) if forget else None
                run = batch_runner(model) if compiled else None
                addr = (malloc(size, stream=stream, pool=pool, tag=tag) if streams
                        else malloc(size, pool=pool, tag=tag))
                if addr is None:            # the record of the second try stands for the request
                    model.ooms[-1].event_index = index
                    del model.ooms[-2]
                else:
                    failed = False
                    model.ooms.pop()
                    addr_of[tid] = addr
                    if on_alloc is not None:
                        on_alloc(index, event, addr)
                oom_seen = len(model.ooms)
        if failed:
            if oom_index is None:
                oom_index = index
            if stop_on_oom:
                break
        if every and (index % every == every - 1 or action == "step"):
            sample(index)
        index += 1
    result.seconds = time.perf_counter() - wall - hook_wall
    result.cpu_seconds = time.process_time() - cpu - hook_cpu
    result.stopped_at = index
    result.allocs, result.known, result.matched, result.oom_index = allocs, known, matched, oom_index
    return result


def _swap(new: AllocatorModel | None, old: AllocatorModel) -> AllocatorModel:
    """The model a hook returned (``None``: it kept the old one)."""
    return old if new is None else new


def _forget(addr_of: dict[int, int], addrs: list[int], index: int, on_evict: Callable | None) -> None:
    """Drop the tensors at ``addrs`` (a pool-mode cache evicted them) from ``addr_of``."""
    wanted = set(addrs)
    gone = [(tid, addr) for tid, addr in addr_of.items() if addr in wanted]
    for tid, _ in gone:
        del addr_of[tid]
    if on_evict is not None and gone:
        on_evict(index, gone)


#: events held at once by :func:`drive_chunks` (a few MB of events)
CHUNK_EVENTS = 1 << 16


def drive_chunks(events: Iterable, model: AllocatorModel, *, stop: int | None = None,
                 addr_of: dict[int, int] | None = None, chunk: int = CHUNK_EVENTS,
                 check: Callable[[list, int], None] | None = None, sample_every: int = 0,
                 on_sample: Callable | None = None, on_alloc: Callable | None = None,
                 on_free: Callable | None = None, on_step: Callable | None = None,
                 on_mark: Callable | None = None, **options) -> DriveResult:
    """:func:`drive` over an iterable of events read as a stream: ``chunk`` events at a time, so
    memory holds one chunk and the model's state, never the whole trace (a pool log of gigabytes).

    The result and every hook see the events' indices in the whole stream, as :func:`drive` over
    the same events as one list would (``sample_every`` is rounded so that chunks end on sample
    points; the samples fall on the same indices). ``check(chunk, offset)`` is called on each
    chunk before it runs (bounds, consistency). ``stop_on_oom`` and the other options pass through.

    Example:
        >>> from ms_memopt.allocators import create
        >>> from ms_memopt.core.events import Event
        >>> events = (Event("alloc", id=i, size=512) for i in range(5))
        >>> run = drive_chunks(events, create("torch"), chunk=2)
        >>> run.stopped_at, run.allocs
        (5, 5)
    """
    every = sample_every if on_sample is not None and sample_every and sample_every > 0 else 0
    if every:
        chunk = max(every, chunk - chunk % every)     # chunks end on sample points
    addr_of = {} if addr_of is None else addr_of
    total = DriveResult(model=model, addr_of=addr_of)
    iterator = iter(events)
    offset = 0

    def shifted(hook: Callable | None) -> Callable | None:
        if hook is None:
            return None
        return lambda index, *rest: hook(offset + index, *rest)

    while stop is None or offset < stop:
        size = chunk if stop is None else min(chunk, stop - offset)
        part = list(islice(iterator, size))
        if not part:
            break
        if check is not None:
            check(part, offset)
        oom_seen = len(total.model.ooms)
        run = drive(part, total.model, addr_of=addr_of, sample_every=every, on_sample=shifted(on_sample),
                    on_alloc=shifted(on_alloc), on_free=shifted(on_free), on_step=shifted(on_step),
                    on_mark=shifted(on_mark), **options)
        for oom in run.model.ooms[oom_seen:]:
            if oom.event_index is not None:
                oom.event_index += offset
        total.model = run.model
        total.allocs += run.allocs
        total.known += run.known
        total.matched += run.matched
        total.samples += run.samples
        total.seconds += run.seconds
        total.cpu_seconds += run.cpu_seconds
        if total.oom_index is None and run.oom_index is not None:
            total.oom_index = offset + run.oom_index
        total.stopped_at = offset + run.stopped_at
        if run.stopped_at < len(part):      # stop_on_oom stopped inside this chunk
            break
        offset += len(part)
    return total

"""One OOM kind everywhere: replay's ``OOMRecord.kind`` and the simulator's ``oom_kind`` agree.

The rule (:func:`ms_memopt.allocators.base.oom_kind`): ``"fragmentation"`` when the request
is at most ``free_total + device_free`` (it would fit if the free memory were one piece),
else ``"capacity"``.
"""
from __future__ import annotations

import doctest

import pytest

from ms_memopt.allocators import base, create, oom_kind
from ms_memopt.allocators.fast import AVAILABLE
from ms_memopt.core.events import Event, Trace
from ms_memopt.replay.replay import replay
from ms_memopt.simulation.simulate import SimConfig, _Run
from ms_memopt.workload.step import WorkloadSpec

GiB = 2**30
CAPACITY = 6 * GiB
FAST = [False, pytest.param(True, marks=pytest.mark.skipif(not AVAILABLE, reason="fast path not built"))]


def _events() -> list[Event]:
    """A 6 GiB card: four 1 GiB tensors (4 GiB reserved, one MindSpore block each), the 1st and
    3rd freed (2 GiB of holes, none larger than 1 GiB), 2 GiB not reserved, then 3 GiB asked."""
    return ([Event("alloc", id=i, size=GiB, tag="t") for i in range(1, 5)]
            + [Event("free", id=1, size=GiB), Event("free", id=3, size=GiB),
               Event("alloc", id=5, size=3 * GiB, tag="big")])


def test_rule():
    assert oom_kind(3 * GiB, 2 * GiB, 2 * GiB) == "fragmentation"
    assert oom_kind(4 * GiB, 2 * GiB, 2 * GiB) == "fragmentation"
    assert oom_kind(4 * GiB + 1, 2 * GiB, 2 * GiB) == "capacity"
    assert oom_kind(3 * GiB, 2 * GiB, None) == "capacity"       # unbounded / unknown: free_total alone
    assert oom_kind(2 * GiB, 2 * GiB, None) == "fragmentation"


def test_docstring_example():
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    for test in finder.find(base.oom_kind, "oom_kind", globs={"oom_kind": base.oom_kind}):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
    assert runner.summarize(verbose=False).attempted >= 3


@pytest.mark.parametrize("fast", FAST)
def test_replay_and_simulate_agree_on_the_6_gib_case(fast):
    # replay
    result = replay(Trace(_events()), create("mindspore", CAPACITY, fast=fast))
    assert len(result.ooms) == 1
    oom = result.ooms[0]
    assert (oom.size, oom.free_total, oom.device_free, oom.reserved) == (3 * GiB, 2 * GiB, 2 * GiB, 4 * GiB)
    assert oom.largest_free < oom.size
    assert oom.kind == "fragmentation" == oom.to_dict()["kind"]

    # the simulator's loop (the same events as workload rows, its own model from the config)
    cfg = SimConfig(steps=1, capacity=CAPACITY, allocator="mindspore", allocator_options={"fast": fast},
                    watch={}, scan_every=0, compact_every=None)
    run = _Run(WorkloadSpec(), "baseline", cfg, 0, None)
    rows = [tuple(getattr(e, f) for f in Event.__dataclass_fields__) for e in _events()]
    assert run.feed(1, rows) is False
    r = run.result
    assert (r.oom_step, r.oom_tag, r.oom_size) == (1, "big", 3 * GiB)
    assert r.free_total_at_oom == 2 * GiB
    assert r.oom_kind == oom.kind == "fragmentation"
    # and from the simulator's own readings, by the one rule
    assert oom_kind(r.oom_size, r.free_total_at_oom, CAPACITY - run.model.reserved) == r.oom_kind


@pytest.mark.parametrize("fast", FAST)
def test_capacity_when_even_all_free_memory_is_too_little(fast):
    events = _events()
    events[-1] = Event("alloc", id=5, size=5 * GiB, tag="big")        # 5 GiB > 2 + 2 GiB free
    result = replay(Trace(events), create("mindspore", CAPACITY, fast=fast))
    assert [o.kind for o in result.ooms] == ["capacity"]
    cfg = SimConfig(steps=1, capacity=CAPACITY, allocator="mindspore", allocator_options={"fast": fast},
                    watch={}, scan_every=0, compact_every=None)
    run = _Run(WorkloadSpec(), "baseline", cfg, 0, None)
    run.feed(1, [tuple(getattr(e, f) for f in Event.__dataclass_fields__) for e in events])
    assert run.result.oom_kind == "capacity"

"""What makes doctor fast on a big recording gives the answers it gave before (issue 43): the
compiled PyTorch model counts the slow path as the pure-Python one does, a model recording only its
first failures counts every failure, and the settings measured on forked workers rank as when
measured one after the other.
"""
from __future__ import annotations

import random

import pytest

from ms_memopt.allocators import create, fast
from ms_memopt.core.events import Event, Trace
from ms_memopt.doctor import remedies
from ms_memopt.doctor.remedies import measure_remedies, remedy_settings
from ms_memopt.replay.replay import replay

MiB = 2**20


def _churn(seed: int, count: int = 3000) -> Trace:
    """Allocations of 0.5 to 40 MiB freed in random order: a pool that grows, caches and fails."""
    rng = random.Random(seed)
    events, live, ident = [], [], 0
    for _ in range(count):
        if live and rng.random() < 0.45:
            events.append(Event("free", id=live.pop(rng.randrange(len(live)))))
        else:
            ident += 1
            events.append(Event("alloc", id=ident, size=rng.randrange(1, 80) * MiB // 2))
            live.append(ident)
    return Trace(events, source="churn")


@pytest.mark.skipif("torch" not in fast.FAST_MODELS, reason="the compiled models are not built")
@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_torch_model_counts_the_slow_path_as_the_reference(seed):
    trace = _churn(seed)
    results = [replay(trace, create("torch", 300 * MiB, fast=use_fast)) for use_fast in (False, True)]
    assert results[0].slow_path_events > 0
    assert [(r.slow_path_events, len(r.ooms), r.peak_reserved) for r in results] == \
        [(results[0].slow_path_events, len(results[0].ooms), results[0].peak_reserved)] * 2


@pytest.mark.parametrize("name", ["torch", "mindspore", "mindspore-vmm", "torch-expandable"])
@pytest.mark.parametrize("use_fast", [False, True])
def test_only_the_first_failures_are_recorded_and_every_one_is_counted(name, use_fast):
    trace = _churn(1)
    full = replay(trace, create(name, 200 * MiB, fast=use_fast))
    model = create(name, 200 * MiB, fast=use_fast)
    model.full_oom_records = 2
    counted = replay(trace, model)
    assert len(full.ooms) > 2 and full.oom_count == len(full.ooms)
    # the first two as in full, the rest counted: the compiled loop goes on past them
    assert counted.ooms == full.ooms[:2] and counted.oom_count == len(full.ooms)
    assert model.ooms_counted == len(full.ooms) - 2
    assert (counted.peak_reserved, counted.allocs, counted.slow_path_events, counted.final_layout) == \
        (full.peak_reserved, full.allocs, full.slow_path_events, full.final_layout)


@pytest.mark.parametrize("value", [0, -1])
def test_full_oom_records_takes_none_or_at_least_one(value):
    model = create("torch", 200 * MiB)
    model.full_oom_records = None
    if type(model).__module__.startswith("ms_memopt.allocators.fast"):
        with pytest.raises(ValueError, match=">= 1"):
            model.full_oom_records = value


def test_settings_measured_on_forked_workers_rank_as_one_after_the_other(monkeypatch):
    trace = _churn(2)
    settings = remedy_settings(trace, capacity=300 * MiB, allocator="torch")[0]
    assert len(settings) > 2
    seen: list[str] = []
    parallel = measure_remedies(trace, settings, capacity=300 * MiB, progress=seen.append)
    monkeypatch.setattr(remedies, "default_workers", lambda: 1)
    serial = measure_remedies(trace, settings, capacity=300 * MiB)
    assert [r.to_dict() for r in parallel] == [r.to_dict() for r in serial]
    assert seen == [s.setting for s in settings]

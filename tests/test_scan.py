"""Layout scans: records, the restart-safe log, warnings, failing sources, sources, rank merge,
and real ``Model.train`` runs on CPU with ``LayoutScanCallback``."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from ms_memopt.allocators.mindspore import MindSporePool
from ms_memopt.analysis.scan import (LayoutSource, Reading, ScanLog, Scanner, Source, check_watch, parse_watch,
                            read_scan_log)
from ms_memopt.cli import main as cli_main
from ms_memopt.core.errors import InputError
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.report.merge import merge_ranks

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
MiB = 1 << 20
RECORD_FIELDS = {"step", "rank", "time", "source", "reserved", "allocated", "free_total", "largest_free",
                 "frag_ratio", "device_free", "hole_histogram", "watch", "warnings"}


def _layout(holes=(3072,), live=1024, capacity=None) -> Layout:
    blocks, addr = [Block(0, live, True)], live
    for i, hole in enumerate(holes):
        blocks.append(Block(addr, hole, False))
        addr += hole
        if i < len(holes) - 1:
            blocks.append(Block(addr, 512, True))
            addr += 512
    return Layout([Segment(0, addr, blocks)], capacity=capacity)


class _Failing(Source):
    name = "broken"

    def __init__(self):
        self.calls = 0

    def read(self) -> Reading:
        self.calls += 1
        raise RuntimeError("device went away")


# --- records, watch, warnings -------------------------------------------------------------------
def test_scan_record_has_every_field_and_round_trips(tmp_path):
    scanner = Scanner([LayoutSource("arena", lambda: _layout((4096, 1024), capacity=1 << 20))],
                      log=ScanLog(tmp_path / "scan.jsonl"), every=10, watch={"bucket": "2KiB", "big": "2MiB"},
                      rank=3, source_reason="test")
    assert scanner.step(10) is not None and scanner.step(11) is None and scanner.step(20) is not None
    scanner.close()
    records = read_scan_log(tmp_path / "scan.jsonl")
    assert [r["step"] for r in records] == [10, 20]
    first = records[0]
    assert RECORD_FIELDS <= set(first)
    assert (first["rank"], first["source"], first["free_total"], first["largest_free"]) == (3, "arena", 5120, 4096)
    assert first["frag_ratio"] == pytest.approx(5120 / 4096 - 1)
    assert first["hole_histogram"] == {"1024": 1, "4096": 1}
    assert first["device_free"] == (1 << 20) - first["reserved"]
    forecasts = {name: w.pop("forecast") for name, w in first["watch"].items()}
    assert first["watch"]["bucket"] == {"size": 2048, "fits": True, "in_hole": True}
    assert first["watch"]["big"] == {"size": 2 * MiB, "fits": False, "in_hole": False}
    assert forecasts["bucket"]["status"] == "too_few_samples"      # docs/forecast.md
    assert first["extra"]["source_reason"] == "test" and "source_reason" not in records[1]["extra"]
    assert any("predicted OOM" in w and "'big'" in w for w in first["warnings"])


def test_watch_fits_when_the_pool_can_grow():
    reading = Reading(reserved=100, allocated=60, free_total=40, largest_free=10, device_free=1000)
    assert check_watch(reading, {"a": 500})["a"] == {"size": 500, "fits": True, "in_hole": False}
    unknown = Reading(reserved=100, allocated=60, free_total=40, largest_free=None)
    assert check_watch(unknown, {"a": 5})["a"]["fits"] is False


def test_frag_warning_is_logged_and_recorded(caplog):
    scanner = Scanner([LayoutSource("arena", lambda: _layout((1024, 1024, 1024, 1024, 1024)))], every=1, frag_warn=3.0)
    with caplog.at_level(logging.WARNING, logger="ms_memopt.analysis.scan"):
        record = scanner.step(1)
    assert record.frag_ratio == pytest.approx(4.0)
    assert any("frag_ratio 4.00 > frag_warn 3" in w for w in record.warnings)
    assert any("frag_ratio 4.00" in r.getMessage() for r in caplog.records)
    calm = Scanner([LayoutSource("arena", lambda: _layout((1024, 1024)))], every=1, frag_warn=3.0)
    assert calm.step(1).warnings == []


@pytest.mark.parametrize("kwargs", [dict(every=0), dict(every=-5), dict(every=1.5), dict(watch={"ar": "4.2XB"}),
                                    dict(watch={"ar": 0}), dict(watch={"ar": "-1GB"}), dict(frag_warn=-1)])
def test_configuration_errors_raise_before_any_step(kwargs):
    with pytest.raises(InputError):
        Scanner([LayoutSource("arena", _layout)], **kwargs)


def test_parse_watch_names_the_key():
    assert parse_watch({"allreduce": "4.2GB"}) == {"allreduce": 4_200_000_000}
    with pytest.raises(InputError, match="watch.allreduce"):
        parse_watch({"allreduce": "lots"})


def test_failing_source_is_logged_once_and_skipped(tmp_path, caplog):
    broken = _Failing()
    scanner = Scanner([broken, LayoutSource("arena", _layout)], log=ScanLog(tmp_path / "s.jsonl"), every=1)
    with caplog.at_level(logging.WARNING, logger="ms_memopt.analysis.scan"):
        records = [scanner.step(s) for s in range(1, 6)]
    assert broken.calls == 1
    assert [r.source for r in records] == ["arena"] * 5
    assert sum("device went away" in r.getMessage() for r in caplog.records) == 1
    errors = read_scan_log(tmp_path / "s.jsonl", kinds=("source_error",))
    assert len(errors) == 1 and errors[0]["source"] == "broken"
    alone = Scanner([_Failing()], every=1)
    assert [alone.step(s) for s in (1, 2)] == [None, None]      # nothing left: scans skipped, no raise


# --- the log: torn lines, restarts, SIGKILL ---------------------------------------------------------
def test_log_drops_torn_line_and_does_not_duplicate_on_restart(tmp_path):
    path = tmp_path / "scan.jsonl"
    scanner = Scanner([LayoutSource("arena", _layout)], log=ScanLog(path), every=1)
    for step in (1, 2, 3):
        scanner.step(step)
    scanner.close()
    with open(path, "ab") as handle:
        handle.write(b'{"kind":"scan","step":4,"ra')             # killed mid-write
    log = ScanLog(path)
    assert log.last_step == 3 and log.resumed
    again = Scanner([LayoutSource("arena", _layout)], log=log, every=1)
    for step in (2, 3, 4, 5):                                  # resumed from an older checkpoint
        again.step(step)
    again.close()
    assert [r["step"] for r in read_scan_log(path)] == [1, 2, 3, 4, 5]
    assert path.read_bytes().endswith(b"\n")


_CHILD = textwrap.dedent("""
    import sys, time
    from ms_memopt.core.layout import Block, Layout, Segment
    from ms_memopt.analysis.scan import LayoutSource, ScanLog, Scanner
    path, start = sys.argv[1], int(sys.argv[2])
    seg = Segment(0, 1 << 20, [Block(0, 4096, True), Block(4096, (1 << 20) - 4096, False)])
    scanner = Scanner([LayoutSource("arena", lambda: Layout([seg]))], log=ScanLog(path), every=1,
                      watch={"x": "1MiB"}, frag_warn=None)
    print("ready", flush=True)
    step = start
    while True:
        scanner.step(step)
        step += 1
        if step % 50 == 0:
            time.sleep(0.001)
""")


def _line_count(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _wait_for_lines(path, lines: int, child, limit: float = 300.0) -> None:
    """Until ``path`` holds ``lines`` complete lines: a count, not a sleep, so a slow machine
    only waits longer (``limit`` is a hang bound)."""
    deadline = time.monotonic() + limit
    while _line_count(path) < lines:
        assert child.poll() is None, "the child exited early"
        assert time.monotonic() < deadline, f"fewer than {lines} lines after {limit:g} s"
        time.sleep(0.01)


def test_sigkill_leaves_parseable_log_and_restart_appends(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    path = tmp_path / "rank_0" / "scan.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for start in (1, None):
        if start is None:                                       # restart from an older "checkpoint"
            steps = [r["step"] for r in read_scan_log(path)]
            start = max(1, steps[-1] - 25)
        child = subprocess.Popen([sys.executable, str(script), str(path), str(start)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            assert child.stdout.readline().strip() == b"ready"
            _wait_for_lines(path, _line_count(path) + 60, child)   # killed while writing, at any speed
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
        data = path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        for line in complete.splitlines():
            json.loads(line)                                    # every complete line parses
    steps = [r["step"] for r in read_scan_log(path)]
    assert len(steps) > 50
    assert steps == list(range(1, len(steps) + 1)), "records lost or duplicated across the restart"


# --- rank merge and the report command -------------------------------------------------------------
def _write_rank(root: Path, rank: int, frags: dict[int, float | None]):
    log = ScanLog(root / f"rank_{rank}" / "scan.jsonl")
    for step, frag in frags.items():
        log.write({"kind": "scan", "step": step, "rank": rank, "frag_ratio": frag, "free_total": 100,
                   "largest_free": 50 + rank, "watch": {"ar": {"size": 80, "fits": rank != 2, "in_hole": False}},
                   "warnings": []})
    log.close()


def test_merge_ranks_per_step_max_median_worst(tmp_path, capsys):
    _write_rank(tmp_path, 0, {100: 0.5, 200: 1.0})
    _write_rank(tmp_path, 1, {100: 3.0, 200: 0.2})
    _write_rank(tmp_path, 2, {100: 1.0, 200: None})
    merged = merge_ranks(tmp_path)
    assert merged.ranks == [0, 1, 2]
    first, second = merged.steps
    assert (first.step, first.ranks, first.frag_max, first.frag_median, first.worst_rank) == (100, 3, 3.0, 1.0, 1)
    assert (second.frag_max, second.frag_median, second.worst_rank) == (1.0, 0.6, 0)
    assert first.largest_free_min == 50 and first.watch_failures == 1
    assert cli_main(["report", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"][0]["worst_rank"] == 1
    assert cli_main(["report", str(tmp_path)]) == 0
    assert "frag max" in capsys.readouterr().out


def test_report_bad_input_exits_2(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 2
    (tmp_path / "rank_0").mkdir()
    (tmp_path / "rank_0" / "scan.jsonl").write_text('{"step": 1}\nnot json\n')
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "scan.jsonl:2" in capsys.readouterr().err


# --- device source through a fake device ------------------------------------------------------------
from ms_memopt.mindspore.sources import ArenaSource, DeviceMemoryAPI, DeviceSource, block_bases, make_sources  # noqa: E402


class FakeDevice(DeviceMemoryAPI):
    """A device whose pool is the ``mindspore`` allocator model."""

    def __init__(self, pool: MindSporePool, dumps=(), target="Ascend"):
        self.pool, self.dumps, self.target, self.probes = pool, list(dumps), target, 0

    def device_target(self):
        return self.target

    def capacity(self):
        return self.pool.capacity

    def memory_stats(self):
        layout = self.pool.layout()
        info = {s.addr: {"block_stream_id": s.stream, "block_memory_size": s.size} for s in layout.segments}
        return {"total_reserved_memory": self.pool.reserved, "total_allocated_memory": self.pool.allocated,
                "total_idle_memory": self.pool.reserved - self.pool.allocated, "total_eager_free_memory": 0,
                "common_mem_pool_stats": {"block_unit_size": 1 << 30, "block_counts": len(info), "blocks_info": info},
                "persistent_mem_pool_stats": {"block_unit_size": 1 << 30, "block_counts": 0, "blocks_info": {}}}

    def debug_dump_files(self):
        return self.dumps

    def try_alloc(self, nbytes):
        self.probes += 1
        before = self.pool.reserved
        addr = self.pool.malloc(nbytes)
        if addr is None:
            self.pool.ooms.pop()
            return False
        self.pool.free(addr)
        grown = self.pool.reserved > before
        self.pool.empty_cache() if grown else None
        return not grown


def _fragmented_pool() -> MindSporePool:
    pool = MindSporePool(capacity=256 * MiB, increase_size=64 * MiB)
    addrs = [pool.malloc(4 * MiB) for _ in range(16)]
    for a in addrs[1:8:2]:
        pool.free(a)                    # four 4 MiB holes
    pool.free(addrs[15])                # merges with the block's tail
    return pool


def test_device_source_probe_finds_largest_hole_with_bounded_allocations():
    pool = _fragmented_pool()
    expected = pool.largest_free()
    api = FakeDevice(pool)
    reading = DeviceSource(api, largest="probe", probe_granularity=MiB, probe_limit=16).read()
    assert reading.largest_free == expected // MiB * MiB
    assert reading.reserved == pool.reserved and reading.free_total == pool.reserved - pool.allocated
    assert reading.device_free == 256 * MiB - pool.reserved
    assert reading.extra["largest_from"] == "probe" and api.probes <= 16
    assert pool.reserved == 64 * MiB                  # probing left the pool as it was


def test_device_source_reads_a_fresh_pool_debug_dump(tmp_path):
    dump = tmp_path / "MemoryDebugInfo0.txt"
    dump.write_text(
        'The dynamic memory pool stat info : {"in used mem":2.00MB,"peak used mem":2.00MB,"alloc mem":8.00MB,'
        '"idle mem":6.00MB,"used by event mem":0.00MB,"eager free mem":0.00MB}\n'
        "\tIn used mem buf info for Mem buf allocator, enable vmm : 0, is persistent : 0, stream id : 0, "
        "is small : 0, is customized : 0., mem_bufs size : 2\n"
        '\t\t{"addr_":0x10000000,"size_":1048576,"stream_id_":0,"status_":used,"owner_name_":a,"alloc_type_":Kernel}\n'
        '\t\t{"addr_":0x10300000,"size_":1048576,"stream_id_":0,"status_":used,"owner_name_":b,"alloc_type_":Kernel}\n'
        "stream id : 0, is persistent : 0\n"
        "Dump debug info for Mem buf allocator, enable vmm : 0, is persistent : 0, stream id : 0, "
        "is small : 0, is customized : 0.\n"
        "\tMem block info - total count : 1\n"
        '\t\t{"addr_":0x10000000,"size_":8388608,"stream_id_":0,"min_addr_":0x10000000,"max_addr_":0x10400000}\n'
        "\tFree mem buf info - total count : 2\n"
        '\t\t{"addr_":0x10100000,"size_":2097152,"stream_id_":0,"status_":idle,"owner_name_":,"alloc_type_":Other}\n'
        '\t\t{"addr_":0x10400000,"size_":4194304,"stream_id_":0,"status_":idle,"owner_name_":,"alloc_type_":Other}\n'
        "\tEager free mem buf info - total count : 0\n")
    api = FakeDevice(MindSporePool(capacity=1 << 30), dumps=[dump])
    source = DeviceSource(api, largest="dump")
    reading = source.read()
    assert (reading.largest_free, reading.hole_histogram) == (4 * MiB, {str(2 * MiB): 1, str(4 * MiB): 1})
    assert reading.extra["largest_from"] == "dump:MemoryDebugInfo0.txt"
    assert source.read().largest_free is None          # the same dump is not fresh any more


def test_device_source_reads_the_sample_pool_debug_dump(tmp_path):
    """The recorded-format sample in tests/data through the real reader: holes from the dump, totals from the stats."""
    dump = tmp_path / "MemoryDebugInfo3.txt"
    shutil.copyfile(DATA / "MemoryDebugInfo0.txt", dump)
    pool = _fragmented_pool()
    reading = DeviceSource(FakeDevice(pool, dumps=[dump])).read()
    # the sample's largest idle buffer: the tail of the 2 GiB block after the FlashAttention workspace
    assert reading.largest_free == 1935671296
    assert reading.hole_histogram == {str(MiB): 1, str(64 * MiB): 1, str(512 * MiB): 3, str(1 << 30): 1}
    assert reading.extra["largest_from"] == "dump:MemoryDebugInfo3.txt"
    assert reading.extra["dump_reserved"] == 5 << 30                  # 5120.00MB "alloc mem" in the sample
    assert reading.reserved == pool.reserved and reading.allocated == pool.allocated  # current stats win
    again = DeviceSource(FakeDevice(pool, dumps=[]))
    assert again.read().extra["largest_from"] == "probe"   # no dump: falls back to the probe


def test_block_bases_from_memory_stats():
    stats = FakeDevice(_fragmented_pool()).memory_stats()
    assert block_bases(stats) == [(1 << 32, 64 * MiB, 0, "common")]


def test_block_bases_read_pycapsule_addresses():
    """On a device ``blocks_info`` is keyed by PyCapsules; an unreadable key leaves the base unknown."""
    import ctypes

    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new_capsule(0x12C080000000, None, None)
    stats = {"common_mem_pool_stats": {"blocks_info": {capsule: {"block_memory_size": 1 << 30},
                                                        object(): {"block_memory_size": 1 << 30}}}}
    assert block_bases(stats) == [(0x12C080000000, 1 << 30, 0, "common"), (None, 1 << 30, 0, "common")]


def test_auto_picks_the_device_on_ascend_and_says_why():
    sources, reason = make_sources("auto", device_api=FakeDevice(_fragmented_pool()))
    assert [s.name for s in sources] == ["device"] and "Ascend" in reason
    arena = types.SimpleNamespace(layout=_layout)
    sources, reason = make_sources("auto", device_api=FakeDevice(_fragmented_pool(), target="CPU"), arenas=[arena])
    assert [s.name for s in sources] == ["arena"] and "arena" in reason
    with pytest.raises(InputError):
        make_sources("auto", device_api=FakeDevice(_fragmented_pool(), target="CPU"))
    with pytest.raises(InputError):
        make_sources("gpu-magic")
    with pytest.raises(InputError):
        ArenaSource([object()])


# --- real training on CPU ---------------------------------------------------------------------------------
ms = pytest.importorskip("mindspore")
from mindspore import nn  # noqa: E402

from ms_memopt.mindspore.scan_callback import LayoutScanCallback, Scanner as MSScanner  # noqa: E402
from ms_memopt.mindspore.sources import ShadowModelSource  # noqa: E402


class _TinyNet(nn.Cell):
    def __init__(self, d=16, hidden=32, layers=2):
        super().__init__()
        self.body = nn.SequentialCell([nn.SequentialCell([nn.Dense(d, hidden), nn.ReLU(), nn.Dense(hidden, d)])
                                       for _ in range(layers)])
        self.head = nn.Dense(d, 4)

    def construct(self, x):
        return self.head(self.body(x))


def _dataset(n=32, batch=4, d=16):
    import mindspore.dataset as ds
    import numpy as np
    rng = np.random.default_rng(0)
    return ds.NumpySlicesDataset({"x": rng.standard_normal((n, d)).astype(np.float32),
                                  "y": rng.integers(0, 4, n).astype(np.int32)}, shuffle=False).batch(batch)


def _train(log_dir, *, batch=4, hidden=32, steps=8, callback_kwargs=None):
    from mindspore.train import Model
    net = _TinyNet(hidden=hidden)
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Adam(net.trainable_params(), 1e-3)
    kwargs = dict(every=2, log_dir=log_dir, watch={"bucket": "64KiB"},
                  model_options={"options": {"increase_size": 16 * 1024}})
    kwargs.update(callback_kwargs or {})
    cb = LayoutScanCallback(**kwargs)
    Model(net, loss, opt).train(1, _dataset(n=steps * batch, batch=batch), callbacks=[cb], dataset_sink_mode=False)
    return cb


@pytest.mark.mindspore
def test_model_train_writes_a_parseable_scan_log(tmp_path):
    cb = _train(tmp_path / "memlog")
    records = read_scan_log(tmp_path / "memlog" / "rank_0" / "scan.jsonl")
    assert [r["step"] for r in records] == [1, 2, 4, 6, 8]
    for rec in records:
        assert RECORD_FIELDS <= set(rec) and rec["source"] == "model"
        assert rec["allocated"] + rec["free_total"] == rec["reserved"] > 0
        assert rec["extra"]["activations_observed"] > 0
        assert set(rec["watch"]) == {"bucket"}
    assert "shadow" in records[0]["extra"]["source_reason"]
    assert len(cb.records) == 5


@pytest.mark.mindspore
def test_shadow_numbers_follow_model_and_batch(tmp_path):
    def last(cb):
        return cb.records[-1]
    base = last(_train(tmp_path / "a", batch=4, hidden=32))
    bigger_batch = last(_train(tmp_path / "b", batch=16, hidden=32))
    wider = last(_train(tmp_path / "c", batch=4, hidden=64))
    # a bigger batch: same weights, more activation memory at the step's peak
    assert bigger_batch.allocated == base.allocated
    assert bigger_batch.extra["activation_bytes"] > base.extra["activation_bytes"]
    assert bigger_batch.extra["step_peak_allocated"] > base.extra["step_peak_allocated"]
    assert bigger_batch.reserved >= base.reserved
    # a wider model: more parameters and optimizer states held between steps
    assert wider.allocated > base.allocated
    assert wider.extra["gradient_bytes"] == pytest.approx(
        base.extra["gradient_bytes"] * (wider.allocated / base.allocated), rel=0.35)


@pytest.mark.mindspore
def test_failing_source_does_not_stop_training(tmp_path):
    broken = _Failing()
    cb = _train(tmp_path / "log", callback_kwargs={"source": [broken]})
    assert broken.calls == 1 and cb.records == []
    errors = read_scan_log(tmp_path / "log" / "rank_0" / "scan.jsonl", kinds=("source_error",))
    assert len(errors) == 1 and "device went away" in errors[0]["error"]


@pytest.mark.mindspore
def test_stop_on_predicted_oom_requests_stop(tmp_path):
    cb = _train(tmp_path / "log", steps=8, callback_kwargs={
        "watch": {"allreduce": "4.2GB"}, "capacity": "1MB", "stop_on_predicted_oom": True, "every": 2})
    assert cb.stop_message and "allreduce" in cb.stop_message
    assert cb.records[-1].step < 8 and cb.records[-1].predicted_oom


@pytest.mark.mindspore
@pytest.mark.parametrize("kwargs", [dict(every=0), dict(watch={"allreduce": "4.2 parsecs"}), dict(source="nvml")])
def test_callback_configuration_errors_raise_at_construction(kwargs):
    with pytest.raises(InputError):
        LayoutScanCallback(**kwargs)


@pytest.mark.mindspore
def test_custom_loop_scanner_with_value_and_grad(tmp_path):
    import numpy as np
    net = _TinyNet()
    opt = nn.SGD(net.trainable_params(), 0.01)
    loss_fn = nn.MSELoss()

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    scanner = MSScanner(net, opt, every=3, log_dir=tmp_path, source="model", rank=5,
                        model_options={"options": {"increase_size": 16 * 1024}})
    assert isinstance(scanner.sources[0], ShadowModelSource)
    x = ms.Tensor(np.ones((4, 16), np.float32))
    y = ms.Tensor(np.zeros((4, 4), np.float32))
    shadow = scanner.sources[0]
    armed = []
    for step in range(1, 7):
        _, grads = grad_fn(x, y)
        opt(grads)
        scanner.step(step)
        armed.append(bool(shadow._handles))
    scanner.close()
    assert armed == [False, True, False, False, True, False]     # hooks only for steps 3 and 6
    assert not shadow._handles
    records = read_scan_log(tmp_path / "rank_5" / "scan.jsonl")
    assert [r["step"] for r in records] == [1, 3, 6] and all(r["rank"] == 5 for r in records)
    assert records[-1]["extra"]["activations_observed"] > 0


def test_device_source_falls_back_to_probe_on_an_unreadable_dump(tmp_path):
    dump = tmp_path / "MemoryDebugInfo0.txt"
    dump.write_text("garbage")                          # the real reader rejects it with an InputError
    pool = _fragmented_pool()
    reading = DeviceSource(FakeDevice(pool, dumps=[dump]), probe_granularity=MiB).read()
    assert reading.extra["largest_from"] == "probe" and reading.largest_free == pool.largest_free()


def test_under_vmm_a_scan_judges_by_what_can_be_mapped_not_by_the_holes():
    """A VMM pool maps pages on demand: a request larger than every hole still fits while the
    free memory covers it, and no frag warning is raised for holes."""
    from ms_memopt.analysis.scan import Reading, Scanner, Source

    class Fixed(Source):
        name = "fixed"

        def read(self):
            return Reading(reserved=10 << 30, allocated=4 << 30, free_total=6 << 30, largest_free=1 << 30,
                           device_free=2 << 30)

    for vmm, fits in ((True, True), (False, False)):
        scanner = Scanner([Fixed()], every=1, watch={"bucket": "4GB"}, frag_warn=1.0,
                          pool={"kind": "ascend-vmm" if vmm else "ascend-bestfit", "vmm": vmm})
        record = scanner.step(1)
        assert record.watch["bucket"]["fits"] is fits
        assert record.extra["pool"]["vmm"] is vmm
        assert ("vmm" in record.extra) is vmm
        assert any("frag_ratio" in w for w in record.warnings) is (not vmm)


def test_a_probe_that_grew_a_pool_which_keeps_the_block_stops_probing():
    """On the best-fit pool ``empty_cache`` gives nothing back (MindSpore 2.10 only warns): a
    failed try leaves its grown block, and later tries would land in memory the probe itself
    added. The source stops probing and says why instead of measuring its own growth."""
    pool = _fragmented_pool()

    class KeepsGrowth(FakeDevice):
        def try_alloc(self, nbytes):
            self.probes += 1
            before = self.pool.reserved
            addr = self.pool.malloc(nbytes)
            self.pool.free(addr)
            grown = self.pool.reserved > before
            self.growth_kept = self.growth_kept or grown      # no empty_cache on this pool
            return not grown

    api = KeepsGrowth(pool)
    source = DeviceSource(api, largest="probe", probe_granularity=MiB, probe_limit=16)
    first = source.read()
    grown_tries = api.probes
    assert api.growth_kept and first.largest_free is not None
    second = source.read()
    assert second.largest_free is None and "probing stopped" in second.extra["largest_from"]
    assert api.probes == grown_tries                              # no try after the growth


def test_dumps_of_other_ranks_are_not_read(tmp_path):
    from ms_memopt.mindspore.sources import own_rank_dumps

    paths = [tmp_path / "rank_0" / "MemoryDebugInfo0.txt", tmp_path / "rank_1" / "MemoryDebugInfo0.txt"]
    assert own_rank_dumps(paths, 1) == [paths[1]]


def test_device_source_under_vmm_reports_what_can_be_mapped():
    pool = _fragmented_pool()
    api = FakeDevice(pool)
    reading = DeviceSource(api, vmm=True).read()
    assert api.probes == 0                                     # a probe would measure mapped idle pages
    assert reading.largest_free == 256 * MiB - pool.allocated
    assert reading.extra["largest_from"].startswith("vmm")

"""The forecast in scans (core Scanner, LayoutScanCallback), in CompactionCallback and in the
simulator's ``compact`` policy."""
from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest

from ms_memopt.analysis.forecast import DEFAULT_RISK
from ms_memopt.analysis.scan import Reading, ScanLog, Scanner, Source, read_scan_log
from ms_memopt.simulation.simulate import SimConfig, simulate_policy
from test_simulate import small_spec

MiB = 2**20


class _Shrinking(Source):
    """A pool whose largest hole loses ``drop`` bytes per read while long-lived memory grows;
    ``restore()`` (a compaction) gives the hole back."""

    name = "shrinking"

    def __init__(self, start=60 * MiB, drop=2 * MiB) -> None:
        self.start, self.drop, self.reads = start, drop, 0

    def read(self) -> Reading:
        self.reads += 1
        largest = self.start - self.drop * self.reads
        allocated = 20 * MiB + MiB * self.reads
        return Reading(reserved=100 * MiB, allocated=allocated, free_total=100 * MiB - allocated,
                       largest_free=largest, device_free=0)

    def restore(self) -> None:
        self.reads = 0


def test_scanner_records_the_forecast_and_warns_with_the_step(tmp_path, caplog):
    source = _Shrinking()
    scanner = Scanner([source], log=ScanLog(tmp_path / "scan.jsonl"), every=1, watch={"bucket": 10 * MiB},
                      frag_warn=None, forecast_within=10)
    caplog.set_level(logging.WARNING, logger="ms_memopt.analysis.scan")
    for step in range(1, 21):
        scanner.step(step)
    scanner.close()
    records = read_scan_log(tmp_path / "scan.jsonl")
    # too few samples for the first five scans: a forecast is recorded, never a step
    assert all(r["watch"]["bucket"]["forecast"]["status"] == "too_few_samples" for r in records[:5])
    # 60 MiB - 2 MiB * step < 10 MiB from step 26 on
    assert records[-1]["watch"]["bucket"]["forecast"]["step"] == 26
    assert scanner.records[-1].forecast_step == 26
    warned = [r for r in records if any(w.startswith("forecast:") for w in r["warnings"])]
    # the first scan whose next 10 steps reach the request: at 15, step 25 sits at exactly
    # 10 MiB (even odds of falling below it, a probability >= the default risk)
    assert warned and warned[0]["step"] == 15
    assert "step 26" in warned[0]["warnings"][0]
    assert any("stops fitting in one piece in ~10 steps (step 26" in m for m in caplog.messages)
    assert scanner.forecast().step == 26
    scanner.reset_forecast(20)
    assert scanner.forecast() is None


def test_scanner_without_forecast_within_never_warns_from_the_forecast():
    scanner = Scanner([_Shrinking()], every=1, watch={"bucket": 10 * MiB}, frag_warn=None)
    records = [scanner.step(step) for step in range(1, 21)]
    assert records[-1].watch["bucket"]["forecast"]["step"] == 26
    assert not any(r.warnings for r in records)


@pytest.mark.parametrize("value", [-1, 1.5, True, "10"])
def test_bad_forecast_within_is_an_input_error(value):
    from ms_memopt.core.errors import InputError
    with pytest.raises(InputError, match="forecast_within"):
        Scanner([_Shrinking()], every=1, watch={"bucket": MiB}, forecast_within=value)


@pytest.mark.mindspore
def test_model_train_compacts_when_the_forecast_warns(tmp_path):
    """A tiny ``Model.train``: LayoutScanCallback forecasts, CompactionCallback compacts at the
    first warning, the forecast starts afresh."""
    ms = pytest.importorskip("mindspore")
    import mindspore.dataset as ds
    from mindspore import nn
    from mindspore.train import Callback, Model

    from ms_memopt.analysis.arena import Arena
    from ms_memopt.mindspore.compaction import CompactionCallback
    from ms_memopt.mindspore.scan_callback import LayoutScanCallback

    ms.set_seed(0)
    source = _Shrinking()
    scan = LayoutScanCallback(every=1, log_dir=tmp_path, source=[source], watch={"bucket": 10 * MiB},
                              frag_warn=None, forecast_within=10, rank=0)
    arena = Arena(8 * 1024, alignment=1024)
    for handle in [arena.alloc(1024) for _ in range(8)][::2]:
        arena.free(handle)
    compaction = CompactionCallback(every=1, when_forecast_within=10, forecast_from=scan, arenas=[arena],
                                    live=False, barrier=None, log_dir=tmp_path)

    class _Restore(Callback):     # the compaction gives the synthetic pool its hole back
        def on_train_step_end(self, run_context):
            if compaction.records and compaction.records[-1]["step"] == run_context.original_args().cur_step_num:
                source.restore()

    rng = np.random.default_rng(0)
    data = ds.NumpySlicesDataset({"x": rng.standard_normal((20, 4)).astype(np.float32),
                                  "y": rng.standard_normal((20, 2)).astype(np.float32)}, shuffle=False).batch(1)
    net = nn.Dense(4, 2)
    Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.01)).train(
        1, data, callbacks=[scan, compaction, _Restore()], dataset_sink_mode=False)
    # the first warning (as in the scanner test above: step 25 at exactly the request)
    assert [r["step"] for r in compaction.records] == [15]
    lines = read_scan_log(tmp_path / "rank_0" / "scan.jsonl", kinds=("scan", "compaction"))
    assert [l["kind"] for l in lines].count("compaction") == 1
    after = [l for l in lines if l["kind"] == "scan" and l["step"] > 15]
    # the forecast restarted at the compaction: too few samples for the five scans left
    assert [l["watch"]["bucket"]["forecast"]["status"] for l in after] == ["too_few_samples"] * 5
    with pytest.raises(Exception, match="forecast_from"):
        CompactionCallback(every=1, when_forecast_within=10)


def test_compact_policy_compacts_on_the_forecast_and_survives():
    """The tight small card: the baseline dies; the forecast-triggered ``compact`` policy (no
    periodic compaction) compacts where its forecast warned and lives longer."""
    spec = small_spec()
    cfg = SimConfig(steps=300, capacity=120 * MiB, allocator="mindspore", allocator_options={"pregrow": True},
                    scan_every=10, compact_every=None, watch={"allreduce": 12 * MiB}, forecast_within=30)
    base = simulate_policy(spec, "baseline", cfg, seed=0)
    buf = io.StringIO()
    comp = simulate_policy(spec, "compact", cfg, seed=0, timeline=buf)
    rows = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert base.oom_step is not None and base.forecast_warned_at is not None
    assert base.forecast_warned_at < base.oom_step
    compactions = [r for r in rows if r["kind"] == "compaction"]
    assert compactions and all(r["why"] == "warning" for r in compactions)
    assert comp.compactions == len(compactions)
    scans = {r["step"]: r for r in rows if r["kind"] == "scan"}
    for c in compactions:      # each compaction follows a scan whose forecast warned within 30 steps
        fc = scans[c["step"]]["forecast"]
        assert fc["within"] == 30
        assert fc["status"] == "below" or fc["probability"] >= DEFAULT_RISK
    assert comp.oom_step is None or comp.oom_step > base.oom_step
    # the margin trigger is still there, and differs
    margin = simulate_policy(spec, "compact", SimConfig(**{**cfg.__dict__, "compact_trigger": "margin"}), seed=0)
    assert margin.compactions != comp.compactions
    with pytest.raises(ValueError, match="compact_trigger"):
        SimConfig(compact_trigger="sometimes")


def test_report_draws_the_latest_forecast_on_the_timeline(tmp_path, monkeypatch):
    from ms_memopt.report import build, plots
    scanner = Scanner([_Shrinking()], log=ScanLog(tmp_path / "run" / "rank_0" / "scan.jsonl"), every=1,
                      watch={"bucket": 10 * MiB}, frag_warn=None)
    for step in range(1, 21):
        scanner.step(step)
    scanner.close()
    seen = {}
    draw = plots.plot_timeline

    def capture(series, path, *, markers=(), **kw):
        seen["markers"] = list(markers)
        return draw(series, path, markers=markers, **kw)     # drawn for real

    monkeypatch.setattr(plots, "plot_timeline", capture)
    png = plots.plot_scan_timeline(build._scan_logs(tmp_path / "run"), tmp_path / "timeline.png")
    assert png.stat().st_size > 0
    forecasts = [m for m in seen["markers"] if m.kind == "forecast"]
    assert len(forecasts) == 1
    m = forecasts[0]
    assert (m.series, m.step, m.largest_free) == ("rank 0", 26, 10 * MiB)
    assert m.low <= 26 <= m.high

    # a simulation timeline: the last forecast of each policy, an open-ended interval allowed
    spec = small_spec()
    cfg = SimConfig(steps=240, capacity=120 * MiB, allocator="mindspore", allocator_options={"pregrow": True},
                    scan_every=10, compact_every=None, watch={"allreduce": 12 * MiB})
    with open(tmp_path / "timeline.jsonl", "w") as out:
        simulate_policy(spec, "baseline", cfg, seed=0, timeline=out)
    monkeypatch.setattr(plots, "plot_timeline", capture)
    plots.plot_fragmentation_timeline(tmp_path / "timeline.jsonl", tmp_path / "sim.png")
    forecasts = [m for m in seen["markers"] if m.kind == "forecast"]
    assert len(forecasts) == 1 and forecasts[0].series == "baseline"
    draw({"a": [(1, 2 * MiB, MiB, 1.0)]}, tmp_path / "open.png",
                        markers=[plots.Marker("a", 5, "forecast", MiB, low=3, high=None)])

"""The scoring of bench/forecast.py: rules are compared on the same runs, by the same counts."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[1] / "bench" / "forecast.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_forecast", _BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(oom_step, warnings, steps=1000):
    return {"oom_step": oom_step, "first_warning": warnings, "predicted": {}, "steps": steps}


RUNS = [
    _run(500, {"a": 300, "b": 450, "f": 200}),
    _run(600, {"a": 420, "b": 595, "f": 350}),   # b warns 5 steps ahead: not in time
    _run(None, {"a": 700, "b": 900, "f": None}),  # b's warning is in the censored tail
    _run(None, {"a": None, "b": None, "f": 100}),
]


def test_score_counts_in_time_warnings_and_censored_false_alarms(bench):
    a = bench.score(RUNS, "a", min_lead=10, censor=150)
    assert (a["warned"], a["median_lead_steps"], a["false_alarms"]) == (2, 190, 1)
    b = bench.score(RUNS, "b", min_lead=10, censor=150)
    assert (b["warned"], b["median_lead_steps"], b["false_alarms"]) == (1, 50, 0)
    assert b["warned_share"] == 0.5 and b["false_alarm_rate"] == 0.0


def test_dominance_needs_every_axis_at_least_as_good_and_one_better(bench):
    def setting(name, warned, lead, false_alarms):
        return {"setting": name, "warned": warned, "median_lead_steps": lead, "false_alarms": false_alarms,
                "false_alarm_rate": false_alarms / 10}

    forecasts = [setting("f1", 10, 150, 0), setting("f2", 10, 220, 3)]
    baseline = [setting("cheap", 8, 60, 0),        # f1 warns more, earlier, as few false alarms
                setting("equal", 10, 150, 0),      # f1 only equals it: not dominated by f1
                setting("early", 10, 200, 2),      # f1 fewer false alarms but shorter lead; f2 more alarms
                setting("noisy", 10, 210, 5)]      # f2: longer lead, fewer false alarms
    d = bench._dominance(forecasts, baseline)
    assert d["by"] == {"cheap": "f1", "equal": None, "early": None, "noisy": "f2"}
    assert [b["setting"] for b in d["undominated"]] == ["equal", "early"]
    assert d["dominated"] == 2 and d["settings"] == 4
    assert d["undominated_min_false_alarm_rate"] == 0.0

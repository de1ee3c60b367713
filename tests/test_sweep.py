"""``ms-memopt sweep``: the job simulation over a grid of recipe settings."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from ms_memopt.core.errors import InputError
from ms_memopt.simulation.sweep import apply_setting, grid_points, parse_settings

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "dense_100b_1024x910c.yaml"


def _need_recipe():
    if not RECIPE.exists():
        pytest.skip("recipes/dense_100b_1024x910c.yaml not in this tree")


def test_settings_and_grid():
    grid = parse_settings(["memopt.device.hbm=64GB, 96GB", "parallel_config.micro_batch_num=8,16",
                           "memopt.pool_mode=true"])
    assert grid == {"memopt.device.hbm": ["64GB", "96GB"], "parallel_config.micro_batch_num": [8, 16],
                    "memopt.pool_mode": [True]}
    points = grid_points(grid)
    assert len(points) == 4
    assert points[1] == (("memopt.device.hbm", "64GB"), ("parallel_config.micro_batch_num", 16),
                         ("memopt.pool_mode", True))


@pytest.mark.parametrize("items, match", [
    (["memopt.device.hbm"], "KEY=V1"),
    (["=8"], "KEY=V1"),
    (["a..b=1"], "KEY=V1"),
    (["memopt.device.hbm=64GB,"], "empty value"),
    (["memopt.device.hbm=64GB", "memopt.device.hbm=96GB"], "set twice"),
    (["memopt.device.hbm=[1]"], "not a single value"),
])
def test_bad_settings(items, match):
    with pytest.raises(InputError, match=match):
        parse_settings(items)


def test_apply_setting_creates_sections_and_refuses_to_walk_into_a_value():
    data = {"memopt": {"device": {"hbm": "96GiB"}}}
    apply_setting(data, "memopt.workload.seq_align", 8)
    assert data["memopt"]["workload"] == {"seq_align": 8}
    with pytest.raises(InputError, match="not a section"):
        apply_setting(data, "memopt.device.hbm.size", 1)


def test_sweep_writes_a_table_and_a_figure(tmp_path, capsys):
    _need_recipe()
    from ms_memopt.cli import main

    code = main(["sweep", str(RECIPE), "--set", "memopt.device.hbm=48GiB,96GiB",
                 "--set", "parallel_config.micro_batch_num=8,16", "--steps", "2", "--ranks", "1",
                 "--policy", "baseline,pool", "--workers", "1", "--out", str(tmp_path), "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 2
    assert [(r["memopt.device.hbm"], r["parallel_config.micro_batch_num"], r["policy"]) for r in rows[:3]] == \
        [("48GiB", 8, "baseline"), ("48GiB", 8, "pool"), ("48GiB", 16, "baseline")]
    small = [r for r in rows if r["memopt.device.hbm"] == "48GiB"]
    # 48 GiB holds the 27.6 GiB of weights, gradients and states but not 8 micro-batches of
    # activations: the baseline dies in step 1, and pool mode's plan cannot even be reserved
    assert all(r["job_oom_step"] == 1 for r in small if r["policy"] == "baseline")
    assert all(r["job_oom_step"] == 0 for r in small if r["policy"] == "pool")
    big = [r for r in rows if r["memopt.device.hbm"] == "96GiB"]
    assert all(r["job_oom_step"] is None and r["job_oom_rank"] is None for r in big)
    with open(tmp_path / "sweep.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 8 and table[0]["job_oom_step"] == "1" and table[-1]["job_oom_step"] == ""
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"] == rows
    assert (tmp_path / "sweep.png").stat().st_size > 0


@pytest.mark.parametrize("setting, match", [
    ("parallel_config.micro_batch_nm=8,16", "not a key ms-memopt reads"),
    ("memopt.device.hbm=lots", "memopt.device.hbm"),
    ("memopt.device.hbm.size=1", "not a section"),
    ("memopt.devices.hbm=64GB", "memopt.devices"),
    ("parallel_config.micro_batch_num=0", "parallel_config.micro_batch_num"),
])
def test_sweep_bad_key_or_value_exits_2(tmp_path, setting, match, capsys):
    _need_recipe()
    from ms_memopt.cli import main

    code = main(["sweep", str(RECIPE), "--set", setting, "--steps", "1", "--ranks", "1", "--workers", "1",
                 "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert not (tmp_path / "sweep.csv").exists()

"""The standalone job (``ms-memopt run``): resume reproduces losses, huge configs are refused,
token files are validated. MindSpore runs are tiny (2 layers, hidden 32, seq 16)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from ms_memopt.cli import main
from ms_memopt.cli.run_cmd import host_memory_check
from ms_memopt.config.recipe import load_recipe, recipe_from_dict
from ms_memopt.core.errors import InputError

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _tiny(tmp_path: Path, **train) -> Path:
    data = {
        "seed": 0,
        "model": {"model_config": {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16,
                                   "vocab_size": 64, "intermediate_size": 64, "compute_dtype": "float32",
                                   "param_init_type": "float32"}},
        "memopt": {"device": {"hbm": "64MiB"}, "scan_every": 2, "compact_every": 3, "watch": {"bucket": "64KiB"},
                   "allocator": {"increase_size": "256KiB"},
                   "train": {"steps": 4, "batch_size": 2, "checkpoint_every_steps": 2, **train}},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _losses(out: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, (out / "train.jsonl").read_text().splitlines())}


@pytest.mark.mindspore
@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_losses(tmp_path):
    from ms_memopt.mindspore.standalone import latest_checkpoint, run_standalone

    recipe = load_recipe(_tiny(tmp_path))
    full = run_standalone(recipe, tmp_path / "full", device="cpu", progress=False)
    assert len(full.losses) == 4 and full.losses[-1] < full.losses[0]

    part = tmp_path / "part"
    first = run_standalone(recipe, part, device="cpu", steps=2, progress=False)
    assert first.losses == full.losses[:2]
    assert latest_checkpoint(part)[0] == 2
    second = run_standalone(recipe, part, device="cpu", resume=True, progress=False)
    assert second.start_step == 3
    assert second.losses == full.losses[2:]                     # bit for bit
    assert _losses(part) == _losses(tmp_path / "full")          # the log holds every step once
    assert full.compactions == 1                              # step 3: live parameters moved
    kinds = [json.loads(line)["kind"] for line in (part / "rank_0" / "scan.jsonl").read_text().splitlines()]
    assert kinds.count("compaction") == 1 and kinds.count("scan") >= 2
    meta = json.loads((part / "run.json").read_text())
    assert meta["device"] == "CPU" and meta["start_step"] == 3


@pytest.mark.mindspore
def test_run_command_trains_a_token_file_and_writes_the_report(tmp_path, capsys):
    tokens = np.random.default_rng(0).integers(0, 64, 500).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    recipe = _tiny(tmp_path, dataset=str(tmp_path / "tokens.npy"), steps=2, checkpoint_every_steps=None)
    out = tmp_path / "out"
    assert main(["run", str(recipe), "--out", str(out), "--device", "cpu", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["device"] == "CPU" and len(summary["losses"]) == 2
    assert all(np.isfinite(summary["losses"])) and summary["scans"] == 2
    assert [Path(c).name for c in summary["checkpoints"]] == ["step_000002.ckpt"]
    report = (out / "report.md").read_text()
    for figure in ("loss.png", "scan_fragmentation.png", "memory_map.png"):
        assert f"]({figure})" in report and (out / figure).stat().st_size > 5000
    assert "trained steps 1..2 of 2 on CPU" in (out / "run.log").read_text()
    # the pool is named in the summary, the report and every scan record
    assert summary["pool"]["kind"] == "cpu-bestfit" and summary["pool"]["holes_decide_ooms"] is True
    assert "memory pool: **cpu-bestfit**" in report
    scans = [json.loads(line) for line in (out / "rank_0" / "scan.jsonl").read_text().splitlines()]
    assert all(r["extra"]["pool"]["kind"] == "cpu-bestfit" for r in scans if r.get("kind", "scan") == "scan")


@pytest.mark.mindspore
@pytest.mark.parametrize("content, expected", [
    (np.arange(10), "at least seq_length + 1"),
    (np.full(100, 64), "vocab_size=64"),
    (np.zeros((4, 5), np.int32), "expected seq_length + 1 = 17"),
    (np.zeros(100, np.float32), "integer token ids"),
])
def test_bad_token_files_are_input_errors(tmp_path, content, expected):
    from ms_memopt.mindspore.standalone import token_batches
    from ms_memopt.mindspore.model import GPTConfig

    np.save(tmp_path / "t.npy", content)
    cfg = GPTConfig(num_layers=1, hidden_size=8, num_heads=2, seq_length=16, vocab_size=64)
    with pytest.raises(InputError, match="memopt.train.dataset") as info:
        list(token_batches(cfg, str(tmp_path / "t.npy"), 2, 3))
    assert expected in str(info.value)


@pytest.mark.mindspore
def test_token_batches_do_not_depend_on_where_they_start(tmp_path):
    from ms_memopt.mindspore.model import GPTConfig
    from ms_memopt.mindspore.standalone import token_batches

    cfg = GPTConfig(num_layers=1, hidden_size=8, num_heads=2, seq_length=8, vocab_size=32)
    np.save(tmp_path / "t.npy", np.arange(200) % 32)
    for dataset in ("synthetic", str(tmp_path / "t.npy")):
        whole = list(token_batches(cfg, dataset, 3, 6, seed=1))
        tail = list(token_batches(cfg, dataset, 3, 6, seed=1, start=4))
        assert len(tail) == 2
        for (a, b), (c, d) in zip(whole[4:], tail):
            assert (a == c).all() and (b == d).all()
            assert (a[:, 1:] == b[:, :-1]).all()            # labels are the next tokens


def test_huge_mindformers_config_is_refused_before_training(capsys):
    config = DATA / "configs" / "mindformers" / "pretrain_llama2_70b.yaml"
    if not config.exists():
        pytest.skip(f"shared data not available: {config}")
    assert main(["run", str(config), "--device", "cpu", "--out", "/nonexistent/never-created"]) == 2
    err = capsys.readouterr().err
    assert "cannot train on this CPU" in err and "available" in err and "--steps" in err
    assert "pretrain_llama2_70b.yaml" in err
    assert not Path("/nonexistent/never-created").exists()


def test_host_memory_estimate_scales_with_the_model():
    small = recipe_from_dict({"model": {"model_config": {"num_layers": 2, "hidden_size": 64, "num_heads": 4,
                                                         "seq_length": 32, "vocab_size": 256}}})
    big = recipe_from_dict({"model": {"model_config": {"num_layers": 80, "hidden_size": 8192, "num_heads": 64,
                                                       "seq_length": 4096, "vocab_size": 32000,
                                                       "compute_dtype": "bfloat16"}},
                            "parallel_config": {"model_parallel": 8, "pipeline_stage": 8, "micro_batch_num": 8}})
    assert host_memory_check(small, available=8 * 2**30).fits
    check = host_memory_check(big, available=64 * 2**30)
    assert not check.fits
    # unsharded on one device: > 16 bytes per parameter of ~68B parameters (bf16 -> fp32 on CPU)
    assert check.needed > 16 * 60e9


def test_bad_device_and_steps_are_usage_errors(tmp_path):
    recipe = _tiny(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["run", str(recipe), "--steps", "0"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["run", str(recipe), "--device", "gpu"])
    assert info.value.code == 2


@pytest.mark.mindspore
def test_export_memory_viz_writes_the_last_scanned_layout(tmp_path):
    from ms_memopt.cli.run_cmd import _export_memory_viz
    from ms_memopt.core.layout import Block, Layout, Segment
    from ms_memopt.mindspore.standalone import RunResult
    from ms_memopt.io.layouts import LayoutSnapshot, write_layouts
    from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot

    seg = Segment(1 << 21, 4096, [Block(1 << 21, 1024, True, tag="parameter"), Block((1 << 21) + 1024, 3072, False)])
    write_layouts(tmp_path / "layouts.jsonl", [LayoutSnapshot(5, "a", Layout([seg]))])
    result = RunResult(out=str(tmp_path), device="CPU", start_step=1, steps=5)
    path = _export_memory_viz(tmp_path, str(tmp_path / "viz.pickle"), result)
    trace = read_torch_snapshot(path)
    assert [(e.action, e.addr, e.size) for e in trace.events] == [("segment_alloc", 1 << 21, 4096),
                                                                   ("alloc", 1 << 21, 1024)]
    assert [e.tag for e in trace.events][-1] == "parameter"    # the block's frame names it
    assert not result.notes
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _export_memory_viz(empty, str(empty / "v.pickle"), result).startswith("not written")
    assert "no layout" in result.notes[0]

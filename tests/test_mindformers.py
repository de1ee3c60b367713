"""ms-memopt inside the real MindFormers (2.0.0) ``Trainer``, graph mode and PyNative (issue 14).

A tiny 2-layer LLaMA (recipes/mindformers_llama_memopt.yaml) trains 6 steps on CPU through
``mindformers.Trainer``; the runs are in tests/mindformers_support/tiny_llama.py, one process
per mode (MindFormers sets its context once per process). Checked:

* graph mode: pool mode + both callbacks, losses bit-identical to the same run without them,
  through 3 compactions; scans and compaction records together in ``rank_0/scan.jsonl``;
  gradient bytes = the model's trainable parameters (``cb_params.optimizer`` is None);
* both modes: ``FusedAdamW`` as the Trainer's optimizer (in graph mode its step is compiled
  into MindFormers' training graph), + pool mode + both callbacks, losses and weights
  bit-identical to FusedAdamW alone; FusedAdamW alone against MindFormers' AdamW with the same
  schedule: losses equal to float32 rounding (bit-identical in graph mode here), weights within
  a few float32 roundings; in graph mode its state still in one contiguous region after the
  3 compactions;
* the YAML's ``callbacks:`` list through MindFormers' own entry point (``auto_register`` +
  ``REGISTER_PATH``, what ``run_mindformer.py --register_path`` sets).

mindformers is installed by the Makefile (``--no-deps``; docs/mindformers.md says why); its
missing ``hyper_parallel`` requirement is the import-only stand-in in tests/mindformers_support.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mindspore, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("mindformers") is None,
                                 reason="mindformers is not installed (make setup installs it)")]

SUPPORT = Path(__file__).parent / "mindformers_support"
REPO = Path(__file__).resolve().parents[1]


def _run(command: str, mode: int, out: Path, *names: str) -> dict:
    env = dict(os.environ)
    path = [str(REPO)]
    if importlib.util.find_spec("hyper_parallel") is None:
        path.append(str(SUPPORT))
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")])
    args = [sys.executable, str(SUPPORT / "tiny_llama.py"), command, str(mode), str(out)]
    if names:
        args.append(",".join(names))
    proc = subprocess.run(args, cwd=out.parent, env=env, capture_output=True, text=True, timeout=1800)
    result = out / "result.json"
    assert proc.returncode == 0 and result.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "may not be supported in later version" not in proc.stderr + proc.stdout
    return json.loads(result.read_text())


def _scan_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# graph mode: MindFormers' usual mode
RUNS = {0: ("plain", "pool", "fused_plain", "fused_pool"), 1: ("plain", "fused_plain", "fused_pool")}


@pytest.fixture(scope="module", params=[0, 1], ids=["graph", "pynative"])
def runs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"mf_mode{request.param}") / "runs"
    results = _run("trainer", request.param, out, *RUNS[request.param])
    return request.param, out, results


def _ok(results: dict, name: str) -> dict:
    run = results[name]
    assert "error" not in run, f"{name}: {run.get('error')}"
    return run


def _check_memopt_records(log_dir: Path, trainable_bytes: int, moved_bytes: int) -> None:
    """Scans and compactions together in rank_0/scan.jsonl; 3 live compactions; gradient bytes
    are the model's trainable parameters (not also AdamW's m and v: cb_params.optimizer is None).
    Pool mode's weights (and FusedAdamW's regions) are never relocated: each compaction moves
    ``moved_bytes`` (what lives outside the regions) and counts the region members it left."""
    records = _scan_log(log_dir / "rank_0" / "scan.jsonl")
    kinds = [(r.get("kind", "scan"), r["step"]) for r in records if r["step"] > 1]   # + a first scan at step 1
    assert kinds == [(k, s) for s in (2, 4, 6) for k in ("scan", "compaction")]
    scans = [r for r in records if r.get("kind", "scan") == "scan"]
    assert all(r["extra"]["gradient_bytes"] == trainable_bytes for r in scans)
    compactions = [r for r in records if r.get("kind") == "compaction"]
    assert len(compactions) == 3
    # (+ the optimizer's scalars: step counter, learning rate)
    assert all(r["live"]["skipped_in_regions"] > 0 and moved_bytes <= r["bytes_moved"] < moved_bytes + 1024
               for r in compactions)
    assert all(r["live"]["verified"] for r in compactions)
    assert all(r["pool"]["kind"] == "cpu-bestfit" and r["live_skipped"] is None for r in compactions)


def test_pool_mode_and_callbacks_leave_the_losses_bit_identical(runs):
    """Pool mode (recompute every layer; LLaMA passes keyword arguments to its layers) plus
    both callbacks, compacting at steps 2, 4 and 6, against the same run without any of it."""
    mode, out, results = runs
    if mode == 1:
        pytest.skip("PyNative runs pool mode with FusedAdamW (below)")
    plain, pool = _ok(results, "plain"), _ok(results, "pool")
    assert len(plain["losses"]) == 6
    assert pool["losses"] == plain["losses"]
    # regions from the plan; activations estimated from model.config (LlamaConfig) by the recipe reader
    assert pool["pool_regions"]["parameters.float32"] == pool["trainable_bytes"]
    assert pool["pool_regions"]["activations"] > 0
    # AdamW's m and v moved; the weights stay in their region
    _check_memopt_records(out / "pool" / "memlog", pool["trainable_bytes"], 2 * pool["trainable_bytes"])


def _weights(out: Path, name: str) -> dict:
    import numpy as np
    with np.load(out / f"{name}.weights.npz") as data:
        return {key: data[key] for key in data.files}


def test_fused_adamw_with_pool_mode_and_callbacks(runs):
    """FusedAdamW as the Trainer's optimizer (graph mode: its step compiled into MindFormers'
    training graph), alone and with pool mode + both callbacks (3 compactions)."""
    import numpy as np
    mode, out, results = runs
    fused_plain, fused_pool = _ok(results, "fused_plain"), _ok(results, "fused_pool")
    assert fused_plain["fused_graph_step"] == (mode == 0) and fused_plain["optimizer_steps"] == 6
    assert fused_pool["losses"] == fused_plain["losses"]
    alone, pooled = _weights(out, "fused_plain"), _weights(out, "fused_pool")
    assert all(np.array_equal(alone[k], pooled[k]) for k in alone)
    # PyNative: the per-bucket m and v moved, the parameter region stayed; graph mode: parameters
    # and state all live in regions, nothing moved, nothing to restore
    moved = 0 if mode == 0 else 2 * fused_pool["trainable_bytes"]
    _check_memopt_records(out / "fused_pool" / "memlog", fused_pool["trainable_bytes"], moved)
    assert [c["regions_restored"] for c in fused_pool["compactions"]] == [False] * 3
    if mode == 0:
        assert fused_pool["state_in_one_region"] and fused_plain["state_in_one_region"]
    # MindFormers' AdamW with the same betas, eps and schedule: the same rule, its float32
    # operations in another order (m*b1 + g*(1-b1) vs m + (g-m)*(1-b1); bias correction on m and
    # v vs on lr and eps), so equal to float32 rounding
    plain = _ok(results, "plain")
    assert fused_plain["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    reference = _weights(out, "plain")
    for key, value in reference.items():
        np.testing.assert_allclose(alone[key], value, rtol=0, atol=1e-6 * max(1.0, float(np.abs(value).max())),
                                   err_msg=key)


def test_register_callbacks_makes_the_types_known_to_mindformers(runs):
    mode, out, results = runs
    assert results["registered"] == {"names": ["LayoutScanCallback", "CompactionCallback"],
                                     "built": ["LayoutScanCallback", "CompactionCallback"]}


@pytest.mark.parametrize("mode", [0], ids=["graph"])
def test_yaml_callbacks_through_mindformers_entry_point(tmp_path, mode):
    out = tmp_path / "entry"
    assert _run("entry", mode, out)["done"]
    records = _scan_log(out / "memlog" / "rank_0" / "scan.jsonl")
    assert [(r.get("kind", "scan"), r["step"]) for r in records if r["step"] > 1] == [
        (k, s) for s in (2, 4, 6) for k in ("scan", "compaction")]
    scans = [r for r in records if r.get("kind", "scan") == "scan"]
    assert all("allreduce" in r["watch"] for r in scans)

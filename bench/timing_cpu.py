"""The time model grounded on this machine: CPU counterparts of its constants, and a prediction.

Measures, on CPU (MindSpore 2.10's CPU kernels, PyNative):

1. ``peak_flops``: MindSpore's float32 matmul at 1024 x 1024 x 1024 (FLOP/s), and
   ``base_efficiency``: the same matmul at the demo model's shapes (tokens x hidden x FFN
   width) over that peak;
2. ``hbm_bandwidth`` and ``compaction_barrier_seconds``: ``live_compact`` of N MiB of Parameters
   (``ms_memopt.mindspore.compaction.live_compact``): bandwidth = 2 x (bytes_big - bytes_small) /
   (t_big - t_small) (each byte read and written), the fixed cost = the small case's time;
3. ``device_alloc_seconds``: the CPU pool's growth counterpart, a fresh 1 MiB host block
   (the demo recipe's ``increase_size``) allocated and first touched;
4. ``FusedAdamW`` against ``nn.AdamWeightDecay`` (optimizer step of the demo GPT), beside the
   model's prediction (the unfused optimizer's two intermediate copies over ``hbm_bandwidth``);
5. recompute's cost: a training step with ``enable_pool_mode(checkpoint_every=1)`` against none,
   beside the model's 4/3 of the FLOPs;

writes them as a CPU timing profile (``memopt.timing`` YAML snippet, ``--out``), then runs
``ms-memopt run recipes/demo_cpu.yaml`` and compares the simulator's predicted median step
(the demo recipe with that profile, the ``compact`` policy: ``run`` compacts every
``compact_every`` steps as the simulator does), once on the recipe's hand-made workload and once
on the run's own steps (a template learned from the run's pool log, which ``run`` marks with each
step's shape), with the median ``step_seconds`` of its ``train.jsonl`` (the first 3 steps left out). Prints the error; the last line is
one JSON object. About 1-2 minutes.

Usage: ``python bench/timing_cpu.py [--out out/bench/timing_cpu.yaml] [--steps 30]``
"""
from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mindspore as ms  # noqa: E402
from mindspore import Parameter, Tensor, nn, ops  # noqa: E402

from ms_memopt.config.recipe import TimingConfig, recipe_from_dict  # noqa: E402
from ms_memopt.io.yamltext import parse_yaml  # noqa: E402

DEMO = ROOT / "recipes" / "demo_cpu.yaml"


def _median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def matmul_flops(m: int, k: int, n: int, repeats: int) -> float:
    a = Tensor(np.random.default_rng(0).normal(size=(m, k)).astype(np.float32))
    b = Tensor(np.random.default_rng(1).normal(size=(k, n)).astype(np.float32))
    seconds = _median_time(lambda: ops.matmul(a, b).asnumpy(), repeats)
    return 2.0 * m * k * n / seconds


def compaction_times(big_mib: int, count: int) -> dict:
    from ms_memopt.mindspore.compaction import live_compact

    def params(total: int, n: int) -> list:
        each = max(1, total // 4 // n)
        return [Parameter(Tensor(np.full(each, i, np.float32)), name=f"p{total}_{i}") for i in range(n)]

    big, small = params(big_mib * 2**20, count), params(16 * 2**10, 1)
    t_big = _median_time(lambda: live_compact(big, verify=False), 5, warmup=1)
    t_small = _median_time(lambda: live_compact(small, verify=False), 5, warmup=1)
    moved = sum(p.size * 4 for p in big) - sum(p.size * 4 for p in small)
    return {"seconds_big": t_big, "seconds_small": t_small, "bytes": moved,
            "bandwidth": 2.0 * moved / max(t_big - t_small, 1e-9)}


def growth_seconds(size: int = 2**20, repeats: int = 200) -> float:
    def grow():
        block = np.empty(size, np.uint8)
        block[::4096] = 1            # first touch: the pages are really taken
        return block
    return _median_time(grow, repeats)


def dispatch_seconds(ops_count: int = 2000) -> float:
    """PyNative's host time per op (``request_seconds``): a chain of adds on 16 floats (no
    compute to speak of, one output buffer each), synchronized once at the end."""
    x = Tensor(np.zeros(16, np.float32))

    def chain():
        y = x
        for _ in range(ops_count):
            y = y + 1.0
        y.asnumpy()
    return _median_time(chain, 5) / ops_count


def shape_build_seconds(rounds: int = 8) -> float:
    """Per op, what a step at a shape not run before costs more (``shape_build_seconds``): a
    chain of six ops (two matmuls, softmax, mul, relu, transpose) at a new row count each round
    against the same chain at a row count run before."""
    w = Tensor(np.ones((64, 64), np.float32))

    def chain(rows: int) -> None:
        a = Tensor(np.ones((rows, 64), np.float32))
        y = ops.relu(ops.softmax(ops.matmul(a, w), -1) * 2.0)
        ops.matmul(ops.transpose(y, (1, 0)), a).asnumpy()
    fresh = iter(range(1000, 1000 + 8 * (rounds + 4), 8))
    new = _median_time(lambda: chain(next(fresh)), rounds)
    repeat = _median_time(lambda: chain(1000), rounds)
    return max(0.0, new - repeat) / 6


def _demo_gpt(recipe):
    from ms_memopt.mindspore.model import GPT, GPTConfig

    m = recipe.model
    cfg = GPTConfig(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads,
                    seq_length=m.seq_length, vocab_size=m.vocab_size, seed=0)
    return cfg, GPT


def optimizer_times(recipe, rounds: int = 30) -> dict:
    from ms_memopt.mindspore.fused_adamw import FusedAdamW

    cfg, GPT = _demo_gpt(recipe)
    rng = np.random.default_rng(1)
    out = {}
    for name, make in (("AdamWeightDecay", lambda ps: nn.AdamWeightDecay(ps, 1e-3, weight_decay=0.01)),
                       ("FusedAdamW", lambda ps: FusedAdamW(ps, 1e-3, weight_decay=0.01))):
        params = GPT(cfg).trainable_params()
        grads = tuple(Tensor(rng.normal(size=p.shape).astype(np.float32) * 1e-2) for p in params)
        opt = make(params)

        def step():
            opt(grads)
            params[-1].asnumpy()
        out[name] = _median_time(step, rounds, warmup=3)
        out["parameters"] = int(sum(p.size for p in params))
    return out


def recompute_ratio(recipe, steps: int = 12) -> float:
    from ms_memopt.mindspore.fused_adamw import FusedAdamW
    from ms_memopt.mindspore.model import GPTWithLoss, synthetic_batches
    from ms_memopt.mindspore.pool_mode import enable_pool_mode

    cfg, GPT = _demo_gpt(recipe)
    batch = recipe.memopt.train.batch_size
    cells = {}
    for label, k in (("plain", 0), ("recompute", 1)):
        net = GPTWithLoss(GPT(cfg))
        opt = FusedAdamW(net.trainable_params(), 1e-3)
        if k:
            enable_pool_mode(net, opt, checkpoint_every=k, batch_size=batch)
        cells[label] = (nn.TrainOneStepCell(net, opt), [])
    for i, (x, y) in enumerate(synthetic_batches(cfg, batch, steps + 1, seed=3)):
        for step, times in cells.values():
            start = time.perf_counter()
            float(step(Tensor(x), Tensor(y)).asnumpy())
            if i >= 1:
                times.append(time.perf_counter() - start)
    return float(np.median(cells["recompute"][1]) / np.median(cells["plain"][1]))


def measured_run(steps: int, keep: Path) -> tuple[float, list[float]]:
    """The demo's ``ms-memopt run``: its median step (the first 3 left out) and every step's time;
    its pool log (each step marked with its shape) is kept in ``keep`` for the template."""
    cmd = [sys.executable, "-m", "ms_memopt", "run", str(DEMO), "--out", str(keep), "--steps", str(steps),
           "--no-report", "--no-progress"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (keep / "train.jsonl").read_text().splitlines() if line.strip()]
    seconds = [r["step_seconds"] for r in rows]
    return float(np.median(seconds[3:])), seconds


def learned_template(run_dir: Path) -> Path:
    """The demo GPT's step template, learned from the measured run's own pool log."""
    from ms_memopt.engine.template import learn_files, save_template

    path = run_dir / "demo_gpt.template.json"
    save_template(learn_files([run_dir / "pool.log"]), path)
    return path


def predicted_step(profile: dict, steps: int, template: Path | None = None) -> dict:
    """The simulator's prediction of the demo run's step: the recipe's hand-made workload, or with
    ``template`` the run's own steps (a template learned from it) on the CPU pool's model."""
    from ms_memopt.engine.job import job_from_recipe, simulate_jobs

    data = parse_yaml(DEMO.read_text(encoding="utf-8"), source=str(DEMO))
    data = copy.deepcopy(data)
    data["memopt"]["timing"] = profile
    if template is not None:
        data["memopt"]["workload"]["template"] = str(template)
        data["memopt"]["allocator"] = {"name": "mindspore_bestfit", "pregrow": False,
                                       "increase_size": data["memopt"]["allocator"].get("increase_size", "1MiB")}
    recipe = recipe_from_dict(data, source=f"{DEMO} + CPU profile")
    job = job_from_recipe(recipe, steps=steps, policies=("compact",))
    result = simulate_jobs([job], workers=1)[0]["compact"]
    figures = result.timing_figures()
    return {"timing": figures[0], "step_seconds": figures[1]["step_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/bench/timing_cpu.yaml", help="the CPU timing profile (YAML snippet)")
    parser.add_argument("--steps", type=int, default=30, help="steps of the measured ms-memopt run")
    args = parser.parse_args()
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    started = time.perf_counter()
    recipe = recipe_from_dict(parse_yaml(DEMO.read_text(encoding="utf-8"), source=str(DEMO)), source=str(DEMO))
    m = recipe.model
    tokens = recipe.train.batch_size * m.seq_length

    peak = matmul_flops(1024, 1024, 1024, 7)
    demo_rate = matmul_flops(tokens, m.hidden_size, m.intermediate_size, 50)
    compaction = compaction_times(64, 16)
    grow = growth_seconds()
    dispatch = dispatch_seconds()
    build = shape_build_seconds()
    profile = {"peak_flops": float(f"{peak:.3g}"),
               "base_efficiency": float(f"{min(1.0, demo_rate / peak):.3g}"),
               "hbm_bandwidth": float(f"{compaction['bandwidth']:.3g}"),
               "device_alloc_seconds": float(f"{grow:.3g}"),
               "compaction_barrier_seconds": float(f"{compaction['seconds_small']:.3g}"),
               "request_seconds": float(f"{dispatch:.3g}"),
               "shape_build_seconds": float(f"{build:.3g}")}
    TimingConfig(**profile)          # the keys exist
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# CPU timing profile measured by bench/timing_cpu.py on " + time.strftime("%Y-%m-%d"),
             "memopt:", "  timing:"] + [f"    {k}: {v!r}" for k, v in profile.items()]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")

    opt = optimizer_times(recipe)
    spec_opt_bytes = 8 * 4 * opt["parameters"]     # two FP32 copies, written and read (FP32 parameters)
    opt_predicted = spec_opt_bytes / profile["hbm_bandwidth"]
    rec = recompute_ratio(recipe)
    with tempfile.TemporaryDirectory() as tmp:
        measured, seconds = measured_run(args.steps, Path(tmp))
        predicted = predicted_step(profile, args.steps)
        from_template = predicted_step(profile, args.steps, learned_template(Path(tmp)))
    pred_median = predicted["timing"]["step_seconds_median"]
    error = pred_median / measured - 1.0
    templ_median = from_template["timing"]["step_seconds_median"]
    templ_error = templ_median / measured - 1.0
    templ_mean = float(np.mean(from_template["step_seconds"]))

    print(f"{'figure':<44} {'value':>14}")
    rows = [("peak matmul FLOP/s (1024^3, float32)", f"{peak / 1e9:.1f} GFLOP/s"),
            (f"matmul at the demo's shapes ({tokens}x{m.hidden_size}x{m.intermediate_size})",
             f"{demo_rate / 1e9:.2f} GFLOP/s"),
            ("-> base_efficiency", f"{profile['base_efficiency']:.3g}"),
            ("live_compact 64 MiB / 16 KiB", f"{compaction['seconds_big'] * 1e3:.1f} / "
                                            f"{compaction['seconds_small'] * 1e3:.2f} ms"),
            ("-> hbm_bandwidth (copy, read + write)", f"{compaction['bandwidth'] / 1e9:.2f} GB/s"),
            ("-> device_alloc_seconds (1 MiB, touched)", f"{grow * 1e6:.1f} us"),
            ("-> request_seconds (PyNative dispatch per op)", f"{dispatch * 1e6:.1f} us"),
            ("-> shape_build_seconds (per op, new shape)", f"{build * 1e6:.1f} us"),
            ("AdamWeightDecay / FusedAdamW step", f"{opt['AdamWeightDecay'] * 1e3:.2f} / "
                                                 f"{opt['FusedAdamW'] * 1e3:.2f} ms"),
            ("  the model's unfused extra (bytes / bw)", f"{opt_predicted * 1e6:.1f} us"),
            ("recompute step ratio (measured, model 4/3)", f"{rec:.3f}"),
            (f"ms-memopt run demo: median step ({args.steps} steps)", f"{measured * 1e3:.2f} ms"),
            ("predicted median step: hand-made workload", f"{pred_median * 1e3:.3f} ms"),
            ("  error (predicted / measured - 1)", f"{100 * error:+.1f}%"),
            ("predicted median step: learned template", f"{templ_median * 1e3:.3f} ms"),
            ("  error (predicted / measured - 1)", f"{100 * templ_error:+.1f}%"),
            ("measured / template mean step", f"{float(np.mean(seconds[3:])) * 1e3:.1f} / {templ_mean * 1e3:.1f} ms")]
    for name, value in rows:
        print(f"{name:<44} {value:>14}")
    print(f"profile written to {out}")
    print(json.dumps({"profile": profile, "matmul_demo_flops": demo_rate, "compaction": compaction,
                      "optimizer_seconds": {k: opt[k] for k in ("AdamWeightDecay", "FusedAdamW")},
                      "optimizer_extra_predicted_seconds": opt_predicted, "recompute_step_ratio": rec,
                      "measured_step_median": measured, "predicted_step_median": pred_median,
                      "prediction_error": error, "template_step_median": templ_median,
                      "template_prediction_error": templ_error, "measured_step_mean": float(np.mean(seconds[3:])),
                      "template_step_mean": templ_mean, "seconds": time.perf_counter() - started}))


if __name__ == "__main__":
    main()

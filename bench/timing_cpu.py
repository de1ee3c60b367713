"""The time model grounded on this machine: a CPU timing profile, calibrated on other models.

A PyNative training step on CPU is host work: every op is dispatched from Python (forward,
autograd's backward, the optimizer's per-parameter ops), and the FLOPs of these tiny models are
a few percent of the step. So the profile's ``request_seconds`` is measured *inside training
steps*, on models that are not the demo's, and then checked on the demo:

1. **Calibration runs**: ``ms-memopt run`` of two GPTs other than the demo's (:data:`CALIBRATION`:
   1 layer, h 96, batch 2, lengths 8-48; 4 layers, h 48, batch 8, lengths 8-24; each a recipe
   derived from ``recipes/demo_cpu.yaml`` in a temporary folder), the real pool's log followed
   as ``run`` does by default (``VLOG_v=12906``, each step marked with its shape). Per step (the
   first 3 left out): host seconds = ``step_seconds`` minus the step's compute as the simulator
   prices it (its FLOPs, :func:`ms_memopt.simulation.timing.step_flops`, over ``peak_flops x
   base_efficiency`` of step 2), divided by the step's pool requests (the ``alloc`` events between two step
   marks of its ``pool.log``). ``request_seconds`` = the median of that over both models' steps:
   **host seconds per pool request inside a training step** (a request stands for the ops
   dispatched around it, the views and scalar ops that allocate nothing included).
   ``shape_build_seconds`` = the same figure on steps at a length the run had not run before
   minus on repeat steps (per request of a new-shape step), clipped at 0;
2. **Microbenchmarks** for the other keys: ``peak_flops`` (float32 matmul 1024^3),
   ``base_efficiency`` (the matmul at the demo's shapes over that peak; both the fastest of
   7 rounds of queued matmuls, :func:`matmul_flops`, measured before and after the runs), ``hbm_bandwidth`` and
   ``compaction_barrier_seconds`` (``live_compact`` of 64 MiB and of 16 KiB),
   ``device_alloc_seconds`` (a fresh 1 MiB host block, touched); and figures beside the model:
   a bare op's dispatch outside a step (2,000 adds), ``AdamWeightDecay`` against ``FusedAdamW``,
   recompute's step ratio;
3. **The check**: ``ms-memopt run recipes/demo_cpu.yaml``, interleaved with the calibration runs
   (round by round, so that all share the machine's load), its median ``step_seconds`` (the
   first 3 steps of each run left out, all rounds pooled) against the simulator's median step
   of the demo recipe with that profile (the ``compact`` policy) on the recipe's hand-made
   workload and on a template learned from the demo run's own pool log. Nothing is fitted on
   the demo. Also printed: the hand-made workload priced with the *real* pool's request count
   of a step, as a line in the layer count fitted on the two calibration models (the count the
   hand-made workload lacks: docs/simulation.md, "CPU grounding").

Writes the profile (``--out``, a ``memopt.timing`` YAML snippet) and every run's steps (``--out``
with ``.runs.json``: seconds, pool requests, lengths), and prints the figures with the
load average beside each run; the last line is one JSON object. About 3-4 minutes with the
default ``--rounds 5`` (15 runs of ~10-25 s each: a PyNative step on this machine's 2 cores switches
between a ~300 ms and a ~700 ms mode from run to run, so few runs do not make a median).

Usage: ``python bench/timing_cpu.py [--out out/bench/timing_cpu.yaml] [--steps 30] [--rounds 5]``
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mindspore as ms  # noqa: E402
from mindspore import Parameter, Tensor, nn, ops  # noqa: E402

from ms_memopt.config.recipe import TimingConfig, load_recipe, recipe_from_dict  # noqa: E402
from ms_memopt.io.yamltext import parse_yaml  # noqa: E402

DEMO = ROOT / "recipes" / "demo_cpu.yaml"

#: the calibration models: recipe keys changed from the demo's (its model is 2 layers, h 64,
#: FFN 176, batch 4, lengths 8-32 in steps of 4); none of them is the demo's shape
CALIBRATION = {
    "gpt_1x96_b2": {"num_layers": 1, "hidden_size": 96, "num_heads": 4, "n_kv_heads": 4,
                    "intermediate_size": 256, "seq_length": 48, "batch_size": 2,
                    "seq_min": 8, "seq_max": 48, "seq_align": 4},
    "gpt_4x48_b8": {"num_layers": 4, "hidden_size": 48, "num_heads": 4, "n_kv_heads": 4,
                    "intermediate_size": 128, "seq_length": 24, "batch_size": 8,
                    "seq_min": 8, "seq_max": 24, "seq_align": 2},
}
SKIP = 3        # warm-up steps left out of every run (the first kernels, the pool's first blocks)


def _median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def matmul_flops(m: int, k: int, n: int, chain: int, repeats: int = 7) -> float:
    """FLOP/s of MindSpore's float32 matmul at ``m x k x n``: ``chain`` matmuls queued, one
    synchronization, the fastest of ``repeats`` rounds. The fastest, because a kernel's cost is
    its FLOPs; what the machine adds on top (PyNative's per-op dispatch, the CPU thread pool
    waiting for a scheduler tick, 4 ms on this kernel, when the 2 cores are busy: a single
    128 x 64 x 176 matmul then "takes" 4.00 ms) is per-op host time, which ``request_seconds``
    prices. The chain, because one synchronization per matmul measures that tick, not the matmul."""
    a = Tensor(np.random.default_rng(0).normal(size=(m, k)).astype(np.float32))
    b = Tensor(np.random.default_rng(1).normal(size=(k, n)).astype(np.float32))

    def run() -> None:
        outs = [ops.matmul(a, b) for _ in range(chain)]
        outs[-1].asnumpy()
    run()
    seconds = min(_median_time(run, 1, warmup=0) for _ in range(repeats)) / chain
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
    """PyNative's host time per bare op, outside a training step (a figure beside the profile,
    not in it): a chain of adds on 16 floats (no compute to speak of, one output buffer each),
    synchronized once at the end."""
    x = Tensor(np.zeros(16, np.float32))

    def chain():
        y = x
        for _ in range(ops_count):
            y = y + 1.0
        y.asnumpy()
    return _median_time(chain, 5) / ops_count


def _demo_gpt(recipe):
    from ms_memopt.mindspore.model import GPT, GPTConfig

    m = recipe.model
    cfg = GPTConfig(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads,
                    seq_length=m.seq_length, vocab_size=m.vocab_size,
                    intermediate_size=m.intermediate_size, seed=0)
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


@dataclass
class RunSteps:
    """One ``ms-memopt run``: per step (1..) its seconds, pool requests, length and whether the
    length was new to the run; the load average when it started."""

    name: str
    seconds: list[float]
    requests: list[int]
    lengths: list[int]
    new: list[bool]
    load: float
    recipe: object = None
    folder: Path | None = None
    host_per_request: list[float] = field(default_factory=list)   # steps SKIP+1.. (calibration)


def variant_recipe(changes: dict, folder: Path) -> Path:
    """The demo recipe with ``changes`` (``key: value`` lines replaced wherever the key appears,
    e.g. both ``batch_size`` keys), written to ``folder``; the values must be plain scalars."""
    text = DEMO.read_text(encoding="utf-8")
    for key, value in changes.items():
        text, n = re.subn(rf"(?m)^(\s*{key}:)\s*[^#\n]*?(\s*(#.*)?)$", rf"\g<1> {value}\g<2>", text)
        if n == 0:
            raise KeyError(f"{key} is not a key of {DEMO}")
    path = folder / "recipe.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _step_requests(pool_log: Path) -> tuple[list[int], list[int]]:
    """Per marked step of a run's pool log: its ``alloc`` events and its ``seq`` dim."""
    from ms_memopt.templates.template import parse_dims_tag
    from ms_memopt.io.traces.ms_pool_log import read_pool_log

    requests, lengths, count, started = [], [], 0, False
    for event in read_pool_log(pool_log).events:
        if event.action == "step":
            dims = parse_dims_tag(event.tag)
            if dims is not None and started:
                requests.append(count)
                lengths.append(int(dims.get("seq", 0)))
            started, count = True, 0       # the setup mark (no dims) ends the prologue
        elif event.action == "alloc":
            count += 1
    return requests, lengths


def measured_run(name: str, recipe_path: Path, steps: int, keep: Path) -> RunSteps:
    """``ms-memopt run`` of ``recipe_path`` into ``keep`` (its pool log followed, as by default):
    every step's seconds (``train.jsonl``) and pool requests (``pool.log``)."""
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "ms_memopt", "run", str(recipe_path), "--out", str(keep), "--steps", str(steps),
           "--no-report", "--no-progress"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (keep / "train.jsonl").read_text().splitlines() if line.strip()]
    requests, lengths = _step_requests(keep / "pool.log")
    n = min(len(rows), len(requests))
    seen: set[int] = set()
    new = []
    for length in lengths[:n]:
        new.append(length not in seen)
        seen.add(length)
    return RunSteps(name, [r["step_seconds"] for r in rows[:n]], requests[:n], lengths[:n], new, load,
                    recipe=load_recipe(recipe_path), folder=keep)


def _compute_seconds(recipe, length: int, rate: float) -> float:
    """A step's FLOPs at ``length`` tokens a sequence (the simulator's count) over ``rate``."""
    from ms_memopt.simulation.timing import step_flops
    from ms_memopt.simulation.spec import spec_from_recipe

    spec = spec_from_recipe(recipe)
    return step_flops(spec, [length] * spec.micro_batches)[0] / rate


def calibrate(runs: list[RunSteps], rate: float) -> dict:
    """``request_seconds`` and ``shape_build_seconds`` from the calibration runs (see the module
    docstring), the compute priced as the simulator prices it (``rate`` = ``peak_flops x
    base_efficiency``), with the per-model medians beside them."""
    per_model: dict[str, dict] = {}
    pooled, new_all, repeat_all = [], [], []
    for run in runs:
        for i in range(SKIP, len(run.seconds)):
            host = run.seconds[i] - _compute_seconds(run.recipe, run.lengths[i], rate)
            x = host / max(1, run.requests[i])
            run.host_per_request.append(x)
            pooled.append(x)
            (new_all if run.new[i] else repeat_all).append(x)
            m = per_model.setdefault(run.name, {"x": [], "requests": [], "seconds": [], "layers":
                                                run.recipe.model.num_layers})
            m["x"].append(x)
            m["requests"].append(run.requests[i])
            m["seconds"].append(run.seconds[i])
    request = float(np.median(pooled))
    raw_build = (float(np.median(new_all)) - float(np.median(repeat_all))) if new_all and repeat_all else 0.0
    models = {k: {"layers": v["layers"], "request_seconds": float(np.median(v["x"])),
                  "requests_per_step": float(np.median(v["requests"])),
                  "step_seconds_median": float(np.median(v["seconds"])), "steps": len(v["x"])}
              for k, v in per_model.items()}
    return {"request_seconds": request, "shape_build_raw": raw_build, "shape_build_seconds": max(0.0, raw_build),
            "new_steps": len(new_all), "repeat_steps": len(repeat_all), "models": models}


def requests_line(models: dict) -> tuple[float, float]:
    """``(per layer, per step)``: the real pool's requests of a step as a line in the layer count,
    through the calibration models' medians (least squares)."""
    layers = np.array([m["layers"] for m in models.values()], float)
    counts = np.array([m["requests_per_step"] for m in models.values()], float)
    slope, intercept = np.polyfit(layers, counts, 1)
    return float(slope), float(intercept)


def learned_template(run_dir: Path) -> Path:
    """The demo GPT's step template, learned from the measured run's own pool log."""
    from ms_memopt.templates.template import learn_files, save_template

    path = run_dir / "demo_gpt.template.json"
    save_template(learn_files([run_dir / "pool.log"]), path)
    return path


def predicted_step(profile: dict, steps: int, template: Path | None = None) -> dict:
    """The simulator's prediction of the demo run's steps: the recipe's hand-made workload, or with
    ``template`` the run's own steps (a template learned from it) on the CPU pool's model;
    ``result`` is the policy's :class:`~ms_memopt.simulation.job.JobResult` (to re-price)."""
    from ms_memopt.simulation.spec import job_from_recipe
    from ms_memopt.simulation.job import simulate_jobs

    data = copy.deepcopy(parse_yaml(DEMO.read_text(encoding="utf-8"), source=str(DEMO)))
    data["memopt"]["timing"] = profile
    if template is not None:
        data["memopt"]["workload"]["template"] = str(template)
        data["memopt"]["allocator"] = {"name": "mindspore_bestfit", "pregrow": False,
                                       "increase_size": data["memopt"]["allocator"].get("increase_size", "1MiB")}
    recipe = recipe_from_dict(data, source=f"{DEMO} + CPU profile")
    job = job_from_recipe(recipe, steps=steps, policies=("compact",))
    result = simulate_jobs([job], workers=1)[0]["compact"]
    figures = result.timing_figures()
    from ms_memopt.simulation.timing import StepCounts

    counts = [StepCounts(*c) for c in result.outcomes[0].result.step_counts]
    return {"timing": figures[0], "step_seconds": figures[1]["step_seconds"], "result": result,
            "requests": float(np.median([c.requests for c in counts])),
            "new_shape_steps": sum(1 for c in counts if c.new_shape_requests)}


def _median_of(runs: list[RunSteps]) -> tuple[float, float]:
    steps = [s for r in runs for s in r.seconds[SKIP:]]
    return float(np.median(steps)), float(np.mean(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/bench/timing_cpu.yaml", help="the CPU timing profile (YAML snippet)")
    parser.add_argument("--steps", type=int, default=30, help="steps of each measured ms-memopt run")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of (calibration runs, demo run)")
    args = parser.parse_args()
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    started = time.perf_counter()
    recipe = load_recipe(DEMO)
    m = recipe.model
    tokens = recipe.train.batch_size * m.seq_length
    load_start = os.getloadavg()[0]

    peak = matmul_flops(1024, 1024, 1024, 4)
    demo_rate = matmul_flops(tokens, m.hidden_size, m.intermediate_size, 100)
    compaction = compaction_times(64, 16)
    grow = growth_seconds()
    dispatch = dispatch_seconds()
    opt = optimizer_times(recipe)
    rec = recompute_ratio(recipe)
    load_micro = os.getloadavg()[0]

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = {name: variant_recipe(changes, tmp / f"{name}_recipe") for name, changes in CALIBRATION.items()}
        calib_runs, demo_runs = [], []
        for k in range(args.rounds):
            for name, path in paths.items():
                calib_runs.append(measured_run(name, path, args.steps, tmp / f"{name}_{k}"))
            demo_runs.append(measured_run("demo", DEMO, args.steps, tmp / f"demo_{k}"))
        # the matmul rates again, after the runs: a whole measurement can fall into the slow mode
        # (every queued matmul waiting for a scheduler tick: 0.73 GFLOP/s at the demo's shapes
        # once, against 30-50 otherwise), so the faster of the two measurements is the kernel's
        peak = max(peak, matmul_flops(1024, 1024, 1024, 4))
        demo_rate = max(demo_rate, matmul_flops(tokens, m.hidden_size, m.intermediate_size, 100))
        base = {"peak_flops": float(f"{peak:.3g}"), "base_efficiency": float(f"{min(1.0, demo_rate / peak):.3g}")}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        # every run's steps, kept before anything is predicted from them
        raw = out.with_suffix(".runs.json")
        raw.write_text(json.dumps([{"name": r.name, "load": r.load, "seconds": r.seconds, "requests": r.requests,
                                    "lengths": r.lengths, "new": r.new} for r in calib_runs + demo_runs]) + "\n",
                       encoding="utf-8")
        cal = calibrate(calib_runs, base["peak_flops"] * base["base_efficiency"])
        # the real pool's requests a step as a line in the layers (one micro-batch a step here):
        # what the hand-made workload, which makes only the large buffers, is priced on
        slope, intercept = requests_line(cal["models"])
        profile = {**base,
                   "hbm_bandwidth": float(f"{compaction['bandwidth']:.3g}"),
                   "device_alloc_seconds": float(f"{grow:.3g}"),
                   "compaction_barrier_seconds": float(f"{compaction['seconds_small']:.3g}"),
                   "request_seconds": float(f"{cal['request_seconds']:.3g}"),
                   "shape_build_seconds": float(f"{cal['shape_build_seconds']:.3g}"),
                   "host_requests_per_layer": round(slope), "host_requests_per_step": round(intercept)}
        TimingConfig(**profile)          # the keys exist
        measured, measured_mean = _median_of(demo_runs)
        demo_requests = float(np.median([q for r in demo_runs for q in r.requests[SKIP:]]))
        predicted = predicted_step(profile, args.steps)
        from_template = predicted_step(profile, args.steps, learned_template(demo_runs[-1].folder))
    line_requests = slope * m.num_layers + intercept

    lines = ["# CPU timing profile measured by bench/timing_cpu.py on " + time.strftime("%Y-%m-%d"),
             "memopt:", "  timing:"] + [f"    {k}: {v!r}" for k, v in profile.items()]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")

    pred_median = predicted["timing"]["step_seconds_median"]
    templ_median = from_template["timing"]["step_seconds_median"]
    error, templ_error = pred_median / measured - 1.0, templ_median / measured - 1.0
    spec_opt_bytes = 8 * 4 * opt["parameters"]     # two FP32 copies, written and read (FP32 parameters)
    opt_predicted = spec_opt_bytes / profile["hbm_bandwidth"]

    print(f"load average (1 min): {load_start:.2f} at the start, {load_micro:.2f} after the microbenchmarks")
    print(f"{'figure':<58} {'value':>22}")
    rows = [("peak matmul FLOP/s (1024^3, float32)", f"{peak / 1e9:.1f} GFLOP/s"),
            (f"matmul at the demo's shapes ({tokens}x{m.hidden_size}x{m.intermediate_size})",
             f"{demo_rate / 1e9:.2f} GFLOP/s"),
            ("-> base_efficiency", f"{profile['base_efficiency']:.3g}"),
            ("live_compact 64 MiB / 16 KiB", f"{compaction['seconds_big'] * 1e3:.1f} / "
                                            f"{compaction['seconds_small'] * 1e3:.2f} ms"),
            ("-> hbm_bandwidth (copy, read + write)", f"{compaction['bandwidth'] / 1e9:.2f} GB/s"),
            ("-> device_alloc_seconds (1 MiB, touched)", f"{grow * 1e6:.1f} us"),
            ("bare op dispatch outside a step (2,000 adds)", f"{dispatch * 1e6:.1f} us"),
            ("AdamWeightDecay / FusedAdamW step (demo GPT)", f"{opt['AdamWeightDecay'] * 1e3:.2f} / "
                                                              f"{opt['FusedAdamW'] * 1e3:.2f} ms"),
            ("  the model's unfused extra (bytes / bw)", f"{opt_predicted * 1e6:.1f} us"),
            ("recompute step ratio (measured, model 4/3)", f"{rec:.3f}")]
    for name, v in cal["models"].items():
        loads = ", ".join(f"{r.load:.2f}" for r in calib_runs if r.name == name)
        rows.append((f"calibration {name} ({v['layers']} layer(s)): median step", f"{v['step_seconds_median'] * 1e3:.1f} ms"))
        rows.append((f"  requests a step / host s per request (load {loads})",
                     f"{v['requests_per_step']:.0f} / {v['request_seconds'] * 1e6:.0f} us"))
        rows.append(("  each run's median step", ", ".join(f"{np.median(r.seconds[SKIP:]) * 1e3:.0f}"
                                                        for r in calib_runs if r.name == name) + " ms"))
    rows += [("-> request_seconds (median, both models)", f"{cal['request_seconds'] * 1e6:.1f} us"),
             (f"new-shape minus repeat step, per request ({cal['new_steps']} / {cal['repeat_steps']} steps)",
              f"{cal['shape_build_raw'] * 1e6:+.1f} us"),
             ("-> shape_build_seconds (clipped at 0)", f"{cal['shape_build_seconds'] * 1e6:.1f} us"),
             (f"requests a step = {slope:.1f} x layers + {intercept:.0f} (calibration)",
              f"demo: {line_requests:.0f} (run: {demo_requests:.0f})"),
             (f"ms-memopt run demo: median / mean step (load {', '.join(f'{r.load:.2f}' for r in demo_runs)})",
              f"{measured * 1e3:.1f} / {measured_mean * 1e3:.1f} ms"),
             ("  each run's median step", ", ".join(f"{np.median(r.seconds[SKIP:]) * 1e3:.0f}" for r in demo_runs) + " ms"),
             (f"predicted: hand-made workload ({predicted['requests']:.0f} requests a step, priced as "
              f"{line_requests:.0f})", f"{pred_median * 1e3:.1f} ms ({100 * error:+.1f}%)"),
             (f"predicted: learned template ({from_template['requests']:.0f} requests a step)",
              f"{templ_median * 1e3:.1f} ms ({100 * templ_error:+.1f}%)"),
             ("  template: mean step", f"{float(np.mean(from_template['step_seconds'])) * 1e3:.1f} ms")]
    for name, value in rows:
        print(f"{name:<58} {value:>22}")
    print(f"profile written to {out}, every run's steps to {raw}")
    print(json.dumps({"profile": profile, "matmul_demo_flops": demo_rate,
                      "compaction": compaction, "dispatch_seconds_bare_op": dispatch,
                      "optimizer_seconds": {k: opt[k] for k in ("AdamWeightDecay", "FusedAdamW")},
                      "optimizer_extra_predicted_seconds": opt_predicted, "recompute_step_ratio": rec,
                      "calibration": cal, "requests_line": [slope, intercept],
                      "runs": [{"name": r.name, "load": r.load, "median": float(np.median(r.seconds[SKIP:])),
                                "requests_median": float(np.median(r.requests[SKIP:]))}
                               for r in calib_runs + demo_runs],
                      "measured_step_median": measured, "measured_step_mean": measured_mean,
                      "demo_requests_per_step": demo_requests,
                      "predicted_step_median": pred_median, "prediction_error": error,
                      "template_step_median": templ_median, "template_prediction_error": templ_error,
                      "template_step_mean": float(np.mean(from_template["step_seconds"])),
                      "load_start": load_start, "load_end": os.getloadavg()[0],
                      "seconds": time.perf_counter() - started}))


if __name__ == "__main__":
    main()

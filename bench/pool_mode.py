"""Pool mode on the CPU demo GPT: fused optimizer speed, activation memory, recompute cost, loss.

Measures, in one run (ratios against baselines measured in the same run, interleaved, because
the machine is shared and noisy):

1. ``fused_step_ratio``: optimizer step time of ``FusedAdamW`` / ``nn.AdamWeightDecay`` on the
   same model (the demo model, 101 parameter tensors), same gradients, median of interleaved
   rounds; ``fused_step_ratio_min`` compares the fastest rounds (least disturbed by other
   processes), and ``fused_step_ratio_by_model`` adds a model with 293 smaller tensors.
   On CPU FusedAdamW's step is the compiled host AdamW pass (``ms_memopt.native``) when the
   library is built (``fused_step_path``); the graph path (``ms.jit`` graph of decay +
   ``ops.Adam``, the device path) is timed in the same rounds as ``fused_graph_step_ratio``.
2. ``activation_ratio``: activation bytes with ``checkpoint_every=k`` / without recompute, by
   the estimator (per-layer ``ms_memopt.analysis.estimate`` formulas composed for the largest recompute
   group by ``ms_memopt.mindspore.pool_mode``) and measured as the
   peak-RSS growth of one training step in a fresh subprocess (CPU has no device memory
   statistics), and as seen by the layout-scan shadow source
   (``ms_memopt.mindspore.sources.ShadowModelSource``): ``shadow_activation_ratio``, the
   ratio of its replay's peak activation bytes (a recompute group keeps only its inputs; its
   recompute in backward is one transient group allocation). That source sees only leaf-Cell
   outputs, not tensors made by functional ops (attention scores, residual adds), so only
   its ratio, not its bytes, compares with the estimator's.
3. ``recompute_step_ratio``: training-step time with recompute / without.
4. A pool-mode training run against a normal run over ``--steps`` steps: final losses and the
   largest per-step difference.
5. Graph mode (mode 0): FusedAdamW's graph step (MindSpore ops, per parameter) against
   ``nn.AdamWeightDecay``, the optimizer alone and the whole training step
   (``--graph-only`` runs just this part).

Usage: ``python bench/pool_mode.py [--quick] [--graph-only]``; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mindspore as ms  # noqa: E402
from mindspore import Tensor, nn  # noqa: E402

from ms_memopt.core.units import format_size  # noqa: E402
from ms_memopt.mindspore.fused_adamw import FusedAdamW  # noqa: E402
from ms_memopt.mindspore.model import GPT, GPTConfig, GPTWithLoss, synthetic_batches  # noqa: E402
from ms_memopt.mindspore.pool_mode import activation_bytes, enable_pool_mode  # noqa: E402

# The CPU demo model: 8 blocks -> 101 parameter tensors.
DEMO = GPTConfig(num_layers=8, hidden_size=64, num_heads=4, seq_length=32, vocab_size=128, seed=0)
# More, smaller tensors (293): where per-parameter kernel launches dominate the step.
MANY_SMALL = GPTConfig(num_layers=24, hidden_size=32, num_heads=4, seq_length=32, vocab_size=128, seed=0)


def _sync(params) -> None:
    params[0].asnumpy()
    params[-1].asnumpy()


def optimizer_step_times(cfg: GPTConfig, rounds: int, per_round: int) -> dict:
    """Median seconds per optimizer step, both optimizers interleaved round by round."""
    import ms_memopt.mindspore.fused_adamw as fused

    def graph_path(ps):
        """FusedAdamW as built without the compiled library (the device path, on CPU)."""
        compiled = fused._native_kernel
        fused._native_kernel = lambda: False
        try:
            return FusedAdamW(ps, 1e-3, weight_decay=0.01)
        finally:
            fused._native_kernel = compiled

    rng = np.random.default_rng(1)
    setups = {}
    for name, make in (("AdamWeightDecay", lambda ps: nn.AdamWeightDecay(ps, 1e-3, weight_decay=0.01)),
                       ("FusedAdamW", lambda ps: FusedAdamW(ps, 1e-3, weight_decay=0.01)),
                       ("FusedAdamW_graph", graph_path)):
        params = GPT(cfg).trainable_params()
        grads = tuple(Tensor(rng.normal(size=p.shape).astype(np.float32) * 1e-2) for p in params)
        opt = make(params)
        for _ in range(3):
            opt(grads)
        _sync(params)
        setups[name] = (opt, grads, params, [])
    for _ in range(rounds):
        for opt, grads, params, times in setups.values():
            start = time.perf_counter()
            for _ in range(per_round):
                opt(grads)
            _sync(params)
            times.append((time.perf_counter() - start) / per_round)
    n_tensors = len(setups["FusedAdamW"][2])
    ratios = np.array(setups["FusedAdamW"][3]) / np.array(setups["AdamWeightDecay"][3])
    return {"n_tensors": n_tensors, "path": "native" if setups["FusedAdamW"][0]._native else "graph",
            "round_ratio_quartiles": [float(q) for q in np.percentile(ratios, [25, 50, 75])], "n_elements": int(sum(p.size for p in setups["FusedAdamW"][2])),
            **{name: float(np.median(s[3])) for name, s in setups.items()},
            **{f"{name}_min": float(np.min(s[3])) for name, s in setups.items()}}


def graph_mode_step_times(cfg: GPTConfig, rounds: int, per_round: int, batch: int = 8) -> dict:
    """Graph mode (mode 0): median seconds per optimizer step (each optimizer called alone, so
    compiled as its own graph) and per whole training step (``TrainOneStepCell``: the
    optimizer compiled into the training graph), FusedAdamW against ``nn.AdamWeightDecay``,
    interleaved round by round. The context mode is restored afterwards."""
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        rng = np.random.default_rng(1)
        batches = [(Tensor(x), Tensor(y)) for x, y in synthetic_batches(cfg, batch, 2, seed=3)]
        setups = {}
        for name, make in (("AdamWeightDecay", lambda ps: nn.AdamWeightDecay(ps, 1e-3, weight_decay=0.01)),
                           ("FusedAdamW", lambda ps: FusedAdamW(ps, 1e-3, weight_decay=0.01))):
            params = GPT(cfg).trainable_params()
            grads = tuple(Tensor(rng.normal(size=p.shape).astype(np.float32) * 1e-2) for p in params)
            opt = make(params)
            net = GPTWithLoss(GPT(cfg))
            train = nn.TrainOneStepCell(net, make(net.trainable_params()))
            for _ in range(3):     # the first call compiles
                opt(grads)
                train(*batches[0]).asnumpy()
            _sync(params)
            setups[name] = (opt, grads, params, train, [], [])
        for r in range(rounds):
            for opt, grads, params, train, opt_times, step_times in setups.values():
                start = time.perf_counter()
                for _ in range(per_round):
                    opt(grads)
                _sync(params)
                opt_times.append((time.perf_counter() - start) / per_round)
                start = time.perf_counter()
                for _ in range(per_round):
                    loss = train(*batches[r % 2])
                loss.asnumpy()
                step_times.append((time.perf_counter() - start) / per_round)
    finally:
        ms.set_context(mode=previous)
    med = {name: (float(np.median(s[4])), float(np.median(s[5]))) for name, s in setups.items()}
    return {"n_tensors": len(setups["FusedAdamW"][2]),
            "optimizer_ms": {name: round(m[0] * 1e3, 3) for name, m in med.items()},
            "optimizer_ratio_median": round(med["FusedAdamW"][0] / med["AdamWeightDecay"][0], 4),
            "optimizer_round_ratio_quartiles": [round(float(q), 4) for q in np.percentile(
                np.array(setups["FusedAdamW"][4]) / np.array(setups["AdamWeightDecay"][4]), [25, 50, 75])],
            "train_step_ms": {name: round(m[1] * 1e3, 3) for name, m in med.items()},
            "train_step_ratio_median": round(med["FusedAdamW"][1] / med["AdamWeightDecay"][1], 4)}


def train_step_times(cfg: GPTConfig, k: int, batch: int, steps: int) -> dict[str, float]:
    """Median seconds per full training step (forward + backward + optimizer), interleaved.

    Keys: ``adamw`` (nn.AdamWeightDecay, no recompute), ``fused`` (FusedAdamW, no recompute),
    ``fused_recompute`` (FusedAdamW, pool mode with recompute every k).
    """
    cells = {}
    for label, group in (("adamw", 0), ("fused", 0), ("fused_recompute", k)):
        net = GPTWithLoss(GPT(cfg))
        params = net.trainable_params()
        opt = nn.AdamWeightDecay(params, 1e-3) if label == "adamw" else FusedAdamW(params, 1e-3)
        if group:
            enable_pool_mode(net, opt, checkpoint_every=group, batch_size=batch)
        cells[label] = (nn.TrainOneStepCell(net, opt), [])
    for i, (x, y) in enumerate(synthetic_batches(cfg, batch, steps + 1, seed=3)):
        for step, times in cells.values():
            start = time.perf_counter()
            float(step(Tensor(x), Tensor(y)).asnumpy())
            if i >= 1:  # the first step builds kernels and caches
                times.append(time.perf_counter() - start)
    return {label: float(np.median(times)) for label, (_, times) in cells.items()}


_RSS_CHILD = r"""
import json, sys
sys.path.insert(0, {root!r})
import mindspore as ms
from mindspore import Tensor, nn
from ms_memopt.mindspore.model import GPT, GPTConfig, GPTWithLoss, synthetic_batches
from ms_memopt.mindspore.pool_mode import enable_pool_mode


def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024


cfg = GPTConfig(**{cfg!r})
net = GPTWithLoss(GPT(cfg))
k = {k}
if k:
    enable_pool_mode(net, checkpoint_every=k, batch_size={batch})
grad_fn = ms.value_and_grad(net, None, net.trainable_params())
small = [Tensor(a[:1]) for a in next(synthetic_batches(cfg, 1, 1, seed=9))]
for g in grad_fn(*small)[1]:  # kernels, caches and parameters resident before the baseline
    g.asnumpy()
# Reset the peak (VmHWM) to the current RSS. ru_maxrss would not do: it carries over from
# the parent through fork + exec.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
x, y = next(synthetic_batches(cfg, {batch}, 1, seed=9))
loss, grads = grad_fn(Tensor(x), Tensor(y))
float(loss.asnumpy())
for g in grads:  # ops run asynchronously: wait for the whole backward pass
    g.asnumpy()
print(json.dumps({{"peak_growth": status("VmHWM") - before}}))
"""


def measured_step_peak(cfg: GPTConfig, k: int, batch: int) -> int | None:
    """Peak-RSS growth (bytes) of one forward+backward in a fresh process; None on failure."""
    code = _RSS_CHILD.format(root=str(ROOT), cfg=cfg.to_dict(), k=k, batch=batch)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "GLOG_v": "3"})
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return int(json.loads(line)["peak_growth"])
    print(proc.stderr[-2000:], file=sys.stderr)
    return None


def shadow_source_activations(cfg: GPTConfig, k: int, batch: int) -> dict:
    """What ``ShadowModelSource`` sees of one forward+backward (k=0: no recompute).

    ``activation_peak_bytes``: the peak of live activations in the source's allocator-model
    replay: every leaf-Cell output without recompute; with recompute the groups' inputs plus
    one group's outputs (re-allocated while it is recomputed in backward).
    ``activation_bytes``/``activations_observed``: the leaf-Cell outputs of the forward (the
    same with and without recompute); ``activations_recomputed``: the outputs seen again while
    groups were recomputed in backward; ``step_peak_allocated`` includes parameters and gradients.
    """
    from ms_memopt.mindspore.sources import ShadowModelSource

    net = GPTWithLoss(GPT(cfg))
    if k:
        enable_pool_mode(net, checkpoint_every=k, batch_size=batch)
    source = ShadowModelSource(net)
    try:
        grad_fn = ms.value_and_grad(net, None, net.trainable_params())
        x, y = next(synthetic_batches(cfg, batch, 1, seed=9))
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        float(loss.asnumpy())
        extra = source.read().extra
    finally:
        source.close()
    return {key: int(extra[key]) for key in ("activation_peak_bytes", "activation_kept_bytes", "activation_bytes",
                                             "activations_observed", "activations_recomputed",
                                             "recompute_groups", "step_peak_allocated")}


def training_run(cfg: GPTConfig, steps: int, batch: int, k: int) -> dict:
    """Normal run (nn.AdamWeightDecay) vs pool mode (recompute + regions + FusedAdamW).

    FusedAdamW runs with ``bias_correction=False`` here so both runs follow the same update
    rule and the comparison isolates pool mode; the bias-corrected run is reported beside.
    """
    batches = list(synthetic_batches(cfg, batch, steps, seed=11))

    def run(mode: str) -> list[float]:
        net = GPTWithLoss(GPT(cfg))
        params = net.trainable_params()
        if mode == "normal":
            opt = nn.AdamWeightDecay(params, 5e-3, weight_decay=0.01)
        else:
            opt = FusedAdamW(params, 5e-3, weight_decay=0.01, bias_correction=(mode == "pool_bc"))
            enable_pool_mode(net, opt, checkpoint_every=k, batch_size=batch)
        step = nn.TrainOneStepCell(net, opt)
        return [float(step(Tensor(x), Tensor(y)).asnumpy()) for x, y in batches]

    normal, pool, pool_bc = run("normal"), run("pool"), run("pool_bc")
    diff = float(np.max(np.abs(np.array(normal) - np.array(pool))))
    return {"steps": steps, "loss_first": normal[0], "loss_normal": normal[-1], "loss_pool": pool[-1],
            "loss_pool_bias_corrected": pool_bc[-1], "max_loss_diff": diff}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (smoke run)")
    parser.add_argument("--k", type=int, default=4, help="checkpoint_every for the activation figures")
    parser.add_argument("--steps", type=int, default=50, help="training steps of the loss comparison")
    parser.add_argument("--graph-only", action="store_true",
                        help="only the graph-mode (mode 0) step times of FusedAdamW vs nn.AdamWeightDecay")
    args = parser.parse_args()
    quick = args.quick
    k = args.k
    graph_rounds, graph_per_round = (6, 3) if quick else (30, 5)
    graph_times = {label: graph_mode_step_times(cfg, graph_rounds, graph_per_round)
                   for label, cfg in (("demo", DEMO), ("many_small", MANY_SMALL))}
    for label, times in graph_times.items():
        print(f"graph mode, {label} model ({times['n_tensors']} tensors): optimizer step "
              f"{times['optimizer_ms']['FusedAdamW']:.2f} vs {times['optimizer_ms']['AdamWeightDecay']:.2f} ms "
              f"(ratio {times['optimizer_ratio_median']:.3f}); training step {times['train_step_ms']['FusedAdamW']:.2f} "
              f"vs {times['train_step_ms']['AdamWeightDecay']:.2f} ms (ratio {times['train_step_ratio_median']:.3f})")
    if args.graph_only:
        print(json.dumps({"graph_mode": graph_times}))
        return 0

    rounds, per_round = (6, 3) if quick else (30, 5)
    opt_by_model = {}
    for label, cfg in (("demo", DEMO), ("many_small", MANY_SMALL)):
        times = optimizer_step_times(cfg, rounds=rounds, per_round=per_round)
        times["ratio_median"] = times["FusedAdamW"] / times["AdamWeightDecay"]
        times["ratio_min"] = times["FusedAdamW_min"] / times["AdamWeightDecay_min"]
        times["graph_ratio_median"] = times["FusedAdamW_graph"] / times["AdamWeightDecay"]
        opt_by_model[label] = times
        print(f"optimizer step, {label} model: {times['n_tensors']} tensors, {times['n_elements']} elements "
              f"(median / min of {rounds} interleaved rounds)")
        print(f"  nn.AdamWeightDecay  {times['AdamWeightDecay'] * 1e3:8.2f} / {times['AdamWeightDecay_min'] * 1e3:6.2f} ms")
        low, mid, high = times["round_ratio_quartiles"]
        print(f"  FusedAdamW ({times['path']:<6})  {times['FusedAdamW'] * 1e3:8.2f} / {times['FusedAdamW_min'] * 1e3:6.2f} ms"
              f"   ratio {times['ratio_median']:.3f} / {times['ratio_min']:.3f}"
              f"   (per-round ratios: quartiles {low:.3f} {mid:.3f} {high:.3f})")
        print(f"  FusedAdamW (graph)   {times['FusedAdamW_graph'] * 1e3:8.2f} / {times['FusedAdamW_graph_min'] * 1e3:6.2f} ms"
              f"   ratio {times['graph_ratio_median']:.3f}")
    opt_times = opt_by_model["demo"]
    fused_ratio = opt_times["ratio_median"]

    act_batch = 16
    act_cfg = GPTConfig(**{**DEMO.to_dict(), "seq_length": 128})
    probe = GPTWithLoss(GPT(act_cfg))
    plan = enable_pool_mode(probe, checkpoint_every=k, batch_size=act_batch)
    est_without = plan.notes["activation_without_recompute"]
    est_with = plan.notes["activation_with_recompute"]
    per_block, boundary = plan.notes["activation_per_block"], plan.notes["activation_boundary"]
    measured_without = measured_step_peak(act_cfg, 0, act_batch)
    measured_with = measured_step_peak(act_cfg, k, act_batch)
    measured_ratio = (measured_with / measured_without
                      if measured_without and measured_with is not None else None)
    other_k = 2 if k != 2 else 4
    measured_other = measured_step_peak(act_cfg, other_k, act_batch)
    shadow_without = shadow_source_activations(act_cfg, 0, act_batch)
    shadow_with = shadow_source_activations(act_cfg, k, act_batch)
    shadow_ratio = shadow_with["activation_peak_bytes"] / shadow_without["activation_peak_bytes"]
    shadow_other = shadow_source_activations(act_cfg, other_k, act_batch)
    shadow_other_ratio = shadow_other["activation_peak_bytes"] / shadow_without["activation_peak_bytes"]
    est_other = activation_bytes(per_block, boundary, act_cfg.num_layers, other_k).ratio
    print(f"activations, {act_cfg.num_layers} blocks, batch {act_batch} x {act_cfg.seq_length} tokens, k={k}")
    print(f"  estimator      no recompute {format_size(est_without):>12}   k={k} {format_size(est_with):>12}"
          f"   ratio {est_with / est_without:.3f}  (1/k = {1 / k:.3f})")
    print(f"  measured RSS   no recompute {format_size(measured_without):>12}   k={k} "
          f"{format_size(measured_with):>12}   ratio "
          f"{'-' if measured_ratio is None else f'{measured_ratio:.3f}'}"
          "   (peak RSS growth of one step: activations + gradients + transients)")
    if measured_other is not None and measured_without:
        print(f"  measured RSS   k={other_k} {format_size(measured_other):>12}   ratio "
              f"{measured_other / measured_without:.3f}")
    print(f"  shadow source  no recompute {format_size(shadow_without['activation_peak_bytes']):>12}   k={k} "
          f"{format_size(shadow_with['activation_peak_bytes']):>12}   ratio {shadow_ratio:.3f}"
          f"   (peak of the replay; leaf-Cell outputs only: {shadow_without['activations_observed']} in forward, "
          f"{shadow_with['activations_recomputed']} more recomputed in backward with k={k})")
    print(f"  shadow source  k={other_k} {format_size(shadow_other['activation_peak_bytes']):>12}   ratio "
          f"{shadow_other_ratio:.3f}   (estimator {est_other:.3f})")
    # Kept bytes = groups * boundary + k * per_block: about 1/k of no recompute when the
    # number of blocks is about k*k (the field report: 36+ layers, k = 6).
    table = {}
    for blocks in (act_cfg.num_layers, 36):
        row = {kk: activation_bytes(per_block, boundary, blocks, kk).ratio for kk in (1, 2, 4, 6, 8) if kk <= blocks}
        table[blocks] = row
        print(f"  estimator ratio, {blocks:2d} blocks: " + "  ".join(f"k={kk} {r:.3f}" for kk, r in row.items()))

    step_batch = 8
    step_times = train_step_times(DEMO, k, step_batch, 3 if quick else 8)
    t_plain, t_recompute = step_times["fused"], step_times["fused_recompute"]
    print(f"training step (demo model, batch {step_batch}, FusedAdamW): no recompute {t_plain * 1e3:.0f} ms, "
          f"k={k} {t_recompute * 1e3:.0f} ms, ratio {t_recompute / t_plain:.3f}")
    print(f"training step with nn.AdamWeightDecay {step_times['adamw'] * 1e3:.0f} ms: whole-step ratio "
          f"FusedAdamW / AdamWeightDecay {t_plain / step_times['adamw']:.3f}")

    run_cfg = GPTConfig(num_layers=4, hidden_size=32, num_heads=4, seq_length=32, vocab_size=128, seed=0)
    run = training_run(run_cfg, 10 if quick else args.steps, 8, k=2)
    print(f"training {run['steps']} steps (4 blocks, k=2): loss {run['loss_first']:.4f} -> normal "
          f"{run['loss_normal']:.4f}, pool {run['loss_pool']:.4f} (max step diff {run['max_loss_diff']:.2e}); "
          f"pool with bias correction {run['loss_pool_bias_corrected']:.4f}")

    print(json.dumps({
        "fused_step_ratio": round(fused_ratio, 4),
        "graph_mode": graph_times,
        "fused_step_ms": round(opt_times["FusedAdamW"] * 1e3, 3),
        "adamweightdecay_step_ms": round(opt_times["AdamWeightDecay"] * 1e3, 3),
        "n_param_tensors": opt_times["n_tensors"],
        "fused_step_ratio_min": round(opt_times["ratio_min"], 4),
        "fused_step_path": opt_times["path"],
        "fused_step_round_ratio_quartiles": [round(q, 4) for q in opt_times["round_ratio_quartiles"]],
        "fused_graph_step_ratio": round(opt_times["graph_ratio_median"], 4),
        "fused_graph_step_ms": round(opt_times["FusedAdamW_graph"] * 1e3, 3),
        "fused_step_ratio_by_model": {label: {"n_tensors": t["n_tensors"], "n_elements": t["n_elements"],
                                              "ratio_median": round(t["ratio_median"], 4),
                                              "ratio_min": round(t["ratio_min"], 4),
                                              "graph_ratio_median": round(t["graph_ratio_median"], 4)}
                                      for label, t in opt_by_model.items()},
        "checkpoint_every": k,
        "activation_ratio": round(est_with / est_without, 4),
        "activation_bytes_estimated": {"without_recompute": est_without, "with_recompute": est_with},
        "activation_ratio_measured_rss": None if measured_ratio is None else round(measured_ratio, 4),
        "activation_bytes_measured_rss": {"without_recompute": measured_without, "with_recompute": measured_with,
                                          f"k={other_k}": measured_other},
        "shadow_activation_ratio": round(shadow_ratio, 4),
        "shadow_activation_ratio_by_k": {str(k): round(shadow_ratio, 4), str(other_k): round(shadow_other_ratio, 4)},
        "shadow_source": {"without_recompute": shadow_without, "with_recompute": shadow_with,
                          f"k={other_k}": shadow_other},
        "recompute_step_ratio": round(t_recompute / t_plain, 4),
        "train_step_ms": {"no_recompute": round(t_plain * 1e3, 2), "recompute": round(t_recompute * 1e3, 2),
                          "adamweightdecay": round(step_times["adamw"] * 1e3, 2)},
        "fused_train_step_ratio": round(t_plain / step_times["adamw"], 4),
        "activation_ratio_by_k": {str(b): {str(kk): round(r, 4) for kk, r in row.items()}
                                  for b, row in table.items()},
        "training": run,
        "pool_plan_total": plan.total,
        "quick": quick,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

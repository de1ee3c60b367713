"""Step templates over dims other than ``seq``: ``hidden`` and ``layers`` (docs/simulation.md,
"Templates learned from recordings", "Dims tested").

``hidden``: the demo GPT (2 layers, batch 4) recorded at hidden sizes ``--hiddens`` (the
calibration runs of bench/template_fidelity.py at each, every step marked
``seq``, ``batch``, ``hidden``: one process per hidden size), learned together, then held-out runs
at a hidden size never recorded (``--heldout-hidden``) with ``--steps`` random lengths,
simulated and compared allocation by allocation (``template.fidelity``: size, offset, layout)
and by the pool's peak. MindSpore makes the weights and optimizer states at their first use, in
the first step: the first step's sizes are then fitted in ``seq`` and ``hidden``. ``--warmup SEQ``
(default 52, a length no step plays: every first step is then a new shape to the process)
repeats the part with one step before the setup mark, so that the weights fall in
the prologue, which ``learn`` fits in the dims each recording holds fixed (``hidden``).

``layers``: the demo GPT (hidden ``--layers-hidden``) at ``--layer-counts`` (each its own
process, the calibration runs at each, marked ``seq``, ``batch``, ``layers``), learned together
(a template over the repeated block count, ms_memopt/templates/layers.py), then held-out
runs at ``--heldout-layers`` never recorded, compared in the same way; also what one layer
adds to each class of step (allocations a step at each count).

``both``: ``seq`` and ``batch`` varied together (``--both-models``). The calibration is the plan
``learn`` asks for (ms_memopt/templates/classes.py ``calibration_plan`` over ``--both-seqs`` x
``--both-batches``: the fewest processes that play every class of step, by what is new in it,
each followed by a repeat of every shape it played), learned, then a held-out run of ``--steps``
steps at random lengths (multiples of 4 up to ``--max-len``, none calibrated) and batches
(``--heldout-batches``, none calibrated), compared over the whole run.

Usage:
    python bench/template_dims.py                              # hidden and layers
    python bench/template_dims.py --part both --steps 30 --max-len 64 --keep out/td
    python bench/template_dims.py --part hidden --keep out/td  # keep recordings and templates
    python bench/template_dims.py --keep out/td --reuse        # learn and simulate them again
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

import numpy as np  # noqa: E402

import template_fidelity as tf  # noqa: E402
from ms_memopt.core.events import read_jsonl  # noqa: E402
from ms_memopt.templates.template import load_template  # noqa: E402


def hidden_part(work: Path, hiddens: list[int], heldout_hidden: int, calib: list[int], patterns: list[str],
                steps: int, max_len: int, seeds: list[int], layers: int, warmup: int = 0) -> list[dict]:
    """Calibrate at each hidden size (one run per pattern), learn once, one row per held-out seed.
    ``warmup``: a step at that length before the setup mark (the weights then in the prologue)."""
    dims = ["--dims", "seq,batch,hidden", "--layers", str(layers), "--warmup", str(warmup)]
    tag = f"_warm{warmup}" if warmup else ""
    recs, seconds = [], 0.0
    for hidden in hiddens:
        # the runs of bench/template_fidelity.py at every hidden size: first steps on the grid of
        # calibration lengths x hidden sizes (a quadratic in both needs 6 points off any conic)
        for j, seqs in enumerate(tf.calibration_runs(calib, patterns)):
            path = work / f"hidden{hidden}{tag}_calib{j}.jsonl"
            seconds += tf._record(path, "gpt", seqs, dims + ["--hidden", str(hidden)])
            recs.append(str(path))
    template = work / f"gpt_hidden{tag}.template.json"
    learned = json.loads(tf._cli("learn", *recs, "--out", str(template), "--json"))
    t = load_template(template)
    rows = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        held = [int(x) * 4 for x in rng.integers(2, max_len // 4 + 1, steps)]
        checked, took = tf.held_out_check(template, t, work, f"hidden{heldout_hidden}{tag}_{seed}", "gpt", held,
                                          {"batch": 4, "hidden": heldout_hidden},
                                          dims + ["--hidden", str(heldout_hidden)])
        seconds += took
        rows.append({"part": "hidden", "warmup": warmup, "calibration_hiddens": hiddens,
                     "heldout_hidden": heldout_hidden,
                     "heldout_seed": seed, "heldout_steps": steps, "heldout_lengths": sorted(set(held)),
                     "positions": learned["positions"], "exact": learned["exact"],
                     "prologue_allocs": learned["prologue_allocs"],
                     "not_exact": [f"{m['class']}#{m['alloc']} {m['sizes']}" for m in learned["not_exact_positions"]],
                     **checked, "record_seconds": round(seconds, 1)})
    return rows


def _allocs_per_step(path: Path) -> dict[str, int]:
    """Allocations of the prologue and of each step class's first sample in a recording."""
    from ms_memopt.templates.template import parse_dims_tag
    events = read_jsonl(path).events
    out, count, seen, steps = {}, 0, set(), 0
    for e in events:
        if e.action == "alloc":
            count += 1
        elif e.action == "step":
            dims = parse_dims_tag(e.tag)
            if dims is None:
                out["prologue"] = count
            else:
                key = tuple(sorted(dims.items()))
                kind = "first" if steps == 0 else ("repeat" if key in seen else "new_shape")
                out.setdefault(kind, count)
                seen.add(key)
                steps += 1
            count = 0
    return out


def layers_part(work: Path, counts: list[int], heldout_counts: list[int], calib: list[int], patterns: list[str],
                hidden: int, steps: int, max_len: int, seed: int, model: str = "gpt") -> list[dict]:
    """Record each layer count of ``model`` (one run per pattern), learn them together, show what
    a layer adds; when ``learn`` makes a template, one row per held-out layer count never recorded."""
    dims = ["--dims", "seq,batch,layers", "--hidden", str(hidden)]
    recs, per_count, seconds = [], {}, 0.0
    for layers in counts:
        for j, seqs in enumerate(tf.calibration_runs(calib, patterns)):
            path = work / f"{model}_layers{layers}_h{hidden}_calib{j}.jsonl"
            seconds += tf._record(path, model, seqs, dims + ["--layers", str(layers)])
            recs.append(str(path))
            if j == 0:
                per_count[layers] = _allocs_per_step(path)
    template = work / f"{model}_layers.template.json"
    out = subprocess.run([sys.executable, "-m", "ms_memopt", "learn", *recs, "--out", str(template), "--json"],
                         capture_output=True, text=True, env=tf._env(), cwd=tf._REPO)
    added = {}
    for a, b in zip(counts, counts[1:]):
        added[f"{a}->{b}"] = {k: per_count[b][k] - per_count[a][k] for k in per_count[a] if k in per_count[b]}
    head = {"part": "layers", "model": model, "layer_counts": counts, "allocs": per_count, "added_per_layer": added,
            "learn_exit": out.returncode, "learn_message": (out.stderr if out.returncode else "").strip()[-900:]}
    if out.returncode != 0:
        return [head]
    learned = json.loads(out.stdout)
    t = load_template(template)
    rows = [head]
    rng = np.random.default_rng(seed)
    held = [int(x) * 4 for x in rng.integers(2, max_len // 4 + 1, steps)]
    for layers in heldout_counts:
        checked, took = tf.held_out_check(template, t, work, f"{model}_layers{layers}_h{hidden}_{seed}", model, held,
                                          {"batch": 4, "layers": layers}, dims + ["--layers", str(layers)])
        seconds += took
        rows.append({"part": "layers_heldout", "model": model, "layer_counts": counts, "heldout_layers": layers,
                     "heldout_seed": seed, "heldout_steps": steps, "heldout_lengths": sorted(set(held)),
                     "positions": learned["positions"], "exact": learned["exact"], **checked,
                     "record_seconds": round(seconds, 1)})
    return rows


def both_part(work: Path, model: str, seqs: list[int], batches: list[int], heldout_batches: list[int],
              steps: int, max_len: int, seed: int, extra: list[str]) -> list[dict]:
    """Record the calibration plan for ``seq`` x ``batch``, learn it, one held-out row."""
    from ms_memopt.templates.classes import calibration_plan, classify

    plan = calibration_plan({"seq": seqs, "batch": batches})
    recs, seconds = [], 0.0
    for j, process in enumerate(plan):
        path = work / f"{model}_both_calib{j}.jsonl"
        seconds += tf._record(path, model, [d["seq"] for d in process],
                              extra + ["--batches", ",".join(str(d["batch"]) for d in process)])
        recs.append(str(path))
    template = work / f"{model}_both.template.json"
    learned = json.loads(tf._cli("learn", *recs, "--out", str(template), "--json"))
    t = load_template(template)
    rng = np.random.default_rng(seed)
    lengths = [s for s in range(12, max_len + 1, 4) if s not in seqs]
    held = [int(rng.choice(lengths)) for _ in range(steps)]
    held_batches = [int(rng.choice(heldout_batches)) for _ in range(steps)]
    checked, took = tf.held_out_check(template, t, work, f"{model}_both_{seed}", model, held, {}, extra,
                                      batches=held_batches)
    seconds += took
    kinds = classify([{"seq": s, "batch": b} for s, b in zip(held, held_batches)])
    return [{"part": "both", "model": model, "calibration_seqs": seqs, "calibration_batches": batches,
             "processes": len(plan), "calibration_steps": sum(len(p) for p in plan),
             "heldout_seed": seed, "heldout_steps": steps, "heldout_lengths": sorted(set(held)),
             "heldout_batches": sorted(set(held_batches)),
             "heldout_classes": {k: kinds.count(k) for k in dict.fromkeys(kinds)},
             "positions": learned["positions"], "exact": learned["exact"],
             "classes": {k: {"allocs": c["allocs"], "samples": c["samples"], "covers": c.get("covers", [k]),
                             "runtime_kept": c.get("runtime_kept", {}).get("allocs", 0)}
                         for k, c in learned["classes"].items()},
             "lacks": learned.get("lacks", []), **checked, "record_seconds": round(seconds, 1)}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="hidden,layers", help="comma-separated: hidden, layers, both")
    ap.add_argument("--both-models", default="gpt,gqa,llama", help="models of the both part (seq and batch varied)")
    ap.add_argument("--both-seqs", default="16,24,32", help="the both part's calibration lengths")
    ap.add_argument("--both-batches", default="2,4,6", help="the both part's calibration batches")
    ap.add_argument("--heldout-batches", default="3,5", help="the both part's held-out batches")
    ap.add_argument("--both-layers", type=int, default=2, help="layers of the both part's models")
    ap.add_argument("--both-hidden", type=int, default=64, help="hidden size of the both part's models")
    ap.add_argument("--both-vocab", type=int, default=256, help="vocabulary of the both part's models")
    ap.add_argument("--hiddens", default="32,48,64", help="calibration hidden sizes (one run per pattern each)")
    ap.add_argument("--patterns", default="abbccc,abbccc,abccca",
                    help="calibration runs per hidden size (bench/template_fidelity.py --patterns)")
    ap.add_argument("--heldout-hidden", type=int, default=80)
    ap.add_argument("--calib", default="16,24,32", help="calibration lengths")
    ap.add_argument("--steps", type=int, default=16, help="held-out steps")
    ap.add_argument("--max-len", type=int, default=48, help="longest held-out length")
    ap.add_argument("--seed", default="5,6", help="held-out runs: one per seed (its random lengths)")
    ap.add_argument("--layers", type=int, default=2, help="layers of the hidden part's GPT")
    ap.add_argument("--warmup", type=int, default=52, metavar="SEQ",
                    help="the hidden part again with a warm-up step at SEQ before the setup mark, so the weights "
                    "are made in the prologue (0: not)")
    ap.add_argument("--layer-counts", default="2,3,4,5",
                    help="the layers part's layer counts (one run per pattern each)")
    ap.add_argument("--heldout-layers", default="6,7", help="held-out layer counts (never recorded)")
    ap.add_argument("--layers-hidden", type=int, default=32, help="hidden size of the layers part's model")
    ap.add_argument("--layers-model", default="gpt",
                    help="comma-separated models of the layers part: gpt, gqa, llama (bench/workloads/template_run.py)")
    ap.add_argument("--keep", default=None, help="directory for the recordings, templates and schedules")
    ap.add_argument("--reuse", action="store_true", help="with --keep: do not record again what is there")
    args = ap.parse_args()
    tf.REUSE = args.reuse
    calib = [int(s) for s in args.calib.split(",")]
    parts = args.part.split(",")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "hidden" in parts:
            results += hidden_part(work, [int(h) for h in args.hiddens.split(",")], args.heldout_hidden, calib,
                                   args.patterns.split(","), args.steps, args.max_len,
                                   [int(s) for s in args.seed.split(",")], args.layers)
            if args.warmup:
                results += hidden_part(work, [int(h) for h in args.hiddens.split(",")], args.heldout_hidden, calib,
                                       args.patterns.split(","), args.steps, args.max_len,
                                       [int(s) for s in args.seed.split(",")], args.layers, args.warmup)
        for model in (args.both_models.split(",") if "both" in parts else []):
            results += both_part(work, model, [int(s) for s in args.both_seqs.split(",")],
                                 [int(b) for b in args.both_batches.split(",")],
                                 [int(b) for b in args.heldout_batches.split(",")], args.steps, args.max_len,
                                 int(str(args.seed).split(",")[0]),
                                 ["--layers", str(args.both_layers), "--hidden", str(args.both_hidden),
                                  "--vocab", str(args.both_vocab)])
        for model in (args.layers_model.split(",") if "layers" in parts else []):
            results += layers_part(work, [int(n) for n in args.layer_counts.split(",")],
                                   [int(n) for n in args.heldout_layers.split(",")], calib, args.patterns.split(","),
                                   args.layers_hidden, args.steps, args.max_len, int(str(args.seed).split(",")[0]),
                                   model)
    rows = [r for r in results if r["part"] == "hidden"]
    if rows:
        print(f"{'hidden':<19} {'seed':>4} {'steps':>5} {'lengths':<7} {'exact fits':>11} {'allocs':>7} "
              f"{'size':>7} {'offset':>7} {'layout':>7} {'drawn':>7} {'peak rec/sim':>16}")
        for r in rows:
            lengths = f"{min(r['heldout_lengths'])}-{max(r['heldout_lengths'])}"
            label = f"{','.join(map(str, r['calibration_hiddens']))}->{r['heldout_hidden']}" + \
                (" warm" if r["warmup"] else "")
            print(f"{label:<19} {r['heldout_seed']:>4} {r['heldout_steps']:>5} {lengths:<7} "
                  f"{r['exact']:>5}/{r['positions']:<5} {r['allocs_recorded']:>7} {r['size_match']:>7.2%} "
                  f"{r['offset_match']:>7.2%} {r['layout_match']:>7.2%} {r['offset_match_draw']:>7.2%} "
                  f"{r['peak_allocated_recorded'] / 2**20:>6.2f}/{r['peak_allocated_simulated'] / 2**20:.2f} MiB")
        for r in rows:
            if r["heldout_seed"] == rows[0]["heldout_seed"]:
                what = f"hidden (warm-up {r['warmup']})" if r["warmup"] else "hidden"
                print(f"{what}: prologue allocations {r['prologue_allocs']}; not exact: "
                      f"{', '.join(r['not_exact']) or 'none'}")
                for text in r["warnings"]:
                    print(f"{what}: simulate: {text}")
    for r in results:
        if r["part"] == "layers":
            print(f"{r['model']} layers {r['layer_counts']}: allocations {r['allocs']}; a layer adds "
                  f"{r['added_per_layer']}")
            print(f"{r['model']} layers: learn exit {r['learn_exit']}{': ' + r['learn_message'] if r['learn_message'] else ''}")
        elif r["part"] == "layers_heldout":
            print(f"{r['model']} layers {r['layer_counts']}->{r['heldout_layers']} seed {r['heldout_seed']}: "
                  f"{r['allocs_recorded']} allocations, size {r['size_match']:.2%}, offset {r['offset_match']:.2%}, "
                  f"layout {r['layout_match']:.2%}, drawn {r['offset_match_draw']:.2%}, peak "
                  f"{r['peak_allocated_recorded'] / 2**20:.2f}/{r['peak_allocated_simulated'] / 2**20:.2f} MiB")
    both = [r for r in results if r["part"] == "both"]
    if both:
        print(f"{'seq x batch':<10} {'procs':>5} {'steps':>5} {'exact fits':>11} {'allocs':>7} {'size':>7} {'offset':>7} "
              f"{'layout':>7} {'drawn':>7} {'one of N':>12} {'peak rec/sim':>16}")
        for r in both:
            print(f"{r['model']:<10} {r['processes']:>5} {r['heldout_steps']:>5} {r['exact']:>5}/{r['positions']:<5} "
                  f"{r['allocs_recorded']:>7} {r['size_match']:>7.2%} {r['offset_match']:>7.2%} "
                  f"{r['layout_match']:>7.2%} {r['offset_match_draw']:>7.2%} "
                  f"{r['offset_match_layouts']:>7.2%} of {r['layouts']:<2} "
                  f"{r['peak_allocated_recorded'] / 2**20:>6.2f}/{r['peak_allocated_simulated'] / 2**20:.2f} MiB")
        for r in both:
            print(f"{r['model']}: classes " + "; ".join(f"{k} {c['allocs']} allocs ({c['samples']} samples"
                                                        + (f", covers {len(c['covers'])}" if len(c['covers']) > 1 else "")
                                                        + f", {c['runtime_kept']} runtime-kept)"
                                                        for k, c in r["classes"].items()))
            print(f"{r['model']}: held-out classes {r['heldout_classes']}; lacks {r['lacks'] or 'nothing'}")
            for text in r["warnings"]:
                print(f"{r['model']}: simulate: {text}")
    print(json.dumps({"bench": "template_dims", "results": results}))


if __name__ == "__main__":
    main()

"""Fidelity of step templates learned from recordings (docs/simulation.md, "Templates learned
from recordings").

For each model: three calibration runs recorded with ``ms-memopt record`` (the lengths
``--calib`` played in the ``--patterns``, batch 4), ``ms-memopt learn``
on them, then a held-out run of ``--steps`` random lengths (multiples of 4 up to ``--max-len``,
beyond the calibrated ones) recorded, its schedule CSV written, ``ms-memopt simulate
T.template.json --schedule CSV --export-events`` and the simulated events compared with the
held-out recording allocation by allocation: ``size_match`` (same size at the same position)
and ``offset_match`` (same block, numbered by creation, and same offset in it). Also the peak
allocated of both. Last line: one JSON object.

MindSpore (2.10, CPU, PyNative) draws the order in which it frees a few groups of tensors once
per process (SoftmaxBackward's three intermediates: docs/simulation.md, "Templates learned from
recordings"), so each held-out run is also simulated in the free order of each calibration
recording (``template.free_orders``): ``offset_match_draw`` is the offset match in the order
whose *first step* matches the held-out's first step best (the draw is visible there; the
template itself is learned from the calibration runs only), ``draw_seen`` whether that first
step then matched exactly (the held-out process drew an order some calibration process drew).
``offset_match_layouts`` needs no look at the held-out run: the template's prediction as a set,
``simulate --free-order all`` (every free order it knows, merged into the ``layouts`` distinct
layouts they give), and the best offset match among them. ``--repeat N`` records each held-out
command N times: the same command, N processes, each its own draw.

Usage:
    python bench/template_fidelity.py                         # the demo GPT
    python bench/template_fidelity.py --model gpt,gqa,llama,gpt-train
    python bench/template_fidelity.py --keep out/tf           # keep recordings and templates
    python bench/template_fidelity.py --keep out/tf --reuse   # learn and simulate them again
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

import numpy as np  # noqa: E402

from ms_memopt.core.events import read_jsonl  # noqa: E402
from ms_memopt.templates.template import fidelity, flat_template, free_order_of, load_template  # noqa: E402

WORKLOAD = str(_REPO / "bench/workloads/template_run.py")


HASH_SEED = "0"


def _env() -> dict:
    env = dict(os.environ)
    if HASH_SEED != "random":
        env["PYTHONHASHSEED"] = HASH_SEED      # MindSpore frees a few tensors in Python's set order
    else:
        env.pop("PYTHONHASHSEED", None)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "ms_memopt", *args], capture_output=True, text=True, env=_env(),
                         cwd=_REPO)
    if out.returncode != 0:
        raise SystemExit(f"ms-memopt {' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout


REUSE = False


def _record(out: Path, model: str, seqs: list[int], extra: list[str]) -> float:
    if REUSE and out.exists():          # --reuse: a recording kept by an earlier --keep run
        return 0.0
    start = time.perf_counter()
    _cli("record", "--no-progress", "--out", str(out), "--", "python", WORKLOAD, "--model", model,
         "--seqs", ",".join(map(str, seqs)), *extra)
    return time.perf_counter() - start


def calibration_runs(calib: list[int], patterns: list[str]) -> list[list[int]]:
    """Run ``r`` plays pattern ``r`` with the lengths rotated by ``r``: with ``a, b, c`` the
    lengths, ``abbccc`` is a first step, a new shape after it, a repeat, a new shape after a
    repeat, two repeats; ``abccca`` adds a new shape after a new shape."""
    runs = []
    for r, pattern in enumerate(patterns):
        order = calib[r % len(calib):] + calib[:r % len(calib)]
        runs.append([order[ord(ch) - ord("a")] for ch in pattern])
    return runs


def draw_matched(template, schedule: list[dict], recorded: list, layouts: list[dict], matches: list[float]) -> dict:
    """The free order whose first step frees in the order closest to ``recorded``'s first step
    (ties: the default), and the offset match of the layout it gives (``layouts`` of ``simulate
    --free-order all``, each with the orders that give it; ``matches`` their offset matches).
    Only the held-out's first step is looked at: it shows the process's draw; the template is
    the calibration's."""
    template = flat_template(template, schedule)        # a layered template's orders are its count's
    k, score = free_order_of(template, schedule, recorded)
    same = score == 1.0
    if k is None:
        drawn = "the default order"
    elif template.free_orders[k]["recording"] is not None:
        drawn = "the order of " + Path(template.free_orders[k]["recording"]).name
    else:
        drawn = "permutation " + "".join("abcd"[r] for r in template.free_orders[k]["permutation"])
    match = next(m for layout, m in zip(layouts, matches) if k in layout["free_orders"])
    return {"free_order": k, "first_step_free_order_match": score, "draw_seen": same,
            "heldout_draw": drawn + ("" if same else " (closest; first step not the same)"),
            "offset_match_draw": match}


def held_out_check(template_path: Path, template, work: Path, name: str, model: str, held: list[int],
                   dims: dict[str, int], record_args: list[str], batches: list[int] | None = None) -> tuple[dict, float]:
    """Record a held-out run of ``held`` lengths (``dims`` fixed, ``record_args`` to the workload),
    simulate the same schedule from the template (``simulate --export-events``, with the allocations
    ``learn`` names MindSpore's own leak kept: the recording has them), and compare
    (``batches``: a batch per step, the schedule's ``batch`` column, instead of ``dims``'s):
    ``(figures, record seconds)``; the figures are the fidelity, the drawn order's
    (:func:`draw_matched`), both peaks and the simulator's warnings."""
    held_path = work / f"{name}_heldout.jsonl"
    if batches is not None:
        record_args = record_args + ["--batches", ",".join(map(str, batches))]
    seconds = _record(held_path, model, held, record_args)
    schedule = work / f"{name}_heldout.csv"
    rows = [{"seq": s, **dims, **({"batch": b} if batches is not None else {})}
            for s, b in zip(held, batches or held)]
    names = list(rows[0])
    schedule.write_text(",".join(names) + "\n" + "".join(",".join(str(r[n]) for n in names) + "\n" for r in rows))
    sim_path = work / f"{name}_simulated.jsonl"
    sim = json.loads(_cli("simulate", str(template_path), "--schedule", str(schedule), "--export-events",
                          str(sim_path), "--free-order", "all", "--keep-runtime-leak", "--json"))
    recorded = read_jsonl(held_path).events
    figures = fidelity(recorded, read_jsonl(sim_path).events)      # layout 0: the default order's
    # the template's prediction as a set: every layout its free orders give (a process draws one)
    matches = [fidelity(recorded, read_jsonl(layout["export_events"]).events)["offset_match"]
               for layout in sim["layouts"]]
    figures.update(layouts=len(matches), offset_match_layouts=max(matches),
                   matched_layout=matches.index(max(matches)))
    figures.update(draw_matched(template, rows, recorded, sim["layouts"], matches))
    if not figures["draw_seen"]:
        # an order no calibration process drew: simulated in the order its first step shows
        drawn_path = work / f"{name}_drawn.jsonl"
        drawn = json.loads(_cli("simulate", str(template_path), "--schedule", str(schedule), "--export-events",
                                str(drawn_path), "--free-order-from", str(held_path), "--keep-runtime-leak", "--json"))
        figures.update(offset_match_draw=fidelity(recorded, read_jsonl(drawn_path).events)["offset_match"],
                       heldout_draw="read from its first step (never drawn in calibration)"
                       if "free_order_drawn" in drawn else figures["heldout_draw"],
                       drawn_evidence=drawn.get("free_order_drawn"))
    figures.update(peak_allocated_recorded=json.loads(_cli("replay", str(held_path), "--json"))["peak_allocated"],
                   peak_allocated_simulated=sim["peak_allocated"], warnings=sim["warnings"])
    return figures, seconds


def run_model(model: str, work: Path, calib: list[int], patterns: list[str], steps: int, max_len: int,
              seeds: list[int], extra: list[str], repeat: int = 1) -> list[dict]:
    """Calibrate and learn once, then one row per held-out run (seed: its random lengths;
    ``repeat``: that many processes of the same command per seed, each its own draw)."""
    recs = []
    seconds = 0.0
    for r, seqs in enumerate(calibration_runs(calib, patterns)):
        path = work / f"{model}_calib{r}.jsonl"
        seconds += _record(path, model, seqs, extra)
        recs.append(str(path))
    template = work / f"{model}.template.json"
    learned = json.loads(_cli("learn", *recs, "--out", str(template), "--json"))
    t = load_template(template)
    rows = []
    for seed, again in [(seed, again) for seed in seeds for again in range(repeat)]:
        rng = np.random.default_rng(seed)
        held = [int(x) * 4 for x in rng.integers(2, max_len // 4 + 1, steps)]
        name = f"{model}_{seed}" + (f"_again{again}" if again else "")
        checked, took = held_out_check(template, t, work, name, model, held, {"batch": 4}, extra)
        seconds += took
        rows.append({"model": model, "heldout_seed": seed, "again": again, "hash_seed": HASH_SEED,
                     "calibration": calib,
                     "patterns": patterns, "heldout_steps": steps, "heldout_lengths": sorted(set(held)),
                     "beyond_calibration": sorted({s for s in held if s > max(calib)}),
                     "positions": learned["positions"], "exact": learned["exact"],
                     "not_exact": [f"{m['class']}#{m['alloc']} {m['sizes']}" for m in learned["not_exact_positions"]],
                     "free_order_variants": {k: c.get("free_order_variants", 0) for k, c in t.classes.items()},
                     **checked, "free_orders": len(t.free_orders),
                     "classes": {k: len([o for o in c["ops"] if o[0] == "a"]) for k, c in t.classes.items()},
                     "record_seconds": round(seconds, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt", help="comma-separated: gpt (demo GPT), gqa (RMSNorm/GQA/SwiGLU), "
                    "llama (MindFormers' LlamaForCausalLM, tiny), gpt-train (the demo GPT through Model.train)")
    ap.add_argument("--calib", default="16,24,32", help="calibration lengths")
    ap.add_argument("--patterns", default="abbccc,abbccc,abccca",
                    help="one calibration run per pattern (a, b, c: the lengths, rotated per run)")
    ap.add_argument("--steps", type=int, default=32, help="held-out steps")
    ap.add_argument("--max-len", type=int, default=48, help="longest held-out length")
    ap.add_argument("--seed", default="5,6,7", help="held-out runs: one per seed (its random lengths)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="held-out processes per seed, the same command each time (how often each draw comes)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--hash-seed", default="0",
                    help="PYTHONHASHSEED of every recorded run (random: each run its own, as Python does by default)")
    ap.add_argument("--keep", default=None, help="directory for the recordings, templates and schedules")
    ap.add_argument("--reuse", action="store_true", help="with --keep: do not record again what is there")
    args = ap.parse_args()
    global HASH_SEED, REUSE
    HASH_SEED, REUSE = args.hash_seed, args.reuse
    calib = [int(s) for s in args.calib.split(",")]
    extra = ["--layers", str(args.layers), "--hidden", str(args.hidden)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for model in args.model.split(","):
            results.extend(run_model(model, work, calib, args.patterns.split(","), args.steps, args.max_len,
                                     [int(x) for x in str(args.seed).split(",")], extra, args.repeat))
    print(f"{'model':<9} {'seed':>6} {'steps':>5} {'lengths':<7} {'exact fits':>11} {'allocs':>7} "
          f"{'size':>7} {'offset':>7} {'layout':>7} {'drawn':>7} {'seen':>5} {'one of N':>12} {'peak rec/sim':>16}")
    for r in results:
        lengths = f"{min(r['heldout_lengths'])}-{max(r['heldout_lengths'])}"
        seed = f"{r['heldout_seed']}" + (f"/{r['again']}" if r["again"] else "")
        print(f"{r['model']:<9} {seed:>6} {r['heldout_steps']:>5} {lengths:<7} "
              f"{r['exact']:>5}/{r['positions']:<5} {r['allocs_recorded']:>7} {r['size_match']:>7.2%} "
              f"{r['offset_match']:>7.2%} {r['layout_match']:>7.2%} {r['offset_match_draw']:>7.2%} "
              f"{'yes' if r['draw_seen'] else 'no':>5} {r['offset_match_layouts']:>7.2%} of {r['layouts']:<2} "
              f"{r['peak_allocated_recorded'] / 2**20:>6.2f}/"
              f"{r['peak_allocated_simulated'] / 2**20:.2f} MiB")
    for model in dict.fromkeys(r["model"] for r in results):
        first = next(r for r in results if r["model"] == model)
        print(f"{model}: not exact: {', '.join(first['not_exact']) or 'none'}; calibration steps freeing in "
              f"another order than the template: {first['free_order_variants']}")
        for text in first["warnings"]:
            print(f"{model}: simulate: {text}")
    for r in results:
        again = f" (again, {r['again']})" if r["again"] else ""
        print(f"{r['model']} seed {r['heldout_seed']}{again}: the held-out process freed in {r['heldout_draw']}")
    print(json.dumps({"bench": "template_fidelity", "results": results}))


if __name__ == "__main__":
    main()

"""Benchmark: does the forecast warn earlier, and falsely less often, than the two alarms?

Runs many seeds of the 100B recipe and of its sensitivity variants under the ``baseline``
policy — some that OOM (the reference, more shape variety, more micro-batches) and some that
do not within the run (+4 GiB, which OOMs at 1550-1780 when run 2000 steps; +8 GiB, bounded
variation, all variation off) — and replays each run's
samples through three warning rules, checked every ``--check-every`` steps (a scan):

(a) ``frag_ratio``: some sample since the last check has a frag ratio above a threshold
    (``LayoutScanCallback``'s ``frag_warn``, 3.0 by default);
(b) ``margin``: the smallest ``largest_free`` seen before the watched request since the last
    check is below ``(1 + margin)`` times it (the ``compact`` policy's earlier trigger, 0.5);
(c) ``forecast``: :class:`ms_memopt.analysis.forecast.Forecaster` fed the same samples (and the memory
    in use after each optimizer step) warns when the probability that a window's smallest
    ``largest_free`` falls below the request within ``H`` steps reaches ``RISK``, with windows
    of 5 or 10 steps (setting ``forecast:WINDOW:H:RISK``).

For each rule: the share of OOM runs warned in time (a first warning at least one check before
the OOM), the median lead in steps (OOM step - first warning), the false-alarm rate (runs that
never OOM with a warning at a step <= steps - ``--censor``: a warning in the last ``--censor``
steps might be right about an OOM after the run's end, so it counts for no rule), and for the
forecast the median error of the crossing step it estimated at its first warning. Runs are
1000 steps long: at 600, three of six reference seeds that OOM at 624-748 counted as runs
that never OOM, and every rule that warned them 200 steps ahead was charged a false alarm.

Calibration and evaluation use different seeds (``--calib-seeds`` 0-9, among them the seeds
looked at while the method was designed; ``--eval-seeds`` 40-51 by default, 12 seeds: 36 OOM
runs and 37 without, enough that false alarms can differ at all). Every rule is calibrated
the same way: on the calibration seeds, its most aggressive setting with at most
``--max-false-alarms`` (0) false alarms: the largest share of OOM runs warned in time, then
the longest median lead. The evaluation seeds are then scored with it; that is what the JSON's
``rules`` holds. Rules (a) and (b) are also scored at today's defaults (3.0, 0.5).

Two comparisons do without a calibration: ``matched`` (the baseline's setting that matches the
forecast on one axis, read on the other) and ``dominance`` (every baseline setting against the
forecast's whole operating curve: is some forecast setting at least as good on warned runs,
lead and false alarms, and better on one).

Usage: nice -n 10 python bench/forecast.py [--steps 1000] [--workers 2] [--full]

About 150 s on an idle 2-core machine. ``--full`` is the full study: 20 evaluation seeds and
more variants. The last line is one JSON object
``{"rules": {"frag_ratio": R, "margin": R, "forecast": R}, ...}``, each
``R = {"warned_share", "median_lead_steps", "false_alarm_rate", "runs"}``.
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ms_memopt.analysis.forecast import Forecaster
from ms_memopt.config.recipe import load_recipe
from ms_memopt.simulation.spec import config_from_recipe
from ms_memopt.simulation.simulate import simulate
from ms_memopt.simulation.spec import spec_from_recipe

GiB = 2**30
FRAG_THRESHOLDS = (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0)
MARGINS = (0.1, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.75, 1.0, 1.5, 2.0)
HORIZONS = (25, 50, 100, 150, 200)
RISKS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7)
WINDOWS = (5, 10)          # steps per window of the forecast (6 windows before the first forecast)
FORECASTS = [f"forecast:{w}:{h}:{r}" for w in WINDOWS for h in HORIZONS for r in RISKS]
#: every setting of each rule, by rule; the two baselines first
SETTINGS = {"frag_ratio": [f"frag_ratio:{t}" for t in FRAG_THRESHOLDS], "margin": [f"margin:{m}" for m in MARGINS],
            "forecast": FORECASTS}
BASELINES = ("frag_ratio", "margin")
TODAY = {"frag_ratio": 3.0, "margin": 0.5}


def variants(full: bool) -> list[tuple[str, dict, dict, bool]]:
    """(label, spec changes, config changes, deterministic) of every run family."""
    out = [("reference", {}, {}, False),
           ("seq_align / 2", {"seq_align": 2}, {}, False),
           ("micro_batches x 1.5", {"micro_batches": 24}, {}, False),
           ("capacity +4 GiB", {}, {"capacity_plus": 4 * GiB}, False),
           ("capacity +8 GiB", {}, {"capacity_plus": 8 * GiB}, False),
           ("bounded variation", {"seq_buckets": (2048, 4096, 6144, 8192), "cache_max_shapes": 64}, {}, False),
           ("control: all off", {"enabled": False}, {}, True)]
    if full:
        out += [("capacity +16 GiB", {}, {"capacity_plus": 16 * GiB}, False),
                ("ablation: no shape_cache", {"cache_bytes_per_shape": 0}, {}, False),
                ("ablation: no extra_allocs", {"extra_probability": 0.0}, {}, False)]
    return out


# --- one run (worker) ----------------------------------------------------------------------------
def _one(job: tuple) -> dict:
    """Simulate one variant and seed (baseline), replay its samples through every rule setting."""
    label, recipe_path, spec_changes, cfg_changes, seed, steps, check_every = job
    recipe = load_recipe(recipe_path)
    spec = replace(spec_from_recipe(recipe), **spec_changes)
    cfg = config_from_recipe(recipe, steps=steps, scan_every=check_every, compact_every=None)
    cfg.capacity += cfg_changes.get("capacity_plus", 0)
    buf = io.StringIO()
    started = time.perf_counter()
    result = simulate(spec, cfg, policies=("baseline",), seeds=[seed], timeline=buf)["baseline"].seeds[0]
    seconds = time.perf_counter() - started
    rows = [json.loads(line) for line in buf.getvalue().splitlines()]
    request = max(cfg.watch.values())
    first, predicted = _replay(rows, request, check_every, steps)
    return {"label": label, "seed": seed, "steps": steps, "oom_step": result.oom_step, "oom_tag": result.oom_tag,
            "first_warning": first, "predicted": predicted, "seconds": seconds,
            "largest_free_min_gib": round((result.largest_free_min or 0) / GiB, 2)}


def _replay(rows: list[dict], request: int, check_every: int, steps: int) -> tuple[dict, dict]:
    """First warning step of every rule setting, checked at each scan (every ``check_every``
    steps) on the samples since the previous one; for the forecast also the crossing step it
    estimated at that first warning."""
    first: dict[str, int | None] = {}
    predicted: dict[str, int | None] = {}
    forecasters = {window: Forecaster(request, window=window) for window in WINDOWS}
    frag_max, watch_min = None, None

    def warn(key: str, step: int, when: bool, estimate: int | None = None) -> None:
        if when and first.get(key) is None:
            first[key], predicted[key] = step, estimate

    for row in rows:
        step, kind = row["step"], row["kind"]
        if kind == "oom":
            break
        ratio = row.get("frag_ratio")
        if ratio is not None:
            frag_max = ratio if frag_max is None else max(frag_max, ratio)
        if kind == "watch":
            watch_min = row["largest_free"] if watch_min is None else min(watch_min, row["largest_free"])
            for f in forecasters.values():
                f.add(step, row["largest_free"])
        if kind != "scan":
            continue
        for f in forecasters.values():
            f.add(step, None, long_lived=row["allocated"])
        for threshold in FRAG_THRESHOLDS:
            warn(f"frag_ratio:{threshold}", step, frag_max is not None and frag_max > threshold)
        for margin in MARGINS:
            warn(f"margin:{margin}", step, watch_min is not None and watch_min < request * (1 + margin))
        for window, f in forecasters.items():
            fc = f.forecast()
            for horizon in HORIZONS:
                chance = fc.probability(horizon)
                for risk in RISKS:
                    warn(f"forecast:{window}:{horizon}:{risk}", step, chance >= risk, fc.step)
        frag_max, watch_min = None, None
    return first, predicted


# --- scoring ---------------------------------------------------------------------------------------
def score(runs: list[dict], key: str, *, min_lead: int, censor: int) -> dict:
    """warned_share, median_lead_steps, false_alarm_rate (and the counts) of one rule setting."""
    ooms = [r for r in runs if r["oom_step"] is not None]
    safe = [r for r in runs if r["oom_step"] is None]
    leads, errors = [], []
    for r in ooms:
        w = r["first_warning"].get(key)
        if w is not None and r["oom_step"] - w >= min_lead:
            leads.append(r["oom_step"] - w)
            if r["predicted"].get(key) is not None and key.startswith("forecast"):
                errors.append(r["predicted"][key] - r["oom_step"])
    alarms = [r for r in safe if (w := r["first_warning"].get(key)) is not None and w <= r["steps"] - censor]
    out = {"warned_share": round(len(leads) / len(ooms), 3) if ooms else None,
           "median_lead_steps": statistics.median(leads) if leads else None,
           "false_alarm_rate": round(len(alarms) / len(safe), 3) if safe else None,
           "runs": len(runs), "oom_runs": len(ooms), "safe_runs": len(safe), "warned": len(leads),
           "false_alarms": len(alarms)}
    if errors:
        out["median_crossing_error_steps"] = statistics.median(errors)
        out["median_abs_crossing_error_steps"] = statistics.median(abs(e) for e in errors)
    return out


def calibrate(runs: list[dict], keys: list[str], *, max_false_alarms: int, **kw) -> str:
    """The most aggressive setting among ``keys`` with at most ``max_false_alarms`` false alarms
    on ``runs``: the largest share of OOM runs warned in time, then the longest median lead
    (then the fewest false alarms). Without any such setting, the one with the fewest false
    alarms. The same for every rule, so their lead and false alarms compare."""
    scored = [(score(runs, k, **kw), k) for k in keys]
    allowed = [(s, k) for s, k in scored if s["false_alarms"] <= max_false_alarms]
    if not allowed:
        fewest = min(s["false_alarms"] for s, _ in scored)
        allowed = [(s, k) for s, k in scored if s["false_alarms"] == fewest]
    return max(allowed, key=lambda c: (c[0]["warned_share"] or 0.0, c[0]["median_lead_steps"] or 0,
                                       -c[0]["false_alarms"]))[1]


def _run_all(jobs: list[tuple], workers: int) -> list[dict]:
    from concurrent.futures import ProcessPoolExecutor, as_completed

    started = time.perf_counter()
    out = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_one, job) for job in jobs]
        for future in as_completed(futures):
            r = future.result()
            out.append(r)
            print(f"# {time.perf_counter() - started:5.0f} s  {r['label']:<22} seed {r['seed']:>3}: "
                  f"OOM {r['oom_step']} ({r['oom_tag']}), smallest largest_free {r['largest_free_min_gib']} GiB, "
                  f"{r['seconds']:.0f} s", file=sys.stderr, flush=True)
    return sorted(out, key=lambda r: (r["label"], r["seed"]))


def _matched(forecast: dict, baseline: list[dict]) -> dict:
    """The forecast against one baseline's settings, on both axes at once: the fewest false alarms
    of a setting that warns as many OOM runs at least as early (matched lead), and the longest
    lead of a setting that warns as many runs with at most the forecast's false alarms (matched
    false alarms). ``forecast_ahead``: fewer false alarms at matched lead and a longer lead at
    matched false alarms (a baseline with no such setting counts as behind on that axis)."""
    def as_good(s: dict) -> bool:
        return (s["warned_share"] or 0) >= (forecast["warned_share"] or 0)

    early = [s for s in baseline if as_good(s) and (s["median_lead_steps"] or 0) >= forecast["median_lead_steps"]]
    clean = [s for s in baseline if as_good(s) and s["false_alarms"] <= forecast["false_alarms"]]
    at_lead = min(early, key=lambda s: s["false_alarms"], default=None)
    at_fa = max(clean, key=lambda s: s["median_lead_steps"] or 0, default=None)
    ahead = ((at_lead is None or at_lead["false_alarms"] > forecast["false_alarms"])
             and (at_fa is None or (at_fa["median_lead_steps"] or 0) < forecast["median_lead_steps"]))
    return {"at_forecast_lead": at_lead, "at_forecast_false_alarms": at_fa, "forecast_ahead": ahead}


def _dominance(forecasts: list[dict], baseline: list[dict]) -> dict:
    """Every setting of one baseline against the forecast's operating curve, without any
    calibration: a setting is dominated when some forecast setting warns at least as many OOM
    runs in time, with at least its median lead and at most its false alarms, and is better on
    one of the three. ``undominated`` are the baseline settings no forecast setting matches
    (``by`` names, for each dominated one, the forecast setting with the fewest false alarms,
    then the longest lead)."""
    def lead(s: dict) -> float:
        return s["median_lead_steps"] or 0

    def beats(f: dict, b: dict) -> bool:
        at_least = f["warned"] >= b["warned"] and lead(f) >= lead(b) and f["false_alarms"] <= b["false_alarms"]
        return at_least and (f["warned"] > b["warned"] or lead(f) > lead(b) or f["false_alarms"] < b["false_alarms"])

    by = {}
    for b in baseline:
        better = [f for f in forecasts if beats(f, b)]
        by[b["setting"]] = max(better, key=lambda f: (-f["false_alarms"], lead(f)), default={}).get("setting")
    undominated = [b for b in baseline if by[b["setting"]] is None]
    return {"dominated": sum(v is not None for v in by.values()), "settings": len(baseline), "by": by,
            "undominated": [{k: b[k] for k in ("setting", "warned", "median_lead_steps", "false_alarms",
                                               "false_alarm_rate")} for b in undominated],
            "undominated_min_false_alarm_rate": min((b["false_alarm_rate"] for b in undominated), default=None)}


def _fmt(s: dict) -> str:
    share = "-" if s["warned_share"] is None else f"{s['warned_share']:.2f} ({s['warned']}/{s['oom_runs']})"
    lead = "-" if s["median_lead_steps"] is None else f"{s['median_lead_steps']:g}"
    fa = "-" if s["false_alarm_rate"] is None else f"{s['false_alarm_rate']:.2f} ({s['false_alarms']}/{s['safe_runs']})"
    err = s.get("median_crossing_error_steps")
    return f"{share:>14} {lead:>10} {fa:>14} {('-' if err is None else f'{err:+g}'):>12}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "dense_100b_1024x910c.yaml"))
    parser.add_argument("--steps", type=int, default=1000, help="steps per run (default 1000)")
    parser.add_argument("--calib-seeds", default=None, help="comma-separated (default 0-9)")
    parser.add_argument("--eval-seeds", default=None, help="comma-separated (default 40-51; --full 40-59)")
    parser.add_argument("--check-every", type=int, default=10, help="steps between checks (scans)")
    parser.add_argument("--censor", type=int, default=150,
                        help="a warning in a run's last CENSOR steps is no false alarm (default 150)")
    parser.add_argument("--min-lead", type=int, default=10, help="a warning in time comes this many steps early")
    parser.add_argument("--max-false-alarms", type=int, default=0,
                        help="calibration: each rule's most aggressive setting with at most this many false alarms "
                             "on the calibration seeds (default 0)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--save", metavar="FILE", help="write every run's first warnings as JSON")
    parser.add_argument("--full", action="store_true", help="the full study (1000 steps, more seeds and variants)")
    args = parser.parse_args()
    steps = args.steps
    calib = [int(s) for s in (args.calib_seeds or ",".join(map(str, range(10)))).split(",")]
    evals = [int(s) for s in (args.eval_seeds or ",".join(map(str, range(40, 60 if args.full else 52)))).split(",")]
    if set(calib) & set(evals):
        parser.error("calibration and evaluation seeds must differ")
    started = time.perf_counter()
    jobs = []
    for label, spec_changes, cfg_changes, deterministic in variants(args.full):
        for seed in (calib[:1] + evals[:1]) if deterministic else calib + evals:
            jobs.append((label, args.recipe, spec_changes, cfg_changes, seed, steps, args.check_every))
    runs = _run_all(jobs, args.workers)
    if args.save:
        Path(args.save).write_text(json.dumps(runs))
    calib_runs = [r for r in runs if r["seed"] in calib]
    eval_runs = [r for r in runs if r["seed"] in evals]
    kw = {"min_lead": args.min_lead, "censor": args.censor}

    ck = {**kw, "max_false_alarms": args.max_false_alarms}
    chosen = {rule: calibrate(calib_runs, keys, **ck) for rule, keys in SETTINGS.items()}
    today = {rule: f"{rule}:{value}" for rule, value in TODAY.items()}

    print(f"{len(runs)} runs of {steps} steps, checks every {args.check_every} steps; calibration seeds {calib}, "
          f"evaluation seeds {evals}; in time = >= {args.min_lead} steps before the OOM; false alarms counted "
          f"up to step {steps - args.censor}; each rule calibrated as its most aggressive setting with at most "
          f"{args.max_false_alarms} false alarms on the calibration seeds")
    print("\nruns (evaluation seeds): OOM steps per variant")
    for label, *_ in variants(args.full):
        mine = [r for r in eval_runs if r["label"] == label]
        print(f"  {label:<26} " + ", ".join(f"{r['oom_step'] or '-'}" for r in mine))
    print(f"\n{'rule (setting)':<34} {'seeds':<6} {'warned share':>14} {'lead':>10} {'false alarms':>14} "
          f"{'xing err':>12}")
    table = {}
    for rule in SETTINGS:
        settings = [("calibrated", chosen[rule])] + ([("today", today[rule])] if rule in today else [])
        for name, key in settings:
            for seeds_name, subset in (("calib", calib_runs), ("eval", eval_runs)):
                s = score(subset, key, **kw)
                table[f"{key} [{seeds_name}]"] = s
                print(f"{key + ' (' + name + ')':<34} {seeds_name:<6} {_fmt(s)}")
    # every setting scored once on the evaluation seeds; the sweep, the clean leads, `matched` and
    # `dominance` read these
    curves = {rule: [score(eval_runs, k, **kw) | {"setting": k} for k in keys] for rule, keys in SETTINGS.items()}
    print(f"\nsweep on the evaluation seeds (for reference; the settings above were chosen on calibration seeds)")
    for s in [s for curve in curves.values() for s in curve]:
        print(f"  {s['setting']:<32} {_fmt(s)}")
    print("\nlongest median lead among settings without a false alarm (evaluation seeds; a rule's "
          "lead at its own false-alarm rate is not comparable)")
    best_clean = {}
    for rule, curve in curves.items():
        clean = [s for s in curve if s["false_alarm_rate"] == 0 and s["warned_share"]]
        sc = max(clean, key=lambda s: (s["warned_share"], s["median_lead_steps"] or 0), default=None)
        best_clean[rule] = None if sc is None else {"setting": sc["setting"], **sc}
        print(f"  {rule:<12} " + ("no setting without false alarms" if sc is None
                                  else f"{sc['setting']:<26} {_fmt(sc)}"))
    rules = {rule: score(eval_runs, chosen[rule], **kw) for rule in SETTINGS}
    matched = {rule: _matched(rules["forecast"], curves[rule]) for rule in BASELINES}
    print(f"\nthe calibrated forecast ({chosen['forecast']}) against each baseline's best setting on the evaluation "
          "seeds (chosen there, which favours the baseline)")
    for rule, m in matched.items():
        lead, fa = m["at_forecast_lead"], m["at_forecast_false_alarms"]
        print(f"  {rule:<12} to warn as many runs as early: "
              + ("no setting does" if lead is None else f"{lead['setting']}, {lead['false_alarms']} false alarms")
              + f" (forecast {rules['forecast']['false_alarms']}); with at most the forecast's false alarms: "
              + ("no setting warns as many runs" if fa is None else
                 f"{fa['setting']}, median lead {fa['median_lead_steps']:g}")
              + f" (forecast {rules['forecast']['median_lead_steps']:g}); forecast ahead: {m['forecast_ahead']}")
    dominance = {rule: _dominance(curves["forecast"], curves[rule]) for rule in BASELINES}
    print("\noperating curves on the evaluation seeds (no calibration): each baseline setting against every "
          "forecast setting; dominated = some forecast setting warns as many OOM runs, as early, with at most "
          "its false alarms, and is better on one")
    for rule, d in dominance.items():
        rest = ", ".join(f"{b['setting']} (false alarms {b['false_alarm_rate']:.2f})" for b in d["undominated"])
        print(f"  {rule:<12} {d['dominated']} of {d['settings']} settings dominated"
              + (f"; not dominated: {rest}" if rest else ""))
    seconds = time.perf_counter() - started
    print(f"\n{len(runs)} runs in {seconds:.0f} s")
    print(json.dumps({"rules": rules,
                      "settings": chosen,
                      "calibration": f"most aggressive setting with <= {args.max_false_alarms} false alarms on the "
                                     f"calibration seeds",
                      "today": {rule: {"setting": today[rule], **score(eval_runs, today[rule], **kw)}
                                for rule in BASELINES},
                      "best_without_false_alarms": best_clean,
                      "matched": matched,
                      "dominance": dominance,
                      "calibration_seeds": calib, "evaluation_seeds": evals, "steps": steps,
                      "check_every": args.check_every, "censor": args.censor, "min_lead": args.min_lead,
                      "runs": len(runs), "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()

"""The hand-made step workload against reality (docs/simulation.md, "The hand-made workload
against reality"; issue 23, item 5).

For small GPTs built from ``recipes/demo_cpu.yaml`` (the demo: 2 layers, hidden 64, 4 heads, FFN
176, vocab 256, batch 4, fp32; and variants with 4 layers and/or hidden 128, FFN 352), this bench

1. records three calibration runs per model with ``ms-memopt record`` (lengths 16, 24, 32 in the
   patterns ``abbccc``, ``abbccc``, ``abccca``, rotated per run, as bench/template_fidelity.py does)
   and one *shapes run* of ``--shapes`` lengths each new (to see whether per-shape tensors are
   ever evicted), ``PYTHONHASHSEED=0``;
2. learns the step template (:func:`ms_memopt.templates.template.learn_files`) and generates the
   schedule 16, 24, 24, 32, 32, 16 (then two more 32s that are not reported: they let the last
   reported step's tensors freed by the next step be freed);
3. generates the same schedule with the hand-made :class:`~ms_memopt.workload.step.StepWorkload`
   of ``spec_from_recipe`` of the same model (each step's length forced);
4. measures both streams with one set of rules (:func:`step_figures`):

   * allocations per step, by class (first, new shape, repeat);
   * peak allocated in the step (above what was live at its start) and across steps;
   * **saved** bytes: allocated in the step before the *boundary* and freed after it, in the
     same step. The boundary is the peak of the tensors the step both allocates and frees (in
     the recordings, the loss gradient of the LM head; in StepWorkload, the first backward
     layer); tensors the step hands on (MindSpore's weight gradients, freed by the next step)
     would move it to the end of the backward. Whatever else is live at the boundary (the loss
     gradient, a backward workspace) does not depend on the layer count, so the **per-layer**
     figures are differences between two models that differ only in layers (:func:`per_layer`),
     e.g. (4-layer - 2-layer) / 2, and multiset differences of the sizes (:func:`layer_sizes`,
     which also drop a tensor live at the boundary whose size changes with the layer count);
   * **transient** bytes: allocated and freed on the same side of the boundary (forward /
     backward workspaces, the backward's weight gradients in StepWorkload), their sum and peak;
   * **kept** bytes: allocated in the step and never freed by the end of the run (the per-shape
     cache of a new shape; what the first step creates for good);
   * persistent bytes: the prologue plus what the first step keeps.

Last line: one JSON object. A few minutes on 2 busy cores (every recording is a handful of
steps of a tiny model).

Usage:
    python bench/workload_vs_template.py                       # 2 and 4 layers at hidden 64 and 128
    python bench/workload_vs_template.py --models 2x64,4x64    # LAYERSxHIDDEN
    python bench/workload_vs_template.py --keep /tmp/wvt --reuse  # keep (and reuse) the recordings
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from ms_memopt.core.events import Event  # noqa: E402
from ms_memopt.templates.template import parse_dims_tag  # noqa: E402

RECIPE = _REPO / "recipes/demo_cpu.yaml"
CALIB = (16, 24, 32)
PATTERNS = ("abbccc", "abbccc", "abccca")
#: the reported schedule (first, new shape, repeat, new shape, repeat, repeat) and the unreported tail
SCHEDULE = (16, 24, 24, 32, 32, 16)
TAIL = (32, 32)
HASH_SEED = "0"
REUSE = False        # --reuse: keep recordings already in --keep


# --- the measurement (pure: event lists in, figures out; tests/test_workload_vs_template.py) -------
@dataclass
class StepFigures:
    """One step's memory figures, bytes (see the module docstring for the rules).

    ``peak_in_step``: the most bytes live at once counting only the step's own allocations;
    ``peak_total``: the most bytes live at once counting everything (prologue, earlier steps).
    ``saved_*``: allocated before the boundary and freed after it, in the step; the boundary
    (``peak_at``) is the peak of the tensors the step both allocates and frees. ``forward_*`` /
    ``backward_*``: allocated and freed in the step, both before / both after the boundary.
    ``transient_peak``: the most bytes of forward and backward transients live at once.
    ``kept_*``: allocated in the step and still live at the end of the run.
    """

    kind: str
    seq: int
    allocs: int
    alloc_bytes: int
    peak_in_step: int
    peak_total: int
    peak_at: int               # op index (allocs and frees of the step) of the boundary
    ops: int
    saved_allocs: int
    saved_bytes: int
    forward_bytes: int
    backward_bytes: int
    transient_peak: int
    kept_allocs: int
    kept_bytes: int
    saved_sizes: list = None       # the saved tensors' sizes, largest first
    forward_sizes: list = None     # the forward transients' sizes, largest first


def classify(lengths: Sequence[int]) -> list[str]:
    """The template's step classes of a schedule: ``first``, then ``new_shape`` at a length not
    run before, else ``repeat``.

    Example:
        >>> classify([16, 24, 24, 16])
        ['first', 'new_shape', 'repeat', 'repeat']
    """
    seen: set[int] = set()
    out = []
    for i, n in enumerate(lengths):
        out.append("first" if i == 0 else ("repeat" if n in seen else "new_shape"))
        seen.add(n)
    return out


def split_marked(events: Iterable[Event], prologue_events: int = 0) -> tuple[list[Event], list[tuple[int, list[Event]]]]:
    """A recording (or template-generated events) as ``(prologue, [(seq, step events), ...])``.

    A ``step`` event with dims (``dims:seq=S,...``) *ends* a step; one without dims ends the
    prologue (the setup mark); the first ``prologue_events`` events are the prologue too (what
    :func:`~ms_memopt.templates.template.generate` emits before step 1). Events after the last step
    mark (the process exit) are dropped; only ``alloc`` and ``free`` are kept.

    Example:
        >>> ev = [Event("alloc", id=1, size=8), Event("step", step=0),
        ...       Event("alloc", id=2, size=4), Event("free", id=2), Event("step", step=1, tag="dims:seq=8")]
        >>> pro, steps = split_marked(ev)
        >>> len(pro), [(s, len(e)) for s, e in steps]
        (1, [(8, 2)])
    """
    events = list(events)
    prologue = [e for e in events[:prologue_events] if e.action in ("alloc", "free")]
    steps: list[tuple[int, list[Event]]] = []
    chunk: list[Event] = []
    for e in events[prologue_events:]:
        if e.action == "step":
            dims = parse_dims_tag(e.tag)
            if dims is None:
                if not steps:          # the setup mark: everything so far is the prologue
                    prologue.extend(chunk)
                    chunk = []
                continue
            steps.append((dims.get("seq", 0), chunk))
            chunk = []
        elif e.action in ("alloc", "free"):
            chunk.append(e)
    return prologue, steps


def step_figures(prologue: Sequence[Event], steps: Sequence[tuple[int, Sequence[Event]]]) -> list[StepFigures]:
    """The figures of every step (the class of each from its place, :func:`classify`).

    Example (two layers: two saved tensors of 100 B, a 50 B workspace each side; the backward
    workspace live at the peak spans it too, which :func:`per_layer` differences cancel):
        >>> def step(i):
        ...     a = lambda n, s: Event("alloc", id=i * 10 + n, size=s)
        ...     f = lambda n: Event("free", id=i * 10 + n)
        ...     return [a(1, 50), a(2, 100), f(1), a(3, 100), a(4, 50), f(4), f(3), f(2)]
        >>> [(fig.saved_bytes, fig.forward_bytes, fig.peak_in_step) for fig in step_figures([], [(8, step(1))])]
        [(250, 50, 250)]
    """
    size: dict[int, int] = {}
    live_total = sum(e.size for e in prologue if e.action == "alloc")
    for e in prologue:
        if e.action == "alloc":
            size[e.id] = e.size
        elif e.action == "free" and e.id in size:
            live_total -= size.pop(e.id)
    live_ids = set(size)
    rows = []
    freed_later: set[int] = set()
    for _, ops in steps:
        freed_later.update(e.id for e in ops if e.action == "free")
    for index, ((seq, ops), kind) in enumerate(zip(steps, classify([s for s, _ in steps]))):
        alloc_at: dict[int, int] = {}
        free_at: dict[int, int] = {}
        # the boundary: the peak of the tensors the step allocates *and frees* (a tensor it hands
        # on, e.g. MindSpore's weight gradients freed by the next step, would move the peak to the
        # end of the backward when the weights outweigh the activations)
        allocated = {e.id for e in ops if e.action == "alloc"}
        inner = {e.id for e in ops if e.action == "free" and e.id in allocated}
        live_step = peak_step = live_inner = peak_inner = 0
        peak_at = 0
        peak_total = live_total
        for pos, e in enumerate(ops):
            if e.action == "alloc":
                size[e.id] = e.size
                alloc_at[e.id] = pos
                live_ids.add(e.id)
                live_step += e.size
                live_total += e.size
                peak_step = max(peak_step, live_step)
                if e.id in inner:
                    live_inner += e.size
                    if live_inner > peak_inner:
                        peak_inner, peak_at = live_inner, pos
                peak_total = max(peak_total, live_total)
            elif e.id in live_ids:
                live_ids.discard(e.id)
                live_total -= size[e.id]
                if e.id in alloc_at:
                    live_step -= size[e.id]
                    live_inner -= size[e.id]
                    free_at[e.id] = pos
        saved = [i for i in free_at if alloc_at[i] <= peak_at < free_at[i]]
        forward = [i for i in free_at if free_at[i] <= peak_at]
        backward = [i for i in free_at if alloc_at[i] > peak_at]
        transient = set(forward) | set(backward)
        live_t = peak_t = 0
        for pos, e in enumerate(ops):
            if e.id in transient:
                live_t += size[e.id] if e.action == "alloc" else -size[e.id]
                peak_t = max(peak_t, live_t)
        rows.append((index, kind, seq, ops, alloc_at, free_at, peak_step, peak_total, peak_at, saved, forward,
                     backward, peak_t))
    out = []
    for index, kind, seq, ops, alloc_at, free_at, peak_step, peak_total, peak_at, saved, fwd, bwd, peak_t in rows:
        kept = [i for i in alloc_at if i not in free_at and i not in freed_later]
        out.append(StepFigures(
            kind=kind, seq=seq, allocs=len(alloc_at), alloc_bytes=sum(size[i] for i in alloc_at),
            peak_in_step=peak_step, peak_total=peak_total, peak_at=peak_at, ops=len(ops),
            saved_allocs=len(saved), saved_bytes=sum(size[i] for i in saved),
            forward_bytes=sum(size[i] for i in fwd), backward_bytes=sum(size[i] for i in bwd),
            transient_peak=peak_t, kept_allocs=len(kept), kept_bytes=sum(size[i] for i in kept),
            saved_sizes=sorted((size[i] for i in saved), reverse=True),
            forward_sizes=sorted((size[i] for i in fwd), reverse=True)))
    return out


def prologue_bytes(prologue: Sequence[Event]) -> int:
    """Bytes the prologue leaves live."""
    size: dict[int, int] = {}
    for e in prologue:
        if e.action == "alloc":
            size[e.id] = e.size
        elif e.action == "free":
            size.pop(e.id, None)
    return sum(size.values())


def per_layer(few: float, many: float, layers_few: int, layers_many: int) -> float:
    """The per-layer share of a figure measured on two models that differ only in layer count.

    Example:
        >>> per_layer(1000, 1800, 2, 4)
        400.0
    """
    if layers_many == layers_few:
        raise ValueError("the two models must differ in layers")
    return (many - few) / (layers_many - layers_few)


def layer_sizes(few: Sequence[int], many: Sequence[int], layers_few: int, layers_many: int) -> list[int]:
    """One layer's tensor sizes, largest first: the sizes the deeper model has more of, each
    count divided by the layer difference (the multiset difference of two models that differ only
    in layers; sizes the difference does not divide evenly are dropped).

    Example:
        >>> layer_sizes([8, 4, 4, 1], [8, 8, 8, 4, 4, 4, 4, 1], 1, 3)
        [8, 4]
    """
    from collections import Counter
    diff = Counter(many)
    diff.subtract(Counter(few))
    step = layers_many - layers_few
    out = []
    for size, count in diff.items():
        if count > 0 and count % step == 0:
            out += [size] * (count // step)
    return sorted(out, reverse=True)


def shares(sizes: Sequence[int], top: int = 4) -> list[float]:
    """The ``top`` largest sizes as shares of the sum of all (rounded to 0.01).

    Example:
        >>> shares([50, 30, 20], top=2)
        [0.5, 0.3]
    """
    total = sum(sizes) or 1
    return [round(x / total, 2) for x in sorted(sizes, reverse=True)[:top]]


def pick(figures: Sequence[StepFigures], kind: str, seq: int | None = None) -> StepFigures:
    """The first step of class ``kind`` (and length ``seq``)."""
    return next(f for f in figures if f.kind == kind and (seq is None or f.seq == seq))


# --- the two workloads ------------------------------------------------------------------------
def model_recipe(layers: int, hidden: int):
    """recipes/demo_cpu.yaml with ``layers`` layers and width ``hidden`` (FFN 176 x hidden/64)."""
    import yaml
    from ms_memopt.config.recipe import recipe_from_dict
    data = yaml.safe_load(RECIPE.read_text())
    mc = data["model"]["model_config"]
    mc["num_layers"] = layers
    mc["intermediate_size"] = mc["intermediate_size"] * hidden // mc["hidden_size"]
    mc["hidden_size"] = hidden
    return recipe_from_dict(data, source=f"{RECIPE.name} ({layers} layers, hidden {hidden})")


def synthetic_run(recipe, lengths: Sequence[int], seed: int = 0) -> tuple[list[Event], list[tuple[int, list[Event]]]]:
    """StepWorkload(spec_from_recipe(recipe)) with step ``i``'s one micro-batch at ``lengths[i]``."""
    from ms_memopt.workload.step import StepWorkload
    from ms_memopt.simulation.spec import spec_from_recipe
    spec = spec_from_recipe(recipe)
    gen = StepWorkload(spec, seed)
    prologue = gen.prologue()
    steps = []
    for number, n in enumerate(lengths, 1):
        # the length rules give exactly n: "fixed" is seq_max, and n is a multiple of seq_align
        gen.spec = replace(spec, dynamic_seq=True, seq_distribution="fixed", seq_min=n, seq_max=n)
        steps.append((n, [e for e in gen.step(number) if e.action in ("alloc", "free")]))
    return prologue, steps


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = HASH_SEED      # MindSpore frees a few tensors in Python's set order
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _record(out: Path, layers: int, hidden: int, seqs: Sequence[int], max_len: int) -> None:
    if REUSE and out.exists():
        return
    cmd = [sys.executable, "-m", "ms_memopt", "record", "--no-progress", "--out", str(out), "--",
           "python", str(Path(__file__).resolve()), "--train", "--layers", str(layers), "--hidden", str(hidden),
           "--seqs", ",".join(map(str, seqs)), "--max-len", str(max_len)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=_REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def calibration_runs() -> list[list[int]]:
    """The three calibration runs' lengths (as bench/template_fidelity.py's)."""
    runs = []
    for r, pattern in enumerate(PATTERNS):
        order = list(CALIB[r % len(CALIB):]) + list(CALIB[:r % len(CALIB)])
        runs.append([order[ord(ch) - ord("a")] for ch in pattern])
    return runs


def measure_model(layers: int, hidden: int, work: Path, shapes: Sequence[int]) -> dict:
    """Record, learn, and measure one model both ways."""
    from ms_memopt.core.events import read_jsonl
    from ms_memopt.templates.template import generate, learn_files
    name = f"{layers}x{hidden}"
    max_len = max(max(CALIB), max(shapes))
    start = time.perf_counter()
    recs = []
    for r, seqs in enumerate(calibration_runs()):
        path = work / f"{name}_calib{r}.jsonl"
        _record(path, layers, hidden, seqs, max_len)
        recs.append(path)
    shapes_path = work / f"{name}_shapes.jsonl"
    _record(shapes_path, layers, hidden, shapes, max_len)
    record_s = time.perf_counter() - start
    template = learn_files(recs)
    schedule = [{"seq": n, "batch": 4} for n in (*SCHEDULE, *TAIL)]
    n_pro = len(generate(template, []))
    real_pro, real_steps = split_marked(generate(template, schedule), prologue_events=n_pro)
    real = step_figures(real_pro, real_steps)[:len(SCHEDULE)]
    recipe = model_recipe(layers, hidden)
    syn_pro, syn_steps = synthetic_run(recipe, (*SCHEDULE, *TAIL))
    syn = step_figures(syn_pro, syn_steps)[:len(SCHEDULE)]
    # the shapes run, straight from the recording: what each new shape keeps, and whether it stays
    sh_pro, sh_steps = split_marked(read_jsonl(shapes_path).events)
    sh = step_figures(sh_pro, sh_steps)
    from ms_memopt.simulation.spec import spec_from_recipe
    spec = spec_from_recipe(recipe)
    return {"model": name, "layers": layers, "hidden": hidden, "ffn": recipe.model.intermediate_size,
            "record_seconds": round(record_s, 1),
            "template_positions": template.positions, "template_exact": template.exact,
            "real": [asdict(f) for f in real], "synthetic": [asdict(f) for f in syn],
            "real_prologue_bytes": prologue_bytes(real_pro), "synthetic_prologue_bytes": prologue_bytes(syn_pro),
            "shapes_run": [{"seq": f.seq, "kind": f.kind, "kept_allocs": f.kept_allocs, "kept_bytes": f.kept_bytes}
                           for f in sh],
            "spec": {k: spec.to_dict()[k] for k in ("activation_bytes", "workspace_bytes", "param_bytes", "grad_bytes",
                                                     "optimizer_bytes", "cache_bytes_per_shape", "cache_tensors",
                                                     "seq_length")}}


# --- the table ----------------------------------------------------------------------------------
def _rows(m: dict) -> list[tuple[str, float, float]]:
    """(figure, real, synthetic) of one model; the repeat step at 32 unless said."""
    out = []
    for side in ("real", "synthetic"):
        m[side + "_fig"] = [StepFigures(**f) for f in m[side]]
    r, s = m["real_fig"], m["synthetic_fig"]
    for kind in ("first", "new_shape", "repeat"):
        out.append((f"allocations, {kind} step", pick(r, kind).allocs, pick(s, kind).allocs))
    rp, sp = pick(r, "repeat", 32), pick(s, "repeat", 32)
    out += [("peak in step (repeat, 32), KiB", rp.peak_in_step / 1024, sp.peak_in_step / 1024),
            ("peak across steps, KiB", max(f.peak_total for f in r) / 1024, max(f.peak_total for f in s) / 1024),
            ("saved (spans the boundary), KiB", rp.saved_bytes / 1024, sp.saved_bytes / 1024),
            ("forward transients, KiB", rp.forward_bytes / 1024, sp.forward_bytes / 1024),
            ("backward transients, KiB", rp.backward_bytes / 1024, sp.backward_bytes / 1024),
            ("transient peak, KiB", rp.transient_peak / 1024, sp.transient_peak / 1024)]
    for kind in ("new_shape", "repeat"):
        rk, sk = pick(r, kind), pick(s, kind)
        out.append((f"kept by a {kind} step, B (allocs)", f"{rk.kept_bytes} ({rk.kept_allocs})",
                    f"{sk.kept_bytes} ({sk.kept_allocs})"))
    rf, sf = pick(r, "first"), pick(s, "first")
    out.append(("persistent (prologue + first step kept), KiB",
                (m["real_prologue_bytes"] + rf.kept_bytes) / 1024, (m["synthetic_prologue_bytes"] + sf.kept_bytes) / 1024))
    return out


def layer_figures(few: dict, many: dict) -> dict:
    """Per-layer figures (differences of two models of the same width), real and synthetic, per length."""
    out = {"models": [few["model"], many["model"]]}
    lf, lm = few["layers"], many["layers"]
    for side in ("real", "synthetic"):
        a = [StepFigures(**f) for f in few[side]]
        b = [StepFigures(**f) for f in many[side]]
        rows = {}
        for n in CALIB:
            fa = next(f for f in a if f.seq == n and f.kind != "first")
            fb = next(f for f in b if f.seq == n and f.kind != "first")
            rows[n] = {"saved": per_layer(fa.saved_bytes, fb.saved_bytes, lf, lm),
                       "saved_allocs": per_layer(fa.saved_allocs, fb.saved_allocs, lf, lm),
                       "forward": per_layer(fa.forward_bytes, fb.forward_bytes, lf, lm),
                       "backward": per_layer(fa.backward_bytes, fb.backward_bytes, lf, lm),
                       "allocs": per_layer(fa.allocs, fb.allocs, lf, lm)}
            saved = layer_sizes(fa.saved_sizes, fb.saved_sizes, lf, lm)
            fwd = layer_sizes(fa.forward_sizes, fb.forward_sizes, lf, lm)
            # by sizes: robust to a tensor live at the peak whose size depends on the layer count
            # (StepWorkload's weight gradient, param_bytes / layers, embeddings included)
            rows[n].update(saved_by_sizes=sum(saved), saved_tensors=len(saved), saved_shares=shares(saved),
                           forward_tensors=len(fwd), forward_largest=fwd[:3], forward_shares=shares(fwd, 3))
        out[side] = rows
    return out


def _fmt(v) -> str:
    return f"{v:,.1f}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="2x64,4x64,2x128,4x128", help="LAYERSxHIDDEN, comma-separated")
    ap.add_argument("--shapes", default="8,12,16,20,24,28,32,36,40,44,48,52,56,60,64",
                    help="the shapes run: one step per length, each new")
    ap.add_argument("--keep", default=None, help="directory for recordings (default: a temporary one)")
    ap.add_argument("--train", action="store_true", help=argparse.SUPPRESS)   # the recorded process
    ap.add_argument("--layers", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--seqs", default="", help=argparse.SUPPRESS)
    ap.add_argument("--max-len", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--reuse", action="store_true", help="with --keep: use the recordings already there")
    args = ap.parse_args()
    global REUSE
    REUSE = args.reuse
    if args.train:
        _train(args.layers, args.hidden, [int(s) for s in args.seqs.split(",")], args.max_len)
        return
    shapes = [int(s) for s in args.shapes.split(",")]
    models = [tuple(int(x) for x in m.split("x")) for m in args.models.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = [measure_model(layers, hidden, work, shapes) for layers, hidden in models]
    by_hidden: dict[int, list[dict]] = {}
    for m in results:
        by_hidden.setdefault(m["hidden"], []).append(m)
    layers_out = []
    for group in by_hidden.values():
        group.sort(key=lambda m: m["layers"])
        if len(group) >= 2 and group[0]["layers"] != group[-1]["layers"]:
            layers_out.append(layer_figures(group[0], group[-1]))
    for m in results:
        print(f"\n{m['model']} (layers x hidden, FFN {m['ffn']}; template {m['template_exact']}/"
              f"{m['template_positions']} exact; recorded in {m['record_seconds']} s)")
        print(f"  {'figure':<46} {'template (real)':>16} {'StepWorkload':>16}")
        for name, real, syn in _rows(m):
            print(f"  {name:<46} {_fmt(real):>16} {_fmt(syn):>16}")
        kept = [s for s in m["shapes_run"][:-1] if s["kind"] != "first"]   # the last: freed by a next step
        rep = pick(m["real_fig"], "repeat")
        print(f"  shapes run: {len(kept)} new shapes keep {sorted({s['kept_bytes'] for s in kept})} B "
              f"in {sorted({s['kept_allocs'] for s in kept})} allocs each (a repeat step keeps {rep.kept_bytes} B "
              f"in {rep.kept_allocs}: per shape {sorted({s['kept_bytes'] - rep.kept_bytes for s in kept})} B in "
              f"{sorted({s['kept_allocs'] - rep.kept_allocs for s in kept})}); none evicted in "
              f"{len(kept)} shapes")
    for lay in layers_out:
        print(f"\nper layer, ({lay['models'][1]} - {lay['models'][0]}) / layers, bytes (repeat or new-shape step)")
        print(f"  {'seq':>4} {'saved real':>11} {'saved syn':>11} {'by sizes r':>11} {'by sizes s':>11} {'fwd real':>10} {'fwd syn':>10} "
              f"{'bwd real':>10} {'bwd syn':>10} {'allocs real':>11} {'allocs syn':>10}")
        for n in CALIB:
            r, s = lay["real"][n], lay["synthetic"][n]
            print(f"  {n:>4} {r['saved']:>11,.0f} {s['saved']:>11,.0f} {r['saved_by_sizes']:>11,} "
                  f"{s['saved_by_sizes']:>11,} {r['forward']:>10,.0f} {s['forward']:>10,.0f} "
                  f"{r['backward']:>10,.0f} {s['backward']:>10,.0f} {r['allocs']:>11,.1f} {s['allocs']:>10,.1f}")
        for n in CALIB:
            r, s = lay["real"][n], lay["synthetic"][n]
            print(f"  seq {n}: saved tensors per layer real {r['saved_tensors']} (largest shares {r['saved_shares']}), "
                  f"synthetic {s['saved_tensors']} ({s['saved_shares']}); forward transients real "
                  f"{r['forward_tensors']} (largest {r['forward_largest']}), synthetic {s['forward_tensors']} "
                  f"({s['forward_largest']})")
    for m in results:
        for side in ("real_fig", "synthetic_fig"):
            m.pop(side, None)
    print(json.dumps({"bench": "workload_vs_template", "hash_seed": HASH_SEED, "calibration": list(CALIB),
                      "patterns": list(PATTERNS), "schedule": list(SCHEDULE), "results": results,
                      "per_layer": layers_out}))


# --- the recorded process -----------------------------------------------------------------------
def _train(layers: int, hidden: int, seqs: list[int], max_len: int) -> None:
    """Train the recipe's GPT (as ms-memopt run builds it) one step per length, marking each step."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn
    from ms_memopt.mindspore import mark_step
    from ms_memopt.mindspore.model import GPT, GPTWithLoss
    from ms_memopt.mindspore.standalone import gpt_config_from_recipe
    recipe = model_recipe(layers, hidden)
    cfg, _ = gpt_config_from_recipe(recipe, "CPU")
    cfg = replace(cfg, seq_length=max_len)        # the position table and mask must hold every length
    ms.set_seed(0)
    ms.runtime.launch_blocking()
    net = GPTWithLoss(GPT(cfg))
    train = nn.TrainOneStepCell(net, nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3))
    train.set_train(True)
    rng = np.random.default_rng(1)
    batch = recipe.train.batch_size
    mark_step()                                   # the setup ends here
    for seq in seqs:
        tokens = rng.integers(0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
        train(Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]))
        mark_step(seq=seq, batch=batch)


if __name__ == "__main__":
    main()

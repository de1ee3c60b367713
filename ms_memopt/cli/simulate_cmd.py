"""``ms-memopt simulate RECIPE``: many training steps of one card under memory policies.

Prints one line per policy (or, with ``--json``, one JSON object: per policy the figures of
:class:`ms_memopt.simulate.PolicyResult`; with ``--seeds N``, each policy holds ``seeds`` and
``median_oom_step``). ``--out DIR`` receives ``timeline.jsonl`` (streamed while running),
``layouts.jsonl`` (the first seed's pool at each policy's OOM, or at its worst moment when it
survives) and ``report.md`` with ``fragmentation.png`` and ``memory_map.png``. ``--export-memory-viz FILE.pickle`` writes the first seed's simulated
events with the model's addresses and its final layout in PyTorch's memory snapshot format
(pytorch.org/memory_viz): with one policy to ``FILE.pickle``, with several one file per policy,
``FILE.<policy>.pickle``. Exit code 0, or 1 with ``--fail-on-oom`` when a policy OOMs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import InputError
from ..units import format_size

__all__ = ["add_parser", "run"]


def add_parser(parser) -> None:
    parser.add_argument("recipe", help="recipe YAML (MindFormers keys + memopt section)")
    parser.add_argument("--steps", type=int, default=None, help="steps to simulate (default: memopt.workload.steps)")
    parser.add_argument("--policy", default="baseline,compact,pool",
                        help="comma-separated policies: baseline, compact, pool")
    parser.add_argument("--allocator", default=None, help="allocator model (default: memopt.allocator.name)")
    parser.add_argument("--allocator-option", action="append", default=[], metavar="KEY=VALUE",
                        help="allocator model option, e.g. pregrow=true or increase_size=8GiB (repeatable)")
    parser.add_argument("--seeds", type=int, default=None, help="run seeds 0..N-1 and report the median")
    parser.add_argument("--seed", type=int, default=None, help="the one seed (default: memopt.workload.seed)")
    parser.add_argument("--out", default=None, help="directory for timeline.jsonl and plots")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--export-memory-viz", default=None, metavar="FILE.pickle",
                        help="write the first seed's events (model addresses) and final layout as a PyTorch "
                             "memory snapshot for pytorch.org/memory_viz; several policies: FILE.<policy>.pickle")
    parser.add_argument("--fail-on-oom", action="store_true", help="exit 1 when a policy OOMs")


def run(args) -> int:
    from ..recipe import load_recipe
    from ..simulate import POLICIES, PlacedRun, config_from_recipe, simulate
    from ..workload import spec_from_recipe

    policies = tuple(p.strip() for p in args.policy.split(",") if p.strip())
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise InputError(f"unknown policy {', '.join(bad) or '(none)'}; expected some of {', '.join(POLICIES)}",
                         key="--policy")
    if args.steps is not None and args.steps < 1:
        raise InputError(f"expected a positive number of steps, got {args.steps}", key="--steps")
    if args.seeds is not None and args.seeds < 1:
        raise InputError(f"expected a positive number of seeds, got {args.seeds}", key="--seeds")
    recipe = load_recipe(args.recipe)
    spec = spec_from_recipe(recipe)
    cfg = config_from_recipe(recipe, steps=args.steps, allocator=args.allocator, seed=args.seed)
    from ..allocators import MODELS
    if cfg.allocator not in MODELS:
        raise InputError(f"unknown allocator {cfg.allocator!r}; expected one of {', '.join(MODELS)}",
                         key="--allocator")
    if args.allocator and args.allocator != recipe.memopt.allocator.name:
        cfg.allocator_options = {}
    cfg.allocator_options.update(_options(args.allocator_option))
    seeds = list(range(args.seeds)) if args.seeds else [cfg.seed]
    viz_paths = _viz_paths(args.export_memory_viz, policies) if args.export_memory_viz else {}
    placed = {policy: PlacedRun() for policy in viz_paths}
    collector = None

    out_dir = Path(args.out) if args.out else None
    timeline = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        timeline = open(out_dir / "timeline.jsonl", "w", encoding="utf-8")
        from ..memory_map import LayoutCollector

        collector = LayoutCollector([], policies=policies, seed=seeds[0])
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps * len(seeds) * len(policies), unit="step", desc="simulate", leave=False)
    try:
        results = simulate(spec, cfg, policies=policies, seeds=seeds, timeline=timeline,
                           on_step=_progress(bar, len(policies)) if bar is not None else None,
                           placed=placed or None, on_watch=collector)
    finally:
        if timeline is not None:
            timeline.close()
        if bar is not None:
            bar.close()
    if out_dir is not None:
        from ..report import build_report, write_layouts

        write_layouts(out_dir / "layouts.jsonl", collector.snapshots())
        build_report(out_dir, title=f"Simulation of {Path(args.recipe).name}",
                     memory_map_title=f"{Path(args.recipe).name}: the pool at each policy's OOM, or its worst moment")

    if viz_paths:
        from ..traces.memory_viz import write_memory_viz
        for policy, path in viz_paths.items():
            write_memory_viz(path, placed[policy].events, placed[policy].final)
            print(f"memory viz ({policy}, seed {seeds[0]}): {path}", file=sys.stderr)

    if args.json:
        out = {"recipe": str(args.recipe), "steps": cfg.steps, "allocator": cfg.allocator,
               "allocator_options": cfg.allocator_options, "capacity": cfg.capacity,
               "scan_every": cfg.scan_every, "compact_every": cfg.compact_every, "policies": {}}
        for policy, summary in results.items():
            if args.seeds:
                out["policies"][policy] = summary.to_dict()
            else:
                out["policies"][policy] = summary.seeds[0].to_dict()
        print(json.dumps(out))
    else:
        _print_table(results, cfg, bool(args.seeds))
    any_oom = any(r.oom_step is not None for s in results.values() for r in s.seeds)
    return 1 if (args.fail_on_oom and any_oom) else 0


def _viz_paths(path: str, policies: tuple[str, ...]) -> dict[str, Path]:
    """Policy -> snapshot file: ``path`` itself for one policy, ``stem.<policy>.suffix`` for several."""
    path = Path(path)
    if len(policies) == 1:
        return {policies[0]: path}
    suffix = path.suffix or ".pickle"
    return {policy: path.with_name(f"{path.stem if path.suffix else path.name}.{policy}{suffix}")
            for policy in policies}


def _progress(bar, per_step: int):
    """``on_step`` for :func:`~ms_memopt.simulate.simulate`: the policies of a seed run in lock
    step, so one step advances the bar by the number of policies."""
    last = {"step": 0}

    def on_step(step: int) -> None:
        if step < last["step"]:      # a new seed started
            last["step"] = 0
        bar.update((step - last["step"]) * per_step)
        last["step"] = step

    return on_step


def _options(items: list[str]) -> dict:
    """``KEY=VALUE`` pairs: booleans, sizes (``8GiB``) or integers."""
    from ..units import parse_size

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"expected KEY=VALUE, got {item!r}", key="--allocator-option")
        low = value.strip().lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        else:
            out[key] = parse_size(value, key="--allocator-option")
    return out


def _print_table(results, cfg, many: bool) -> None:
    print(f"{cfg.steps} steps, allocator {cfg.allocator} {cfg.allocator_options or ''}, "
          f"capacity {format_size(cfg.capacity)}, scan every {cfg.scan_every}, compact every {cfg.compact_every}")
    header = f"{'policy':<9} {'seed':>4} {'oom_step':>8} {'oom_kind':<13} {'free@oom':>10} {'lf_min':>10} " \
             f"{'frag_max':>8} {'compactions':>11} {'frag_after':>10} {'peak':>10}"
    print(header)
    for policy, summary in results.items():
        for r in summary.seeds:
            frag_after = "-" if r.frag_after_compaction is None else f"{r.frag_after_compaction:.2f}"
            frag_max = "-" if r.frag_ratio_max is None else f"{r.frag_ratio_max:.2f}"
            print(f"{policy:<9} {r.seed:>4} {r.oom_step or '-'!s:>8} {(r.oom_kind or '-'):<13} "
                  f"{format_size(r.free_total_at_oom):>10} {format_size(r.largest_free_min):>10} "
                  f"{frag_max:>8} {r.compactions:>11} {frag_after:>10} {format_size(r.peak_allocated):>10}")
        if many:
            print(f"{policy:<9} median oom_step: {summary.median_oom_step}")

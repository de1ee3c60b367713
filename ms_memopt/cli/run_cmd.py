"""``ms-memopt run RECIPE``: standalone training on one device, with scans, compaction, report.

Trains the model the recipe describes (see :mod:`ms_memopt.mindspore.standalone`) and writes
logs, checkpoints and ``report.md`` with its figures into ``--out``. Before importing MindSpore
it checks that the job can fit: on CPU the whole model, its gradients, Adam states and one
batch of activations live in host memory; a job whose estimate exceeds the available host
memory is refused with exit code 2 (a 70B MindFormers config on a workstation, say).

Exit codes: 0 ok; 2 bad input or a job that cannot fit.

Example:
    ms-memopt run recipes/demo_cpu.yaml --out out/run
    ms-memopt run recipes/demo_cpu.yaml --out out/run --steps 60 --resume
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ms_memopt.analysis.estimate import estimate
from ms_memopt.config.recipe import DTYPE_BYTES, CommunicationConfig, ParallelConfig, Recipe, RecomputeConfig, load_recipe
from ms_memopt.core.errors import InputError
from ms_memopt.core.units import format_size

__all__ = ["add_parser", "run", "HostMemoryCheck", "host_memory_check", "available_host_memory",
           "FRAMEWORK_OVERHEAD"]

#: host memory MindSpore itself takes on CPU (import, kernels, graph caches), bytes; measured
#: as ~1 GiB RSS for the demo model, rounded up
FRAMEWORK_OVERHEAD = 2 * 2**30


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (a MindFormers config, optionally with a memopt: section)")
    parser.add_argument("--out", default="out/run", help="output directory (default: out/run)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "ascend"),
                        help="auto: an Ascend card when MindSpore can use one, else the CPU")
    parser.add_argument("--steps", type=_positive, help="total steps (default: memopt.train.steps)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    parser.add_argument("--export-memory-viz", metavar="FILE.pickle",
                        help="also write the scanned layout in PyTorch's memory snapshot format")
    parser.add_argument("--no-pool-log", action="store_true",
                        help="on CPU, scan the shadow model instead of the real pool (whose log, "
                             "OUT/pool.log, is followed live by default)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-report", action="store_true", help="skip report.md and its figures")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


@dataclass(frozen=True)
class HostMemoryCheck:
    """Whether the job fits in host memory; bytes. ``available`` None: unknown (not refused)."""
    needed: int
    available: int | None
    regions: dict

    @property
    def fits(self) -> bool:
        return self.available is None or self.needed <= self.available


def available_host_memory() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes (None where there is no /proc)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _one_device_recipe(recipe: Recipe, *, cpu: bool) -> Recipe:
    """The recipe as one device trains it: no parallelism, no communication buffers, the
    standalone batch size; on CPU bfloat16 runs as float32 (as the job does)."""
    model = recipe.model
    mem = recipe.memopt
    if cpu:
        fix = {k: "float32" for k in ("compute_dtype", "param_init_type")
               if getattr(model, k) == "bfloat16"}
        model = dataclasses.replace(model, offset=(), **fix)
        dtype = model.param_init_type
        mem = dataclasses.replace(mem, grad_dtype=dtype if DTYPE_BYTES[dtype] == 4 else mem.grad_dtype,
                                  workspace=0)
    else:
        model = dataclasses.replace(model, offset=())
    mem = dataclasses.replace(mem, zero_stage=0, params=None,
                              communication=CommunicationConfig(0, 0, 0, 0))
    recompute = recipe.recompute
    flat = {f.name: (any(v) if isinstance(v, tuple) else v)
            for f in dataclasses.fields(recompute) for v in [getattr(recompute, f.name)]}
    train = dataclasses.replace(recipe.train, batch_size=mem.train.batch_size)
    return dataclasses.replace(recipe, model=model, parallel=ParallelConfig(), train=train, memopt=mem,
                               recompute=RecomputeConfig(**flat))


def host_memory_check(recipe: Recipe, available: int | None = None) -> HostMemoryCheck:
    """Estimate the CPU job's host memory (the whole model on one device) against ``available``.

    ``available`` defaults to :func:`available_host_memory`.

    Example:
        >>> from ms_memopt.config.recipe import load_recipe
        >>> host_memory_check(load_recipe("recipes/demo_cpu.yaml"), available=8 * 2**30).fits  # doctest: +SKIP
        True
    """
    one = _one_device_recipe(recipe, cpu=True)
    est = estimate(one)
    regions = dict(est.regions)
    regions["framework"] = FRAMEWORK_OVERHEAD
    if available is None:
        available = available_host_memory()
    return HostMemoryCheck(needed=sum(regions.values()), available=available, regions=regions)


def _refuse(recipe: Recipe, check: HostMemoryCheck) -> InputError:
    parts = ", ".join(f"{name} {format_size(size)}" for name, size in check.regions.items() if size)
    return InputError(
        f"this model cannot train on this CPU: it needs about {format_size(check.needed)} of host memory "
        f"({parts}), {format_size(check.available)} is available. The run trains the model the recipe "
        f"describes, it does not shrink it: use a smaller recipe (e.g. recipes/demo_cpu.yaml) or an "
        f"Ascend device (--device ascend); --steps N only shortens a run that fits",
        source=recipe.source)


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    if args.export_memory_viz is not None and not str(args.export_memory_viz).endswith(".pickle"):
        raise InputError(f"got {args.export_memory_viz!r}; expected a FILE.pickle", key="--export-memory-viz")
    if args.device != "ascend":
        check = host_memory_check(recipe)
        on_cpu = args.device == "cpu" or not _ascend_possible()
        if on_cpu and not check.fits:
            raise _refuse(recipe, check)

    if not args.no_pool_log and (args.device == "cpu" or (args.device == "auto" and not _ascend_possible())):
        from ms_memopt.mindspore import poolcapture
        poolcapture.start(Path(args.out) / poolcapture.LOG_NAME)   # before MindSpore is imported
    from ms_memopt.mindspore.standalone import run_standalone   # imports MindSpore (seconds)

    result = run_standalone(recipe, args.out, device=args.device, steps=args.steps, resume=args.resume,
                            progress=not args.no_progress and not args.json)
    out = Path(args.out)
    summary = result.to_dict()
    if args.export_memory_viz:
        summary["memory_viz"] = _export_memory_viz(out, args.export_memory_viz, result)
    if not args.no_report:
        from ms_memopt.report.build import build_report

        summary["report"] = str(build_report(out, title=f"ms-memopt run {Path(recipe.source).name}"))
    if args.json:
        summary.pop("step_seconds", None)
        print(json.dumps(summary))
    else:
        _print_summary(result, summary)
    return 0


def _ascend_possible() -> bool:
    return bool(os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
                or Path("/usr/local/Ascend").exists())


def _export_memory_viz(out: Path, path: str, result) -> str:
    """The last scanned layout (and its live blocks as allocations) as a memory_viz pickle."""
    from ms_memopt.io.layouts import read_layouts
    layouts = read_layouts(out)
    if not layouts:
        result.notes.append("--export-memory-viz: not written, no layout was scanned")
        return "not written: no layout"
    from ms_memopt.core.events import Event
    from ms_memopt.io.traces.memory_viz import write_memory_viz

    step, layout = layouts[-1].step, layouts[-1].layout
    events = [Event("alloc", id=i, size=b.size, addr=b.addr, step=step, tag=b.tag)
              for i, b in enumerate(b for s in layout.segments for b in s.blocks if b.live)]
    write_memory_viz(path, events, layout)
    return str(path)


def _print_summary(result, summary: dict) -> None:
    losses = result.losses
    print(f"device {result.device}; optimizer {result.optimizer}; pool mode {'on' if result.pool_mode else 'off'}")
    if result.pool:
        print(f"memory pool: {result.pool['kind']} ({result.pool['mode']}"
              f"{', SOMAS' if result.pool['somas'] else ''}): {result.pool['explain']}")
    if losses:
        first, last = losses[0], losses[-1]
        med = sorted(result.step_seconds)[len(result.step_seconds) // 2]
        print(f"steps {result.start_step}..{result.start_step + len(losses) - 1} of {result.steps}: "
              f"loss {first:.4f} -> {last:.4f}; median step {med * 1000:.0f} ms; total {result.seconds:.1f} s")
    print(f"scans {result.scans}; compactions {result.compactions}; checkpoints {len(result.checkpoints)}")
    for note in result.notes:
        print(f"note: {note}")
    for key in ("memory_viz", "report"):
        if key in summary:
            print(f"{key}: {summary[key]}")

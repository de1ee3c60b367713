"""``ms-memopt plan RECIPE``: per-card memory by region, fit against HBM, checkpoint interval.

Exit codes: 0 ok; 1 with ``--fail-on-oom`` when the worst stage does not fit; 2 bad input.

Example:
    ms-memopt plan recipes/dense_100b_1024x910c.yaml --per-stage
    ms-memopt plan pretrain_llama2_70b.yaml --json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from ms_memopt.analysis.estimate import NOTHING_FITS, REGIONS, Estimate, StageEstimate, estimate
from ms_memopt.config.recipe import Recipe, load_recipe
from ms_memopt.core.units import format_size, parse_size

__all__ = ["add_parser", "run"]


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (a MindFormers config, optionally with a memopt: section)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (sizes in bytes)")
    parser.add_argument("--per-stage", action="store_true", help="one column per pipeline stage")
    parser.add_argument("--capacity", help="override the per-card capacity, e.g. 64GiB")
    parser.add_argument("--fail-on-oom", action="store_true", help="exit 1 when the worst stage does not fit")


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    if args.capacity is not None:
        hbm = parse_size(args.capacity, source="--capacity", positive=True)
        device = dataclasses.replace(recipe.memopt.device, hbm=hbm)
        recipe = dataclasses.replace(recipe, memopt=dataclasses.replace(recipe.memopt, device=device))
    result = estimate(recipe)
    pool = pool_of(recipe)
    if args.json:
        print(json.dumps({**result.to_dict(per_stage=True), "pool": pool}, sort_keys=False))
    else:
        print(_table(result, per_stage=args.per_stage, shape=_shape(recipe)))
        print(f"pool: {pool['kind']} ({pool['basis']}): {pool['explain']}")
    if args.fail_on_oom and result.fits is False:
        return 1
    return 0


def pool_of(recipe: Recipe) -> dict:
    """Which pool the recipe's job runs on (``memopt.allocator.name``), and what that means:
    under VMM (``mindspore_vmm``, MindSpore 2.10's default on 910B/910_93 with a driver >= 24.0.0)
    holes do not decide OOMs; under the best-fit pool (``mindspore``: ``enable_vmm:False``,
    ``older_pool:True``, older drivers, 910A, the field report's stack) they do."""
    name = recipe.memopt.allocator.name
    vmm = name == "mindspore_vmm"
    basis = f"memopt.allocator.name: {name}"
    if vmm:
        explain = ("physical memory is mapped in 2 MiB pages on demand: holes do not decide OOMs; what must fit "
                   "is the total in use against the capacity")
    elif name == "mindspore":
        explain = ("best-fit blocks that never merge: a large request can fail with much memory free; on Ascend "
                   "this is the pool with MS_ALLOC_CONF=enable_vmm:False or older_pool:True, drivers older than "
                   "24.0.0 and 910A (with VMM, MindSpore 2.10's default on 910B/910_93, it would not fragment: "
                   "simulate with --allocator mindspore-vmm)")
    else:
        explain = "not a MindSpore pool model"
    return {"kind": name, "vmm": vmm, "holes_decide_ooms": not vmm, "basis": basis, "explain": explain}


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _row(label: str, cells: list[str], width: int) -> str:
    return f"{label:<26}" + "".join(f"{c:>{width}}" for c in cells)


def _shape(recipe: Recipe) -> str:
    """One line on what kind of model and layout this is (MoE, MLA, MTP, interleaving)."""
    model, par = recipe.model, recipe.parallel
    parts = [f"{model.num_layers} layers, h {model.hidden_size}, {model.num_heads} heads"
             f"{f' ({model.n_kv_heads} KV)' if model.n_kv_heads != model.num_heads and model.mla is None else ''}",
             f"s {model.seq_length}, V {model.vocab_size}"]
    if model.moe is not None:
        moe = model.moe
        parts.append(f"MoE {moe.num_experts} experts ({moe.num_experts // par.expert_parallel} per card, "
                     f"expert_parallel {par.expert_parallel}), top-{moe.top_k}"
                     + (f", {moe.shared_experts} shared" if moe.shared_experts else "")
                     + (f", first {moe.first_dense} dense" if moe.first_dense else ""))
    if model.mla is not None:
        parts.append("MLA")
    if model.mtp_layers:
        parts.append(f"{model.mtp_layers} MTP layer{'s' if model.mtp_layers > 1 else ''}")
    parts.append(f"d {par.data_parallel} x t {par.model_parallel} x p {par.pipeline_stage}"
                 + (f" x {model.pp_interleave_num} chunks" if model.pp_interleave_num > 1 else ""))
    return "; ".join(parts)


def _table(result: Estimate, *, per_stage: bool, shape: str = "") -> str:
    worst = result.worst
    stages: list[StageEstimate] = result.stages if per_stage else [worst]
    width = 12
    head = [f"stage {s.stage}" for s in stages]
    flight = f"{worst.in_flight} micro-batch{'es' if worst.in_flight != 1 else ''} in flight"
    lines = [f"recipe: {result.source}",
             f"model: {_count(result.model_params)} parameters; worst stage {worst.stage} "
             f"({worst.layers} layers, {flight}, {_count(worst.params)} parameters per card)"]
    if shape:
        lines.append(f"shape: {shape}")
    lines.append("")
    lines.append(_row("region", head, width))
    for name in REGIONS:
        lines.append(_row(name, [format_size(s.regions[name]) for s in stages], width))
        if name == "parameters":
            for dtype in worst.parameters_by_dtype:
                lines.append(_row(f"  {dtype}", [format_size(s.parameters_by_dtype.get(dtype, 0)) for s in stages], width))
        if name == "optimizer":
            for state in ("master", "m", "v"):
                lines.append(_row(f"  {state}", [format_size(s.optimizer_states[state]) for s in stages], width))
        if name == "communication":
            for kind, nbytes in worst.communication.items():
                if nbytes or any(s.communication[kind] for s in stages):
                    lines.append(_row(f"  {kind}", [format_size(s.communication[kind]) for s in stages], width))
    lines.append(_row("total", [format_size(s.total) for s in stages], width))
    lines.append("")
    if result.capacity is None:
        lines.append("capacity: unknown (set memopt.device.hbm or context.max_device_memory)")
    else:
        verdict = "fits" if result.fits else "DOES NOT FIT"
        lines.append(f"capacity: {format_size(result.capacity)} per card; worst stage {format_size(result.total)}: "
                     f"{verdict} (headroom {format_size(result.headroom)})")
    if result.checkpoint_every is not None:
        k = result.checkpoint_every
        lines.append(f"checkpoint_every: {k} recommended (the largest that fits: layers recomputed in groups of "
                     f"{k}; each micro-batch keeps one input per group, the backward regenerates {k} "
                     f"layer{'s' if k > 1 else ''} at a time)")
    elif result.capacity is not None:
        nothing = any(note.startswith(NOTHING_FITS) for note in result.notes)
        lines.append("checkpoint_every: none fits" if nothing
                     else "checkpoint_every: not needed (fits without checkpointing)")
    lines.extend(f"note: {note}" for note in result.notes)
    return "\n".join(lines)

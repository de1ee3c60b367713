"""What to set after a crash, per allocator family and per verdict, in the user's own terms.

``ms-memopt doctor`` on a crash log (:mod:`ms_memopt.doctor.crash_logs`) has no recording to
replay, so it cannot measure the settings; it names them, ranked for the report's framework and
verdict. The settings the replay doctor measures are named by their lines in
:data:`ms_memopt.doctor.remedies.SETTINGS` (one source for ``export PYTORCH_NPU_ALLOC_CONF=...``,
``MS_ALLOC_CONF``, ``set_memory``, compaction, pool mode); this table adds which of them fit a
verdict, why, and the advice no replay gives (recompute, the plan, other processes, a limit).

:func:`remedy_lines` returns ``(setting, line, why)`` entries, best first: ``line`` is what the
user writes, with ``{split_mb}``, ``{grow}``, ``{capacity}``, ``{capacity_gb}`` and ``{peak}`` filled
from the report by the caller.

Example:
    >>> [s for s, _, _ in remedy_lines("torch_npu", "fragmentation")][:2]
    ['expandable_segments:True', 'max_split_size_mb']
    >>> remedy_lines("pytorch", "fragmentation")[0][1]
    'export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True'
"""
from __future__ import annotations

from ms_memopt.doctor.remedies import SETTINGS

__all__ = ["FAMILIES", "REMEDIES", "RECORD", "remedy_lines", "family_of"]

#: framework name in a crash report -> allocator family (the keys of ``remedies.SETTINGS``)
FAMILIES = {"mindspore": "mindspore", "torch_npu": "torch_npu", "pytorch": "torch"}


def _replayed(family: str, name: str) -> str:
    """The line of the replayed setting ``name`` of ``family`` (``remedies.SETTINGS``, the one source of
    the lines; a setting renamed there fails at import, so the two tables cannot drift apart)."""
    for setting in SETTINGS.get(family, []):
        if setting.setting == name:
            return setting.line
    raise KeyError(f"remedies.SETTINGS[{family!r}] has no setting {name!r}")


def _torch_fragmentation(family: str) -> list[tuple[str, str, str]]:
    # max_split_size_mb's line is taken for 64 MiB and given the report's own value
    split = _replayed(family, "max_split_size_mb:64")
    expandable = _replayed(family, "expandable_segments:True")
    gc = _replayed(family, "garbage_collection_threshold:0.8")
    return [
        ("expandable_segments:True", expandable, "segments grow in place, so split pieces re-merge instead of staying cut"),
        ("max_split_size_mb", split.replace("max_split_size_mb:64", "max_split_size_mb:{split_mb}"),
         "large cached blocks are not cut for small requests"),
        ("garbage_collection_threshold", gc, "frees unused cached blocks before the pool is full"),
    ]


_MS_POOL_MODE = ("pool mode",
                 _replayed("mindspore", "pool mode"),
                 "parameters, activations and optimizer states in regions planned at start-up: no interleaving "
                 "of lifetimes, no holes (docs/pool_mode.md)")

REMEDIES: dict[tuple[str, str], list[tuple[str, str, str]]] = {
    ("mindspore", "fragmentation"): [
        ("enable_vmm:True", _replayed("mindspore", "enable_vmm:True"),
         "virtual memory: free 2 MiB pages anywhere on the card serve one request, so holes in "
         "different pool blocks add up (910B/910_93 with a recent driver; the default there)"),
        ("compaction", _replayed("mindspore", "compaction at the step ends"),
         "moves live tensors down after the optimizer step so the holes merge into one (docs/compaction.md)"),
        _MS_POOL_MODE,
        ("init_size", _replayed("mindspore", "init_size=capacity (pre-grown)").replace("{capacity_gb}", "{peak}"),
         "one pool block from the start instead of blocks grown one by one, whose holes never merge"),
        ("increase_size", _replayed("mindspore", "increase_size=2.00 GiB").replace('"2GB"', '"{grow}"'),
         "a growth unit at least the request: a new block can always hold it"),
    ],
    ("mindspore", "capacity"): [
        ("recompute", "recompute_config: {{recompute: True}}  # MindFormers YAML; or Cell.recompute()",
         "keeps only each layer's input for the backward pass"),
        ("plan", "ms-memopt plan RECIPE.yaml --capacity {capacity}",
         "per-card memory by region against the card; the checkpoint interval and parallel split that fit"),
        _MS_POOL_MODE,
    ],
    ("mindspore", "outside"): [
        ("max_device_memory", 'ms.set_context(max_device_memory="{capacity_gb}")  # or set_memory(max_size=...)',
         "MindSpore took only part of the card: raise its share"),
        ("other processes", "npu-smi info  # who else holds HBM on this card",
         "another process held device memory MindSpore needed"),
    ],
    ("torch", "fragmentation"): _torch_fragmentation("torch"),
    ("torch", "capacity"): [
        ("activation checkpointing", "torch.utils.checkpoint.checkpoint(block, x)  # per layer",
         "keeps only each layer's input"),
        ("plan", "ms-memopt plan RECIPE.yaml --capacity {capacity}",
         "per-card memory by region against the card"),
    ],
    ("torch", "outside"): [
        ("other processes", "nvidia-smi --query-compute-apps=pid,used_memory --format=csv",
         "another process (or this one outside PyTorch) held the memory"),
        ("memory fraction", "torch.cuda.set_per_process_memory_fraction(1.0)",
         "a fraction below 1 withheld the rest of the card"),
    ],
    ("torch_npu", "fragmentation"): _torch_fragmentation("torch_npu"),
    ("torch_npu", "capacity"): [
        ("activation checkpointing", "torch.utils.checkpoint.checkpoint(block, x)  # or MindSpeed's --recompute-*",
         "keeps only each layer's input"),
        ("plan", "ms-memopt plan RECIPE.yaml --capacity {capacity}",
         "per-card memory by region against the card"),
    ],
    ("torch_npu", "outside"): [
        ("other processes", "npu-smi info  # who else holds HBM on this card",
         "another process held the memory"),
        ("memory fraction", "torch_npu.npu.set_per_process_memory_fraction(1.0)",
         "a fraction below 1 withheld the rest of the card"),
    ],
}

#: the exact way to record the run for a full diagnosis next time (replayed by ``ms-memopt doctor``)
RECORD: dict[str, str] = {
    "mindspore": ("ms-memopt record --out run.jsonl -- python train.py ...   # VLOG_v=12906, the pool's every call; "
                  "then: ms-memopt doctor run.jsonl --capacity {capacity}"),
    "torch": ('torch.cuda.memory._record_memory_history(max_entries=1000000)  # at start; on '
              'torch.OutOfMemoryError: torch.cuda.memory._dump_snapshot("oom.pickle"); '
              "then: ms-memopt doctor oom.pickle --capacity {capacity}"),
    "torch_npu": ('torch_npu.npu.memory._record_memory_history()  # at start; on the OOM: '
                  'torch_npu.npu.memory._dump_snapshot("oom.pickle") (or torch_npu.profiler.profile('
                  "profile_memory=True)); then: ms-memopt doctor oom.pickle --capacity {capacity}"),
}


def family_of(framework: str) -> str:
    """The allocator family of a crash report's ``framework``."""
    return FAMILIES.get(framework, framework)


def remedy_lines(framework: str, kind: str) -> list[tuple[str, str, str]]:
    """The ``(setting, line, why)`` entries for ``framework`` and verdict ``kind``, best first;
    an undecidable verdict gets the fragmentation entries (the cheap ones) then the capacity ones."""
    family = family_of(framework)
    if kind == "undecidable":
        return REMEDIES.get((family, "fragmentation"), [])[:2] + REMEDIES.get((family, "capacity"), [])[:1]
    return list(REMEDIES.get((family, kind), []))

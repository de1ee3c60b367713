"""The MindSpore side of ms-memopt: the only package that imports mindspore.

Names are loaded lazily (importing mindspore takes seconds), so ``import ms_memopt.mindspore``
is cheap and a missing MindSpore only fails when a name is used. To export a new name, add
one line to ``_EXPORTS``: ``"Name": "module"`` (a module of this package).

Example:
    >>> from ms_memopt.mindspore import enable_pool_mode, FusedAdamW   # doctest: +SKIP
"""
from __future__ import annotations

import importlib

_EXPORTS: dict[str, str] = {
    "FusedAdamW": "fused_adamw",
    "FusedAdamWGraph": "fused_adamw",
    "enable_pool_mode": "pool_mode",
    "reserve_pool": "pool_mode",
    "activation_bytes": "pool_mode",
    "find_blocks": "pool_mode",
    "RecomputeGroup": "pool_mode",
    "GPT": "model",
    "GPTConfig": "model",
    "GPTBlock": "model",
    "GPTWithLoss": "model",
    "synthetic_dataset": "model",
    "synthetic_batches": "model",
    "LayoutScanCallback": "scan_callback",
    "Scanner": "scan_callback",
    "CompactionCallback": "compaction",
    "live_compact": "compaction",
    "register": "compaction",
    "StoreBarrier": "compaction",
    "BarrierTimeout": "compaction",
    "MindSporeArenaBackend": "compaction",
    "run_standalone": "standalone",
    "mark_step": "steps",
    "StepMarkCallback": "steps",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module_name}"), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

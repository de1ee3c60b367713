"""MindFormers integration: our callbacks in MindFormers' registry, the register folder.

Two ways to name ``LayoutScanCallback`` / ``CompactionCallback`` in a MindFormers YAML's
``callbacks:`` list (docs/mindformers.md):

* MindFormers' own entry point, unchanged: each entry carries
  ``auto_register: ms_memopt_mindformers.<Class>`` and ``run_mindformer.py`` gets
  ``--register_path`` :func:`register_path` (MindFormers then loads the class from that folder
  and registers it itself);
* your own launcher: call :func:`register_callbacks` once before ``Trainer(config)``.

Example:
    >>> from ms_memopt.mindspore.mindformers import register_callbacks, register_path   # doctest: +SKIP
    >>> register_callbacks()                                                             # doctest: +SKIP

Run ``python -m ms_memopt.mindspore.mindformers`` to print the register folder.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["register_callbacks", "register_path", "REGISTER_MODULE"]

#: the module MindFormers' ``auto_register`` names (``ms_memopt_mindformers.LayoutScanCallback``)
REGISTER_MODULE = "ms_memopt_mindformers"


def register_path() -> Path:
    """The folder to pass as ``run_mindformer.py --register_path`` (holds ``ms_memopt_mindformers.py``)."""
    return Path(__file__).resolve().parent / "mindformers_register"


def register_callbacks() -> list[str]:
    """Register ``LayoutScanCallback`` and ``CompactionCallback`` as MindFormers callbacks
    (``MindFormerRegister``, type ``callback``), so a YAML's ``callbacks:`` list can name them
    by ``type`` alone. Returns the registered names. Needs mindformers installed."""
    from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

    from ms_memopt.mindspore.compaction import CompactionCallback
    from ms_memopt.mindspore.scan_callback import LayoutScanCallback

    names = []
    for cls in (LayoutScanCallback, CompactionCallback):
        MindFormerRegister.register_cls(cls, module_type=MindFormerModuleType.CALLBACK)
        names.append(cls.__name__)
    return names


if __name__ == "__main__":
    print(register_path())

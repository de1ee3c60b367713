"""ms-memopt's callbacks for a MindFormers YAML's ``callbacks:`` list.

MindFormers instantiates each ``callbacks:`` entry from its registry (``MindFormerRegister``,
type ``callback``). A class from outside MindFormers joins the registry through MindFormers' own
mechanism for external code: the entry names it with ``auto_register: MODULE.CLASS`` and the
folder holding ``MODULE.py`` is given as ``run_mindformer.py --register_path FOLDER`` (or the
``REGISTER_PATH`` environment variable). This file is that module; its folder is printed by
``python -m ms_memopt.mindspore.mindformers``. Example entry::

    callbacks:
      - type: LayoutScanCallback
        auto_register: ms_memopt_mindformers.LayoutScanCallback
        every: 100
        log_dir: ./output/memlog

See docs/mindformers.md and recipes/mindformers_llama_memopt.yaml.
"""
from ms_memopt.mindspore.compaction import CompactionCallback
from ms_memopt.mindspore.scan_callback import LayoutScanCallback

__all__ = ["LayoutScanCallback", "CompactionCallback"]

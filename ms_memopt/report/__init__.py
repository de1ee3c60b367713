"""What a person reads: the report of a run or a simulation (``build``), merged reports of many
ranks (``merge``), plots (``plots``) and memory maps (``memory_map``).

The names the flat layout's ``ms_memopt.report`` module had are importable from here.
"""
from __future__ import annotations

from ms_memopt.io.layouts import (LAYOUTS_NAME, LayoutSnapshot, layout_from_dict, layout_to_dict, read_layouts,
                                  write_layouts)
from ms_memopt.report.build import REPORT_NAME, build_report
from ms_memopt.report.memory_map import plot_memory_map
from ms_memopt.report.plots import plot_loss, plot_region_budget, plot_scan_timeline

__all__ = ["LAYOUTS_NAME", "REPORT_NAME", "LayoutSnapshot", "build_report", "layout_from_dict", "layout_to_dict",
           "plot_loss", "plot_memory_map", "plot_region_budget", "plot_scan_timeline", "read_layouts", "write_layouts"]

"""Compaction: plan moves of live blocks toward low addresses so holes merge.

:mod:`.planner` is framework-free and shared by the simulator (on allocator-model layouts)
and by :class:`ms_memopt.analysis.arena.Arena` (on real bytes). See docs/compaction.md.
"""
from __future__ import annotations

from ms_memopt.analysis.compaction.planner import (CompactionPlan, Move, Run, apply_plan, cheapest_window, coalesce_runs,
                      plan_compaction, run_bounds, slide_targets)

__all__ = ["CompactionPlan", "Move", "Run", "apply_plan", "cheapest_window", "coalesce_runs",
           "plan_compaction", "run_bounds", "slide_targets"]

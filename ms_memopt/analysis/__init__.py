"""Decisions from layouts: the estimator, the forecast, scans, the static planner, compaction
plans and the arena that applies them to real bytes.
"""

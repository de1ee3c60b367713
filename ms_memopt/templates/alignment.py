"""Where one step's allocation sequence is another's with runs inserted (a repeated block count).

Example:
    >>> inserted_runs(list("abcd"), list("abXYcd"))
    [(2, 2)]
"""
from __future__ import annotations

__all__ = ["inserted_runs"]


def inserted_runs(short: list[tuple], long: list[tuple]) -> list[tuple[int, int]] | None:
    """Where ``long`` is ``short`` with runs inserted: ``(position in short, run length)`` per
    run (:mod:`difflib`, the leftmost place inside a repeated stretch); ``None`` when the two
    also differ otherwise (an allocation replaced or dropped)."""
    from difflib import SequenceMatcher

    runs: list[list[int]] = []         # [position in short, start in long, length]
    for tag, i1, _i2, j1, j2 in SequenceMatcher(None, short, long, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag != "insert":
            return None
        # one inserted block can come out as two runs around tokens equal to its end (a layer's
        # optimizer updates D..O..M.. before a final M..M): a run inserted one place earlier,
        # rotated, is the same insertion, so slide each as far left as the run before it, and
        # join the two when they meet
        floor = runs[-1][0] if runs else 0
        while i1 > floor and short[i1 - 1] == long[j2 - 1]:
            i1, j1, j2 = i1 - 1, j1 - 1, j2 - 1
        if runs and runs[-1][0] == i1:
            runs[-1][2] += j2 - j1
        else:
            runs.append([i1, j1, j2 - j1])
    return [(at, n) for at, _start, n in runs]

"""Allocation sizes as exact polynomials in a step's dims (sequence length, batch, ...).

A template stores, for every allocation of a step, integer or rational coefficients over a basis
of monomials in the dims that vary; :func:`fit_sizes` finds the lowest-degree basis that reproduces
every recorded size exactly (rational arithmetic, no rounding), and :func:`evaluate` gives the size
at a new point, in bytes.

Example:
    >>> evaluate([512, 64], [[0], [1]], [32])        # 512 + 64 * seq at seq = 32
    2560
"""
from __future__ import annotations

import math
from fractions import Fraction
from itertools import combinations_with_replacement
from typing import Iterable, Sequence

__all__ = ["MAX_DEGREE", "basis_of", "monomial", "coef_value", "fit_sizes", "evaluate"]

#: the highest degree a size polynomial may take
MAX_DEGREE = 3


def basis_of(names: list[str], varying: list[int], degree: int,
             caps: dict[int, int] | None = None) -> list[list[int]]:
    """Monomials of total degree up to ``degree`` in the dims ``varying`` (indices into
    ``names``), by increasing degree; ``caps``: the highest power of a dim (a dim seen at ``k``
    values can only be fitted to a power below ``k``: ``batch`` at 2, 3, 4 to ``batch**2``)."""
    out = []
    for d in range(degree + 1):
        for combo in combinations_with_replacement(varying, d):
            exps = [0] * len(names)
            for j in combo:
                exps[j] += 1
            if caps and any(e > caps.get(j, e) for j, e in enumerate(exps)):
                continue
            out.append(exps)
    return out


def monomial(exps: Sequence[int], point: Sequence[int]) -> int:
    value = 1
    for e, x in zip(exps, point):
        if e:
            value *= x ** e
    return value


def _solve_exact(matrix: list[list[int]], rhs: list[int]) -> list[Fraction] | None:
    """Solve a square integer system in rationals (Gauss-Jordan); ``None`` when singular."""
    n = len(matrix)
    a = [[Fraction(v) for v in row] + [Fraction(r)] for row, r in zip(matrix, rhs)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if a[r][col] != 0), None)
        if pivot is None:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        p = a[col][col]
        a[col] = [v / p for v in a[col]]
        for r in range(n):
            if r != col and a[r][col] != 0:
                f = a[r][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return [row[n] for row in a]


def _inverse_exact(matrix: list[list[int]]) -> list[list[Fraction]] | None:
    n = len(matrix)
    cols = []
    for j in range(n):
        col = _solve_exact(matrix, [1 if i == j else 0 for i in range(n)])
        if col is None:
            return None
        cols.append(col)
    return [[cols[j][i] for j in range(n)] for i in range(n)]


def _coef_text(c: Fraction) -> int | str:
    return int(c) if c.denominator == 1 else f"{c.numerator}/{c.denominator}"


def coef_value(c: int | str) -> Fraction:
    return Fraction(c) if isinstance(c, int) else Fraction(c)


def fit_sizes(names: list[str], points: list[dict[str, int]], sizes: list[list[int]],
              max_degree: int = MAX_DEGREE, only: Iterable[str] | None = None
              ) -> tuple[list[list[int]], list[list], list[bool]]:
    """Per allocation position: the coefficients of the lowest-degree exact polynomial fit.

    ``only``: the dims the polynomial may use (default: every dim that varies across the
    samples); the prologue is fitted in the dims each recording holds constant.

    Returns the basis, per position its coefficient list (ints / ``"p/q"``), and whether it is exact.
    """
    import numpy as np

    grid = [[p.get(n, 0) for n in names] for p in points]
    allowed = set(names if only is None else only)
    varying = [j for j in range(len(names)) if names[j] in allowed and len({row[j] for row in grid}) > 1]
    # only the allowed dims count: other dims are zeroed (the basis does not use them)
    grid = [[v if names[j] in allowed else 0 for j, v in enumerate(row)] for row in grid]
    unique: list[list[int]] = []
    for row in grid:
        if row not in unique:
            unique.append(row)
    # a dim seen at k values enters with a power below k (s**2 * b on a 3 x 3 grid of shapes;
    # b**3 there is no monomial of its own on those points)
    caps = {j: len({row[j] for row in grid}) - 1 for j in varying}
    positions = len(sizes[0]) if sizes else 0
    y = np.array(sizes, dtype=np.float64).reshape(len(sizes), positions)
    coefs: list[list | None] = [None] * positions
    exact = [False] * positions
    todo = list(range(positions))
    best_basis: list[list[int]] = [[0] * len(names)]
    for degree in range(max_degree + 1):
        basis = basis_of(names, varying, degree, caps)
        if len(basis) > len(unique):
            break
        a_unique = np.array([[monomial(e, row) for e in basis] for row in unique], dtype=np.float64)
        scale = np.abs(a_unique).max(axis=0)
        scale[scale == 0] = 1
        if np.linalg.matrix_rank(a_unique / scale) < len(basis):
            break
        best_basis = basis
        # an invertible square subsystem on unique points, for the exact coefficients
        chosen: list[int] = []
        for r in range(len(unique)):
            trial = chosen + [r]
            if np.linalg.matrix_rank(a_unique[trial] / scale) == len(trial):
                chosen = trial
            if len(chosen) == len(basis):
                break
        sub = [[monomial(e, unique[r]) for e in basis] for r in chosen]
        inverse = _inverse_exact(sub)
        if inverse is None or not todo:
            continue
        a_all = np.array([[monomial(e, row) for e in basis] for row in grid], dtype=np.float64)
        sol, *_ = np.linalg.lstsq(a_all / scale, y[:, todo], rcond=None)
        pred = np.rint((a_all / scale) @ sol)
        screen = np.all(pred == y[:, todo], axis=0)
        rows_of = [grid.index(unique[r]) for r in chosen]
        left = []
        for col, pos in enumerate(todo):
            values = [sizes[s][pos] for s in range(len(sizes))]
            if screen[col]:
                rhs = [values[r] for r in rows_of]
                c = [sum(inv * v for inv, v in zip(row, rhs)) for row in inverse]
                if all(sum(ci * monomial(e, g) for ci, e in zip(c, basis)) == v for g, v in zip(grid, values)):
                    coefs[pos] = [_coef_text(ci) for ci in c]
                    exact[pos] = True
                    continue
            left.append(pos)
        todo = left
    for pos in todo:     # no polynomial reproduces it: the size recorded most often (a constant)
        values = [s[pos] for s in sizes]
        coefs[pos] = [max(sorted(set(values)), key=values.count)]
    return best_basis, coefs, exact


def evaluate(coefs: list, basis: list[list[int]], point: list[int]) -> int:
    total = Fraction(0)
    for c, exps in zip(coefs, basis):
        total += coef_value(c) * monomial(exps, point)
    return max(0, math.floor(total + Fraction(1, 2)))

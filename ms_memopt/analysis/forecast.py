"""A forecast of when a watched request will stop fitting in one piece.

A scan says whether the 4.2 GB AllReduce buffer fits *now*. The forecast says when it will
stop fitting: from the samples of ``largest_free`` (taken at scans, or better just before the
watched request) and of long-lived memory, it estimates how many steps remain until the
smallest ``largest_free`` of a window of steps falls below the request, with an interval, a
confidence, and the probability that it happens within a horizon.

Method (docs/forecast.md explains it and the evaluation):

1. **Window minima.** Samples are grouped into windows of ``window`` steps counted back from
   the latest sample; each window contributes its smallest ``largest_free`` (a request fails
   at the worst moment, not the average one), placed at the window's last step. The last
   ``history`` windows are used, so the forecast follows a decline that changes pace.
2. **What the minima follow** (``Forecast.basis``). When long-lived memory (bytes in use after
   the optimizer step: weights, states, per-shape caches) is sampled and grows (Mann-Kendall
   at ``level``), the minima are a Theil-Sen line of it (the holes shrink because long-lived
   tensors land in them), and long-lived memory, smooth where ``largest_free`` is noisy, a
   Theil-Sen line of ``(step - origin) ** p`` with ``p`` in :data:`POWERS` (its growth slows as
   per-shape caches fill ever more slowly): ``"long_lived"``. When it is sampled and does not
   grow, a decline is a reshuffle that settles: no trend, ``"level"``. Without it, a Theil-Sen
   line in steps: ``"time"``. ``origin`` is where the layout started (0, or the last compaction).
3. **Spread.** The robust scale of the residuals, ``1.4826 * MAD`` (the mean absolute
   deviation when most residuals are equal): how far one window's minimum falls from the line.
4. **Prediction.** A window minimum at a future step is normal about the line, its variance
   the spread plus the slope's uncertainty (Sen's 1968 interval, from Kendall's S), growing
   with the distance from the data.
5. **Probability** (:meth:`Forecast.probability`): that some window minimum of the next
   ``within`` steps falls below the request, windows independent given the line (the
   extreme-value view: a trend, a wide spread close above the request, or both).
6. **Crossing.** The point estimate is the first step where the line is below the request;
   the earliest and latest steps are where the lower and upper edges of the ``level``
   interval are (the latest ``None`` when the upper edge never falls below the request within
   :data:`MAX_HORIZON` steps).
7. **Confidence.** The one-sided Mann-Kendall test that the minima decline, times the same
   test's confidence that long-lived memory grows when it is sampled.

Fewer than ``min_windows`` windows with samples give no forecast (``status
"too_few_samples"``, probability 0). :meth:`Forecast.warns` is the warning rule the callbacks
and the simulator use: the probability within the horizon reaches ``risk``
(:data:`DEFAULT_RISK`), or a window minimum is already below the request.

Example:
    >>> f = Forecaster(request=4 * 2**30, window=10)
    >>> for step in range(1, 201):
    ...     f.add(step, 12 * 2**30 - step * 2**25)      # loses 32 MiB a step
    >>> fc = f.forecast()
    >>> fc.status, fc.step, fc.basis
    ('declining', 257, 'time')
    >>> fc.warns(within=100), fc.warns(within=20)
    (True, False)
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields
from statistics import NormalDist
from typing import Iterable

import numpy as np

from ms_memopt.core.units import format_size

__all__ = ["Forecast", "Forecaster", "forecast", "STATUSES", "DEFAULT_RISK"]

#: exponents ``p`` tried for the trend against ``(step - origin) ** p``: 1 a straight decline, below
#: 1 a decline that slows down as per-shape caches fill (distinct shapes grow sublinearly with the
#: steps seen, Heaps' law)
POWERS = (1.0, 0.75, 0.5)

#: ``too_few_samples``: no forecast; ``no_decline``: the minima do not decline (slope >= 0);
#: ``declining``: a crossing step is estimated; ``below``: a window minimum is already below the
#: request (it did not fit, or will not, now).
STATUSES = ("too_few_samples", "no_decline", "declining", "below")

#: steps ahead a forecast looks for the crossing; beyond it, no crossing is reported
MAX_HORIZON = 20_000

#: :meth:`Forecast.warns` warns when the probability that the request fails within the horizon
#: reaches this (chosen on the calibration seeds of ``bench/forecast.py``, docs/forecast.md)
DEFAULT_RISK = 0.1

_MAD_TO_SD = 1.4826     # MAD of a normal distribution times this = its standard deviation


@dataclass
class Forecast:
    """When a watched request stops fitting in one piece; steps are training steps, sizes bytes.

    ``now`` is the latest sample's step; ``step`` the point estimate of the first window whose
    smallest ``largest_free`` is below ``request`` (``steps_left = step - now``);
    ``earliest_step``/``latest_step`` the interval at ``level`` (``latest_step`` ``None``: it may
    never cross). ``slope`` (bytes per step) and ``spread`` (bytes) describe the window minima,
    ``long_lived_growth`` (bytes per step) the long-lived memory when it was sampled;
    ``confidence`` (0-1) that the decline is real and sustained. ``basis`` is what the
    prediction follows: ``"long_lived"`` (the minima as a function of growing long-lived
    memory), ``"time"`` (a trend in steps: long-lived memory not sampled) or ``"level"`` (no
    trend: long-lived memory does not grow). :meth:`probability` is the chance that a window's
    minimum falls below the request within some steps; :meth:`warns` compares it with ``risk``.
    """

    request: int
    now: int | None
    status: str
    windows: int
    level: float
    confidence: float = 0.0
    step: int | None = None
    earliest_step: int | None = None
    latest_step: int | None = None
    slope: float | None = None
    spread: float | None = None
    long_lived_growth: float | None = None
    window_min_last: int | None = None
    power: float | None = None
    risk: float = DEFAULT_RISK
    window: int = 10
    basis: str | None = None
    _model: "_Model | None" = field(default=None, repr=False, compare=False)

    @property
    def steps_left(self) -> int | None:
        """Steps from ``now`` to the point estimate (0 when already below); ``None`` without one."""
        if self.step is None or self.now is None:
            return None
        return max(0, self.step - self.now)

    def probability(self, within: int) -> float:
        """The probability (0-1) that the smallest ``largest_free`` of some window of the next
        ``within`` steps falls below the request: the prediction (trend and spread) of each
        window's minimum, windows independent given it. 1.0 when already below, 0.0 without a
        forecast.

        Example:
            >>> fc = forecast([(s, 10_000 - 10 * s) for s in range(100)], 4_000)
            >>> fc.probability(100) < 0.01 < 0.99 < fc.probability(600)
            True
        """
        if self.status == "below":
            return 1.0
        if self._model is None or self.now is None:
            return 0.0
        return self._model.probability(self.request, self.now, within, self.window)

    def warns(self, within: int) -> bool:
        """True when the request may stop fitting within ``within`` steps with a probability of
        at least ``risk`` (:meth:`probability`), or a window minimum is already below it. A
        decline towards the request warns as its crossing nears; so does a layout whose minima
        do not decline but scatter close enough above the request to dip below it."""
        if self.status == "below":
            return True
        return self.probability(within) >= self.risk

    def describe(self, name: str = "watched request", *, within: int | None = None) -> str:
        """One line for logs, e.g. ``'allreduce' (3.91 GiB) stops fitting in one piece in ~40
        steps (step 437, 90% interval 412-470, confidence 0.97) ...``; with ``within``, the
        chance of not fitting within that many steps is appended."""
        head = f"{name!r} ({format_size(self.request)})"
        chance = "" if within is None else f"; chance of not fitting within {within} steps {self.probability(within):.0%}"
        if self.status == "too_few_samples":
            return f"{head}: no forecast yet ({self.windows} windows of samples)"
        if self.status == "no_decline":
            return (f"{head}: largest free block not declining (confidence of a decline {self.confidence:.2f}; "
                    f"smallest of the last window {format_size(self.window_min_last)}, spread "
                    f"{format_size(round(self.spread or 0))}){chance}")
        if self.status == "below":
            return (f"{head}: does not fit in one piece now (smallest largest free block of the last window "
                    f"{format_size(self.window_min_last)})")
        latest = "never" if self.latest_step is None else str(self.latest_step)
        return (f"{head} stops fitting in one piece in ~{self.steps_left} steps (step {self.step}, "
                f"{self.level:.0%} interval {self.earliest_step}-{latest}, confidence {self.confidence:.2f}; "
                f"largest free block {format_size(self.window_min_last)} falling "
                f"{format_size(round(-self.slope))}/step){chance}")

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        out["steps_left"] = self.steps_left
        return out


class Forecaster:
    """Collects ``largest_free`` (and optionally long-lived memory) samples and forecasts.

    Args:
        request: the watched request, bytes.
        window: steps per window (each window contributes its smallest sample).
        history: windows used, the most recent (older samples are dropped).
        min_windows: fewer windows holding samples give ``status "too_few_samples"`` (>= 3).
        level: confidence level of the interval (0.5-1); long-lived memory whose growth is
            less certain than this is taken as not growing.
        risk: :meth:`Forecast.warns` warns at this probability of the request failing (0-1).

    Call :meth:`reset` after a compaction: the layout the trend described is gone.
    """

    def __init__(self, request: int, *, window: int = 10, history: int = 30, min_windows: int = 6,
                 level: float = 0.9, risk: float = DEFAULT_RISK) -> None:
        if request <= 0:
            raise ValueError(f"request must be > 0 bytes, got {request}")
        if window < 1 or history < 3 or not 3 <= min_windows <= history:
            raise ValueError(f"need window >= 1, history >= 3 and 3 <= min_windows <= history; got "
                             f"window={window}, history={history}, min_windows={min_windows}")
        if not 0.5 <= level < 1.0:
            raise ValueError(f"level must be in [0.5, 1), got {level}")
        if not 0.0 < risk < 1.0:
            raise ValueError(f"risk must be in (0, 1), got {risk}")
        self.request = int(request)
        self.window = int(window)
        self.history = int(history)
        self.min_windows = int(min_windows)
        self.level = float(level)
        self.risk = float(risk)
        self.origin = 0
        self._samples: deque[tuple[int, int]] = deque()
        self._long_lived: deque[tuple[int, int]] = deque()

    def add(self, step: int, largest_free: int | None, *, long_lived: int | None = None) -> None:
        """One sample at ``step``: ``largest_free`` bytes (``None``: unknown, skipped) and,
        when known, the bytes of long-lived memory (in use after the optimizer step)."""
        if largest_free is not None:
            self._samples.append((int(step), int(largest_free)))
        if long_lived is not None:
            self._long_lived.append((int(step), int(long_lived)))
        self._trim(int(step))

    def reset(self, step: int) -> None:
        """Forget every sample: the layout started afresh at ``step`` (a compaction), the old
        trend no longer applies."""
        self.origin = int(step)
        self._samples.clear()
        self._long_lived.clear()

    def _trim(self, now: int) -> None:
        oldest = now - self.history * self.window
        for samples in (self._samples, self._long_lived):
            while samples and samples[0][0] <= oldest:
                samples.popleft()

    def forecast(self) -> Forecast:
        """The forecast from the samples held now (see the module docstring for the method)."""
        return forecast(self._samples, self.request, long_lived=self._long_lived, window=self.window,
                        history=self.history, min_windows=self.min_windows, level=self.level,
                        risk=self.risk, origin=self.origin)


def forecast(samples: Iterable[tuple[int, int]], request: int, *,
             long_lived: Iterable[tuple[int, int]] = (), window: int = 10, history: int = 30,
             min_windows: int = 6, level: float = 0.9, risk: float = DEFAULT_RISK, origin: int = 0,
             powers: Iterable[float] = POWERS) -> Forecast:
    """Forecast from ``(step, largest_free)`` samples (any order) when ``request`` bytes stop
    fitting in one piece; ``long_lived`` are ``(step, bytes)`` samples of long-lived memory;
    ``origin`` is the step the layout started from (training start, or the last compaction).
    Arguments as :class:`Forecaster`'s.

    Example:
        >>> fc = forecast([(s, 10_000 - 10 * s) for s in range(100)], 4_000)
        >>> fc.status, fc.step, fc.earliest_step <= fc.step <= fc.latest_step
        ('declining', 601, True)
    """
    pairs = sorted((int(s), int(v)) for s, v in samples)
    if not pairs:
        return Forecast(request=request, now=None, status="too_few_samples", windows=0, level=level, risk=risk,
                        window=window)
    now = pairs[-1][0]
    steps, minima = _window_minima(pairs, now, window, history)
    out = Forecast(request=request, now=now, status="too_few_samples", windows=len(steps), level=level,
                   risk=risk, window=window, window_min_last=int(minima[-1]))
    if minima[-1] < request:
        out.status, out.step, out.earliest_step, out.confidence = "below", now, now, 1.0
        return out
    if len(steps) < min_windows:
        return out
    confidence = _trend_confidence(minima, -1)
    long_lived = list(long_lived)
    grown = _long_lived(long_lived, now - history * window, now, origin, min_windows)
    if long_lived and grown is None:
        # long-lived memory is sampled, but too thinly yet (at scans: the first few after the
        # start or a compaction): a trend of the first windows alone is the warm-up's, not
        # the accumulation's, so wait for the samples rather than extrapolate it
        return out
    model: _Model
    if grown is None:
        out.basis = "time"
        model = _time_model(steps, minima, origin, level)
    else:
        out.long_lived_growth, growth_confidence = _growth(*grown)
        confidence *= growth_confidence
        if growth_confidence >= level:
            # long-lived memory grows: the holes shrink because it lands in them; forecast its
            # (smooth) growth and read the minima off their relation to it
            out.basis = "long_lived"
            model = _covariate_model(steps, minima, *grown, origin, level, tuple(powers))
        else:
            # no accumulation: a decline is a reshuffle that settles; only the variation is left
            out.basis = "level"
            model = _level_model(steps, minima)
    out.confidence, out.spread, out.power = confidence, model.spread, model.power
    out.slope = model.slope_at(now)
    out._model = model
    if out.slope >= 0:
        out.status = "no_decline"
        return out
    out.status = "declining"
    z = NormalDist().inv_cdf(0.5 + level / 2.0)       # two-sided interval at `level`
    out.step, out.earliest_step, out.latest_step = model.crossings(request, now, z)
    if out.step is None:
        out.status = "no_decline"      # declining, but not below the request within MAX_HORIZON steps
    return out


class _Model:
    """A window minimum's prediction at a step: mean and standard error (bytes). Subclasses
    (dataclasses) hold ``power`` (of ``step - origin``) and ``spread`` (bytes)."""

    power: float
    spread: float

    def predict(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def slope_at(self, step: int) -> float:
        """The predicted decline at ``step``, bytes per step (negative: declining)."""
        mean, _ = self.predict(np.array([step, step + 1], dtype=float))
        return float(mean[1] - mean[0])

    def crossings(self, request: int, now: int, z: float) -> tuple[int | None, int | None, int | None]:
        """First steps after ``now`` (up to :data:`MAX_HORIZON` later) where the prediction, its
        lower and its upper edge at ``z`` standard errors fall below ``request`` (``None``: not
        within the horizon)."""
        steps = np.arange(now + 1, now + MAX_HORIZON + 1, dtype=float)
        line, se = self.predict(steps)
        return tuple(_first(steps, bound < request) for bound in (line, line - z * se, line + z * se))

    def probability(self, request: int, now: int, within: int, window: int) -> float:
        """The probability that some window minimum of the next ``within`` steps falls below
        ``request``: windows ending every ``window`` steps, each normal about the prediction,
        independent given it (the extreme-value view: a run whose trend stays above the request
        can still dip below it, the more often the wider its spread)."""
        ends = np.arange(now + window, now + max(within, window) + 1, window, dtype=float)
        line, se = self.predict(ends)
        below = _normal_cdf((request - line) / np.maximum(se, 1.0))
        return float(1.0 - np.prod(1.0 - below))


@dataclass
class _Fit(_Model):
    """A Theil-Sen line of window minima against ``tau = (step - origin) ** power``."""

    origin: int
    power: float
    centre: float        # mean tau of the windows
    level_at: float      # the line's value at ``centre``, bytes
    slope: float         # bytes per unit of tau
    se_slope: float      # the slope's standard error, read off Sen's interval
    spread: float        # robust scale of the residuals, bytes
    windows: int

    def predict(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The prediction of a window minimum at ``tau`` has variance ``spread**2 * (1 + 1/n) +
        (tau - centre)**2 * se_slope**2``: it widens with the distance from the data."""
        tau = np.maximum(steps - self.origin, 0.0) ** self.power
        line = self.level_at + self.slope * (tau - self.centre)
        se = np.sqrt(self.spread ** 2 * (1.0 + 1.0 / self.windows) + ((tau - self.centre) * self.se_slope) ** 2)
        return line, se


@dataclass
class _Covariate(_Model):
    """Window minima as a Theil-Sen line of long-lived memory ``L`` (``level_at + slope * (L -
    centre)``), and ``L`` itself as a Theil-Sen line of ``(step - origin) ** power``."""

    origin: int
    power: float
    growth_level: float  # L = growth_level + growth * tau
    growth: float
    centre: float
    level_at: float
    slope: float         # bytes of window minimum per byte of long-lived memory
    se_slope: float
    spread: float
    windows: int

    def predict(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tau = np.maximum(steps - self.origin, 0.0) ** self.power
        held = self.growth_level + self.growth * tau
        line = self.level_at + self.slope * (held - self.centre)
        se = np.sqrt(self.spread ** 2 * (1.0 + 1.0 / self.windows) + ((held - self.centre) * self.se_slope) ** 2)
        return line, se


def _time_model(steps: np.ndarray, minima: np.ndarray, origin: int, level: float, power: float = 1.0) -> _Fit:
    tau = np.maximum(steps - origin, 0.0) ** power
    slope, slope_lo, slope_hi = _sen_slope(tau, minima, level)
    centre = float(tau.mean())
    level_at = float(np.median(minima - slope * (tau - centre)))
    spread = _robust_scale(minima - (level_at + slope * (tau - centre)))
    se_slope = (slope_hi - slope_lo) / (2.0 * NormalDist().inv_cdf(0.5 + level / 2.0))
    return _Fit(origin, power, centre, level_at, slope, se_slope, spread, len(steps))


def _level_model(steps: np.ndarray, minima: np.ndarray) -> _Fit:
    """No trend: the minima scatter about their median."""
    level_at = float(np.median(minima))
    return _Fit(0, 1.0, float(steps.mean()), level_at, 0.0, 0.0, _robust_scale(minima - level_at), len(steps))


def _covariate_model(steps: np.ndarray, minima: np.ndarray, held_steps: np.ndarray, held: np.ndarray,
                     origin: int, level: float, powers: tuple[float, ...]) -> _Model:
    """Minima against long-lived memory (interpolated at the window ends), long-lived memory
    against ``(step - origin) ** p`` (``p`` where it is most nearly a straight line). Falls back
    to the time trend when the minima do not fall as long-lived memory grows."""
    at = np.interp(steps, held_steps, held)
    if float(np.ptp(at)) <= 0:
        return _time_model(steps, minima, origin, level)
    slope, slope_lo, slope_hi = _sen_slope(at, minima, level)
    if slope >= 0:
        return _time_model(steps, minima, origin, level)
    power = _growth_power(held_steps, held, origin, powers)
    tau = np.maximum(held_steps - origin, 0.0) ** power
    growth = float(np.median(_pairwise_slopes(tau, held)))
    growth_level = float(np.median(held - growth * tau))
    centre = float(at.mean())
    level_at = float(np.median(minima - slope * (at - centre)))
    spread = _robust_scale(minima - (level_at + slope * (at - centre)))
    se_slope = (slope_hi - slope_lo) / (2.0 * NormalDist().inv_cdf(0.5 + level / 2.0))
    return _Covariate(origin, power, growth_level, growth, centre, level_at, slope, se_slope, spread, len(steps))


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * np.vectorize(math.erfc)(-np.asarray(x, dtype=float) / math.sqrt(2.0))


def _first(steps: np.ndarray, below: np.ndarray) -> int | None:
    hits = np.flatnonzero(below)
    return int(steps[hits[0]]) if hits.size else None


# --- statistics --------------------------------------------------------------------------------------
def _window_minima(pairs: list[tuple[int, int]], now: int, window: int, history: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows ``(now - (k+1)*window, now - k*window]`` for k < history, oldest first: each one's
    last step and smallest sample; windows without samples are left out. A window stands at its
    last step: by then its minimum is known, and in a steady decline that is where it lies."""
    minima: dict[int, int] = {}
    for step, value in pairs:
        k = (now - step) // window
        if k < history and (k not in minima or value < minima[k]):
            minima[k] = value
    ks = sorted(minima, reverse=True)
    ends = np.array([now - k * window for k in ks], dtype=float)
    return ends, np.array([minima[k] for k in ks], dtype=float)


def _robust_scale(residuals: np.ndarray) -> float:
    """``1.4826 * MAD`` (a normal distribution's standard deviation); when more than half the
    residuals are equal (MAD 0: a layout that repeats, then jumps) the mean absolute deviation
    times ``sqrt(pi / 2)`` instead, so one deep dip still widens the interval."""
    deviations = np.abs(residuals - np.median(residuals))
    mad = float(np.median(deviations))
    if mad > 0:
        return _MAD_TO_SD * mad
    return math.sqrt(math.pi / 2.0) * float(deviations.mean())


def _pairwise_slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    i, j = np.triu_indices(len(x), k=1)
    dx = x[j] - x[i]
    keep = dx != 0
    return (y[j] - y[i])[keep] / dx[keep]


def _sen_slope(x: np.ndarray, y: np.ndarray, level: float) -> tuple[float, float, float]:
    """Theil-Sen slope and Sen's two-sided ``level`` interval (from Var(S) of Kendall's S)."""
    slopes = np.sort(_pairwise_slopes(x, y))
    n, count = len(x), len(slopes)
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    c = z * math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
    lower = max(0, int(math.floor((count - c) / 2.0)))
    upper = min(count - 1, int(math.ceil((count + c) / 2.0)))
    return float(np.median(slopes)), float(slopes[lower]), float(slopes[upper])


def _trend_confidence(y: np.ndarray, direction: int) -> float:
    """One-sided Mann-Kendall: 1 - p for a trend in ``direction`` (-1 down, +1 up) of ``y``
    (ordered in time), tie-corrected normal approximation with continuity correction."""
    n = len(y)
    i, j = np.triu_indices(n, k=1)
    s = float(np.sign(y[j] - y[i]).sum())
    _, ties = np.unique(y, return_counts=True)
    var = (n * (n - 1) * (2 * n + 5) - float(np.sum(ties * (ties - 1) * (2 * ties + 5)))) / 18.0
    if var <= 0:
        return 0.0
    z = (direction * s - 1.0) / math.sqrt(var)
    return NormalDist().cdf(z)


def _long_lived(samples: Iterable[tuple[int, int]], after: int, now: int, origin: int,
                min_samples: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Long-lived samples in ``(max(after, origin), now]`` as (steps, bytes), at most 100 (evenly
    thinned: the tests below are quadratic); ``None`` with fewer than ``min(min_samples, 4)``
    (long-lived memory may be sampled only at scans)."""
    pairs = sorted((int(s), int(v)) for s, v in samples if max(after, origin) < s <= now)
    if len(pairs) < min(min_samples, 4):
        return None
    if len(pairs) > 100:
        pairs = [pairs[i] for i in np.linspace(0, len(pairs) - 1, 100).round().astype(int)]
    return (np.array([s for s, _ in pairs], dtype=float), np.array([v for _, v in pairs], dtype=float))


def _growth(steps: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """Theil-Sen growth of long-lived memory (bytes/step) and the confidence that it grows."""
    slopes = _pairwise_slopes(steps, values)
    return (float(np.median(slopes)) if len(slopes) else 0.0), _trend_confidence(values, +1)


def _growth_power(steps: np.ndarray, values: np.ndarray, origin: int, powers: tuple[float, ...]) -> float:
    """The exponent ``p`` under which long-lived memory is most nearly a straight line against
    ``(step - origin) ** p`` (smallest robust residual spread; ties go to the earlier, 1.0
    first). Long-lived memory is smooth where ``largest_free`` is noisy, and the largest hole
    shrinks because it grows, so its shape is the shape of the decline."""
    best, best_spread = powers[0], math.inf
    for power in powers:
        tau = np.maximum(steps - origin, 0.0) ** power
        slope = float(np.median(_pairwise_slopes(tau, values))) if len(steps) > 1 else 0.0
        residuals = values - slope * tau
        spread = _robust_scale(residuals - np.median(residuals))
        if spread < best_spread * 0.999:
            best, best_spread = power, spread
    return best



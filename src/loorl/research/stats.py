"""The statistics behind "A beats B": a mean's confidence interval over seeds, the paired difference of two
settings run on the same seeds, and Holm's correction when one table makes many comparisons.

Seeds are the unit: run i of every setting shares its seed (its warm start, its prompts in the same
order), so two settings are compared by the per-seed differences d_i = a_i - b_i, whose spread is
free of what the seeds share. With 3-5 seeds the normal approximation is too narrow, hence Student t.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


def t_half_width(sd: float | np.ndarray, n: int, *, level: float = 0.95) -> float | np.ndarray:
    """Half-width of the two-sided Student-t confidence interval of a mean of `n` values whose sample
    standard deviation is `sd` (elementwise for an array of them): t(0.5 + level / 2, n - 1) sd / sqrt(n)."""
    from scipy import stats

    return stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)


def mean_ci(values: list[float] | np.ndarray, *, level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of the Student-t confidence interval); the half-width is NaN for n < 2.
    NaN values (a seed that never logged the metric) are left out."""
    x = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if len(x) == 0:
        return float("nan"), float("nan")
    if len(x) < 2:
        return float(x.mean()), float("nan")
    return float(x.mean()), float(t_half_width(x.std(ddof=1), len(x), level=level))


@dataclass(frozen=True)
class Paired:
    """a - b over the seeds both have: the mean difference, its confidence interval, the two-sided
    paired t-test's p-value, and how many seeds a won, tied and lost."""

    n: int
    mean: float
    low: float
    high: float
    p: float
    wins: int
    ties: int
    losses: int

    def as_dict(self) -> dict:
        return asdict(self)


def paired_difference(
    a: list[float] | np.ndarray, b: list[float] | np.ndarray, *, level: float = 0.95
) -> Paired:
    """The paired comparison of two settings' per-seed values (`a[i]` and `b[i]` from seed i). A pair with
    a NaN on either side is left out. With fewer than 2 pairs the interval and p are NaN; differences
    that are all equal give a zero-width interval and p = 0 (all non-zero) or 1 (all zero)."""
    from scipy import stats

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values need one per seed on both sides: {a.shape} and {b.shape}")
    keep = ~(np.isnan(a) | np.isnan(b))
    d = a[keep] - b[keep]  # [n]
    n = len(d)
    wins, ties = int((d > 0).sum()), int((d == 0).sum())
    if n == 0:
        return Paired(0, math.nan, math.nan, math.nan, math.nan, 0, 0, 0)
    mean = float(d.mean())
    if n < 2:
        return Paired(n, mean, math.nan, math.nan, math.nan, wins, ties, n - wins - ties)
    sd = float(d.std(ddof=1))
    if sd == 0:
        return Paired(n, mean, mean, mean, 1.0 if mean == 0 else 0.0, wins, ties, n - wins - ties)
    se = sd / math.sqrt(n)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * se  # t * se: se is the p-value's too
    p = float(2 * stats.t.sf(abs(mean) / se, n - 1))
    return Paired(n, mean, mean - half, mean + half, p, wins, ties, n - wins - ties)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (controls the chance of any false "A beats
    B" in the family at the nominal level): the i-th smallest is multiplied by (m - i), made
    non-decreasing, capped at 1. NaN stays NaN and does not count towards m."""
    finite = [(p, i) for i, p in enumerate(p_values) if not math.isnan(p)]
    finite.sort()
    m, running = len(finite), 0.0
    adjusted = [math.nan] * len(p_values)
    for rank, (p, i) in enumerate(finite):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted

"""Curves over seeds, shared by the ablation and study reports: the steps at which every run logged a
metric with the values there, and a mean drawn with its 95% Student-t band."""

from __future__ import annotations

import math

import numpy as np

from loorl.research.stats import t_half_width


def aligned(jobs: list, key: str) -> tuple[np.ndarray, np.ndarray]:
    """The steps every run (`Job`) logged `key` at, and the values there, [runs, steps]."""
    common = sorted(set.intersection(*(set(j.series(key)[0].tolist()) for j in jobs)))
    values = []
    for job in jobs:
        steps, v = job.series(key)
        lookup = dict(zip(steps.tolist(), v.tolist()))
        values.append([lookup[s] for s in common])
    return np.array(common), np.array(values, dtype=float)


def band(ax, x, ys: np.ndarray, label: str, color, *, bounds=(-math.inf, math.inf), lw=1.5, alpha=0.2):
    """The mean of `ys` [seeds, points] against `x`, with its 95% t-band (clipped to `bounds`) where
    there are two seeds or more."""
    mean = ys.mean(0)  # [points]
    ax.plot(x, mean, label=label, color=color, lw=lw)
    if len(ys) > 1:
        half = t_half_width(ys.std(0, ddof=1), len(ys))  # [points]
        ax.fill_between(x, *np.clip([mean - half, mean + half], *bounds), color=color, alpha=alpha, lw=0)

"""How noisy is each estimator's policy gradient? The statistics of the probe (`loorl.research.probe`).

For R independent rollouts of the same prompts under the same policy, each estimator gives R gradient
estimates g_1..g_R (flattened over the parameters). Their relative variance is

    tr(Cov[g]) / ||E[g]||^2  =  (sum_r ||g_r - g_mean||^2 / (R - 1)) / ||g_mean||^2,

the noise energy per unit of signal energy: scale-free, so estimators that rescale advantages (GRPO's
std division, whitening) compare with those that do not. Everything needed is in the R x R Gram
matrix G = g g^T, so bootstrap resamples of the repeats cost no pass over the parameters.
"""

from __future__ import annotations

import numpy as np
import torch


def relative_variance_from_gram(gram: np.ndarray, index: np.ndarray | None = None) -> float:
    """tr(Cov)/||mean||^2 of the gradients whose Gram matrix is `gram` [R, R], over the repeats
    `index` (with repetition, for a bootstrap sample; default: all of them)."""
    index = np.arange(len(gram)) if index is None else np.asarray(index)
    sub = gram[np.ix_(index, index)]  # [R', R']
    r = len(index)
    mean_sq = sub.sum() / r**2  # ||mean||^2
    spread = np.trace(sub) - r * mean_sq  # sum_r ||g_r - mean||^2
    return float(spread / (r - 1) / mean_sq)


def relative_variance(grads: torch.Tensor) -> float:
    """The same from the gradients [R, D] directly (the slow reference the Gram form is tested on)."""
    g = grads.double()  # [R, D]
    mean = g.mean(0)  # [D]
    trace_cov = ((g - mean) ** 2).sum() / (len(g) - 1)
    return float(trace_cov / mean.pow(2).sum())


def bootstrap_interval(
    gram: np.ndarray, *, samples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the relative variance, resampling the R repeats."""
    rng = np.random.default_rng(seed)
    r = len(gram)
    stats = [relative_variance_from_gram(gram, rng.integers(0, r, size=r)) for _ in range(samples)]
    low, high = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def gram_matrix(grads: torch.Tensor) -> np.ndarray:
    """G = g g^T [R, R] in float64 from the gradients [R, D]."""
    g = grads.double()  # [R, D]
    return (g @ g.T).numpy()  # [R, R]

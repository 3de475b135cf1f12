"""An ablation's curves: held-out accuracy and rollout reward against RL step, generated tokens and
RL-step minutes, the mean over seeds with its 95% band (`curves.png`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loorl.research.curves import aligned, band
from loorl.research.jobs import Job, Setting, cost_before, cost_through


def _aligned(jobs: list[Job], key: str) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Steps every seed has, their values [seeds, steps] and, at each of those steps, the mean over
    seeds of the cumulative generated tokens and RL-step minutes (empty where a run lacks them)."""
    common, values = aligned(jobs, key)  # [steps], [seeds, steps]
    clocks = {"tokens": [], "minutes": []}
    for job in jobs:
        for name, cum in (
            ("tokens", job.cumulative_tokens()),
            ("minutes", job.cumulative_step_seconds() / 60),
        ):
            if not len(cum):
                continue
            # validation at step s saw the policy after s updates: the rollouts 0..s-1;
            # the reward of step s is that rollout's own: 0..s
            at = cost_before if key.startswith("val/") else cost_through
            clocks[name].append([at(cum, s) for s in common.tolist()])
    return common, values, {k: np.array(v).mean(0) for k, v in clocks.items() if len(v) == len(jobs)}


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over `window` steps along the last axis (shorter at the start)."""
    if window <= 1:
        return values
    cum = np.cumsum(np.pad(values, [(0, 0)] * (values.ndim - 1) + [(1, 0)]), axis=-1)
    idx = np.arange(values.shape[-1])
    start = np.maximum(idx + 1 - window, 0)
    return (cum[..., idx + 1] - cum[..., start]) / (idx + 1 - start)


def plot_curves(settings: list[Setting], path: Path, *, title: str) -> None:
    """Held-out accuracy and rollout reward (a trailing mean over ~1/15 of the run: one step's reward
    is noisy) against RL step, generated tokens and RL-step minutes (the wall clock without validation
    and start-up: settings whose steps cost differently compare here); the mean over seeds with its
    95% band. The y-axes span the means (bands of few seeds run far beyond them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clocks = ("tokens", "minutes")
    fig, axes = plt.subplots(3, 2, figsize=(11, 11), sharey="col")
    colors = plt.get_cmap("tab10")
    means: dict[int, list[np.ndarray]] = {0: [], 1: []}
    window = 1
    for i, setting in enumerate(settings):
        for col, key in enumerate(("val/accuracy", "rollout/reward")):
            if not all(j.history.get(key) for j in setting.jobs):
                continue
            steps, values, x = _aligned(setting.jobs, key)
            if key == "rollout/reward":
                window = max(1, len(steps) // 15)
                values = moving_average(values, window)
            means[col].append(values.mean(0))
            band(axes[0, col], steps, values, setting.label, colors(i % 10))
            for row, clock in enumerate(clocks, start=1):
                if clock in x:
                    band(axes[row, col], x[clock], values, setting.label, colors(i % 10))
    names = (
        "held-out greedy accuracy",
        f"rollout reward (mean of {window} steps)" if window > 1 else "rollout reward",
    )
    for col, name in enumerate(names):
        axes[0, col].set_xlabel("RL step")
        axes[1, col].set_xlabel("generated tokens")
        axes[2, col].set_xlabel("RL-step minutes (no validation, start-up)")
        if means[col]:
            low, high = min(m.min() for m in means[col]), max(m.max() for m in means[col])
            pad = 0.15 * (high - low) or 0.05
            axes[0, col].set_ylim(low - pad, high + pad)
        for row in range(3):
            axes[row, col].set_ylabel(name)
            axes[row, col].grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"{title} (mean over seeds, band: 95% CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""A study part's plots: held-out accuracy against samples drawn and RL-step minutes (all datasets and
each), the length of wrong and correct rollout answers along training, and (`dynamics`) entropy, groups
without spread and gradient norm along training; the mean over seeds with its 95% band."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from loorl.research.curves import aligned, band
from loorl.research.jobs import cost_before
from loorl.research.study import Part
from loorl.research.study_tables import sources

STYLE = {"lw": 1.4, "alpha": 0.15}  # the study's curves: many settings on a panel, thinner than an ablation's


def plot_accuracy(part: Part, jobs, samples_per_step: dict[str, int], path: Path) -> None:
    """Held-out accuracy against samples drawn and against RL-step minutes (all datasets), and each
    dataset's against samples drawn: the mean over seeds with its 95% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sources(jobs)
    panels = 2 + len(names)
    cols = min(panels, 3)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.0 * rows), squeeze=False)
    axes = axes.ravel()
    colors = plt.get_cmap("tab10")
    for i, setting in enumerate(part.settings):
        runs = list(jobs[setting.label].values())
        if not runs:
            continue
        color = colors(i % 10)
        steps, acc = aligned(runs, "val/accuracy")
        band(
            axes[0],
            steps * samples_per_step[setting.label],
            acc,
            setting.label,
            color,
            **STYLE,
            bounds=(0, 1),
        )
        minutes = np.array([[cost_before(j.cumulative_step_seconds(), s) / 60 for s in steps] for j in runs])
        band(axes[1], minutes.mean(0), acc, setting.label, color, **STYLE, bounds=(0, 1))
        for k, name in enumerate(names):
            s, a = aligned(runs, f"val/accuracy/{name}")
            band(
                axes[2 + k],
                s * samples_per_step[setting.label],
                a,
                setting.label,
                color,
                **STYLE,
                bounds=(0, 1),
            )
    titles = ["all datasets", "all datasets"] + names
    xlabels = ["samples drawn", "RL-step minutes (mean over seeds)"] + ["samples drawn"] * len(names)
    for ax, title, xlabel in zip(axes, titles, xlabels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
    for ax in axes[panels:]:
        ax.axis("off")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{part.title} (mean over seeds, band: 95% CI)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_over_steps(part: Part, jobs, panels: list[tuple[str, str, str]], title: str, path: Path) -> None:
    """One panel per (metric key, panel title, y label): each setting's metric against the RL step, the
    mean over seeds with its 95% band (a setting whose runs lack the metric is left out of the panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    axes = axes.ravel()
    colors = plt.get_cmap("tab10")
    for i, setting in enumerate(part.settings):
        runs = list(jobs[setting.label].values())
        for ax, (key, _, _) in zip(axes, panels):
            if runs and all(j.history.get(key) for j in runs):
                steps, values = aligned(runs, key)
                band(ax, steps, values, setting.label, colors(i % 10), **STYLE)
    for ax, (_, panel, ylabel) in zip(axes, panels):
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title}: {part.title} (band: 95% CI over seeds)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_length(part: Part, jobs, path: Path) -> None:
    """The length of wrong and of correct rollout answers along training."""
    panels = [(f"rollout/completion_len_{v}", f"{v} answers", "mean completion length (tokens)")
              for v in ("wrong", "correct")]  # fmt: skip
    plot_over_steps(part, jobs, panels, "Length of rollout answers", path)


DYNAMICS = [  # what a part with `dynamics: true` plots along training
    ("train/entropy", "entropy of the trained tokens", "nats a token"),
    ("rollout/zero_std_group_frac", "groups without reward spread", "share of the step's groups"),
    ("train/grad_norm", "gradient norm (before clipping)", "L2 norm"),
]


def plot_dynamics(part: Part, jobs, path: Path) -> None:
    """Entropy, the share of groups without spread and the gradient norm along training."""
    plot_over_steps(part, jobs, DYNAMICS, "Exploration along training", path)

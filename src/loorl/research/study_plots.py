"""A study part's plots: held-out accuracy against samples drawn and RL-step minutes (all datasets and
each), the length of wrong and correct rollout answers along training, and (`dynamics`) entropy, groups
without spread and gradient norm along training; the mean over seeds with its 95% band."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loorl.research.curves import aligned, band
from loorl.research.jobs import cost_before
from loorl.research.study import Part
from loorl.research.study_tables import sources

STYLE = {"lw": 1.4, "alpha": 0.15}  # the study's curves: many settings on a panel, thinner than an ablation's


@dataclass(frozen=True)
class Panel:
    """A plot along training: the metric, the panel's title and y label, the metric's range (the 95%
    band is clipped to it: an entropy or a norm is never negative, a share never above 1), log y."""

    key: str
    title: str
    ylabel: str
    bounds: tuple[float, float] = (0, math.inf)
    log: bool = False


def setting_colors(n: int):
    """A color per setting, none repeated: tab10 up to 10 settings, tab20 beyond (the exploration study
    has 13), cycling only past 20."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


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
    colors = setting_colors(len(part.settings))
    for i, setting in enumerate(part.settings):
        runs = list(jobs[setting.label].values())
        if not runs:
            continue
        color = colors[i]
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


def plot_over_steps(part: Part, jobs, panels: list[Panel], title: str, path: Path) -> None:
    """One panel per `Panel`: each setting's metric against the RL step, the mean over seeds with its
    95% band clipped to the metric's range (a setting whose runs lack the metric is left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    axes = axes.ravel()
    colors = setting_colors(len(part.settings))
    for i, setting in enumerate(part.settings):
        runs = list(jobs[setting.label].values())
        for ax, panel in zip(axes, panels):
            if runs and all(j.history.get(panel.key) for j in runs):
                steps, values = aligned(runs, panel.key)
                band(ax, steps, values, setting.label, colors[i], bounds=panel.bounds, **STYLE)
    for ax, panel in zip(axes, panels):
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel(panel.ylabel)
        if panel.log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()  # beside the panels, not over the curves
    fig.legend(handles, labels, loc="center right", fontsize=7)
    fig.suptitle(f"{title}: {part.title} (band: 95% CI over seeds)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_length(part: Part, jobs, path: Path) -> None:
    """The length of wrong and of correct rollout answers along training."""
    panels = [Panel(f"rollout/completion_len_{v}", f"{v} answers", "mean completion length (tokens)")
              for v in ("wrong", "correct")]  # fmt: skip
    plot_over_steps(part, jobs, panels, "Length of rollout answers", path)


DYNAMICS = [  # what a part with `dynamics: true` plots along training
    # log scale: the collapse is from ~1 nat to 0.03-0.15, where the settings differ
    Panel(
        "train/entropy", "entropy of the trained tokens (log scale)", "nats a token", (1e-3, math.inf), True
    ),
    Panel(
        "rollout/zero_std_group_frac", "groups without reward spread", "share of the step's groups", (0, 1)
    ),
    Panel("train/grad_norm", "gradient norm (before clipping)", "L2 norm"),
]


def plot_dynamics(part: Part, jobs, path: Path) -> None:
    """Entropy, the share of groups without spread and the gradient norm along training."""
    plot_over_steps(part, jobs, DYNAMICS, "Exploration along training", path)

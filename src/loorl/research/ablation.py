"""From finished Hydra multirun folders to an answer: a table with confidence intervals and curves.

The jobs are read back and grouped into settings by `loorl.research.jobs` (by their overrides, leaving
out `seed` and the overrides every job shares), each job's numbers are `loorl.research.job_metrics`'s,
and the curves `loorl.research.ablation_plots`'. Each setting's numbers are the mean over its seeds
with a two-sided 95% Student-t confidence interval (mean +- t(0.975, n-1) * sd / sqrt(n); none with a
single seed).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from loorl.research.ablation_plots import plot_curves
from loorl.research.job_metrics import REACH_LEVELS, job_metrics, reach_metrics
from loorl.research.jobs import Setting, group_settings, read_jobs
from loorl.research.stats import mean_ci

log = logging.getLogger(__name__)


COLUMNS = {  # metric -> (column title, format)
    "first_accuracy": ("first acc. (%)", "pct"),
    "final_accuracy": ("final acc. (%)", "pct"),
    "best_accuracy": ("best acc. (%)", "pct"),
    "accuracy_auc": ("acc. AUC (%)", "pct"),
    "first_tool_use": ("tool use first (%)", "pct"),
    "final_tool_use": ("tool use final (%)", "pct"),
    "final_reward": ("final reward", ".3f"),
    "kl": ("KL", ".4f"),
    "gen_tokens": ("gen. tokens", ",.0f"),
    "wall_seconds": ("wall (s)", ".0f"),
    "step_seconds": ("s/step", ".2f"),
    "peak_host_gib": ("peak RSS (GiB)", ".2f"),
    "checkpoint_mb": ("checkpoint (MB)", ",.1f"),
}


WHEN_LOGGED = ("first_tool_use", "final_tool_use")  # columns shown only where some job logged them


REACH_LEVEL_COLUMNS = {  # reach_metrics of reaching a level -> (column title, format)
    f"{what}_to_{round(level * 100)}": (f"{title} to {round(level * 100)}%", fmt)
    for level in REACH_LEVELS
    for what, title, fmt in (
        ("step", "steps", ".1f"),
        ("tokens", "gen. tokens", ",.0f"),
        ("seconds", "RL-step s", ".0f"),
    )
}
REACH_COLUMNS = {  # reach_metrics -> (column title, format)
    **REACH_LEVEL_COLUMNS,
    "rounds": ("rounds/step", ".2f"),
    "signal_groups": ("groups with signal/step", ".1f"),
}


def _cell(mean: float, half: float, fmt: str) -> str:
    if math.isnan(mean):
        return "n/a"
    scale, fmt = (100.0, ".1f") if fmt == "pct" else (1.0, fmt)
    text = format(mean * scale, fmt)
    return text if math.isnan(half) else f"{text} ± {format(half * scale, fmt)}"


def summarize(settings: list[Setting]) -> list[dict]:
    """Per setting: the seed count and each metric's (mean, 95% half-width), plus per-seed values
    (`metrics`: the first table's, `reach`: the second's; a reach mean is over the seeds that got there,
    `reached` says how many)."""
    rows = []
    for setting in settings:
        row = {"setting": setting.label, "seeds": sorted(j.seed for j in setting.jobs)}
        for part, columns, compute in (
            ("metrics", COLUMNS, job_metrics),
            ("reach", REACH_COLUMNS, reach_metrics),
        ):
            per_job = [compute(j) for j in setting.jobs]
            row[part] = {}
            for name in columns:
                values = [m[name] for m in per_job]
                mean, half = mean_ci(values)
                reached = sum(not math.isnan(v) for v in values)
                row[part][name] = {"mean": mean, "ci95": half, "values": values, "reached": reached}
        rows.append(row)
    return rows


def shown_columns(rows: list[dict]) -> dict[str, tuple[str, str]]:
    """COLUMNS without those of WHEN_LOGGED that no job logged (the tool-use share of runs without tools)."""
    return {
        name: column
        for name, column in COLUMNS.items()
        if name not in WHEN_LOGGED or any(row["metrics"][name]["reached"] for row in rows)
    }


def markdown_table(rows: list[dict], *, title: str, note: str = "") -> str:
    columns = shown_columns(rows)
    head = ["setting", "seeds"] + [title_ for title_, _ in columns.values()]
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        cells = [row["setting"], str(len(row["seeds"]))]
        cells += [
            _cell(row["metrics"][k]["mean"], row["metrics"][k]["ci95"], fmt)
            for k, (_, fmt) in columns.items()
        ]
        lines.append("| " + " | ".join(cells) + " |")
    tool_use = (
        "tool use: the share of greedy held-out answers that called a tool (first and last validation); "
        if "first_tool_use" in columns
        else ""
    )
    lines += [
        "",
        "Mean ± half-width of the 95% Student-t confidence interval over seeds. Accuracy: greedy on the "
        "held-out split (first: before training, final: the last validation, best: the highest, AUC: "
        f"the mean along training); {tool_use}"
        "reward: the mean of the last steps' rollouts; KL: to the reference at the last step; "
        "gen. tokens: completion tokens generated over the run; s/step: the median RL step; peak RSS: the "
        "process's peak resident host memory during the run; checkpoint: last.ckpt (n/a: none kept).",
    ]
    lines += ["", *reach_table(rows)]
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def reach_table(rows: list[dict]) -> list[str]:
    """The second table: how soon each setting got to REACH_LEVELS (markdown lines)."""
    head = ["setting"] + [title for title, _ in REACH_COLUMNS.values()]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        cells = [row["setting"]]
        for name, (_, fmt) in REACH_COLUMNS.items():
            metric, n = row["reach"][name], len(row["seeds"])
            cell = _cell(metric["mean"], metric["ci95"], fmt)
            partial = name in REACH_LEVEL_COLUMNS and 0 < metric["reached"] < n  # a seed may never get there
            cells.append(f"{cell} ({metric['reached']} of {n} seeds)" if partial else cell)
        lines.append("| " + " | ".join(cells) + " |")
    levels = " and ".join(f"{round(level * 100)}%" for level in REACH_LEVELS)
    return lines + [
        "",
        f"Reaching {levels} held-out accuracy: the first validation at or above it, as the RL step, the "
        "completion tokens generated before it and the seconds of RL steps before it (rollout and "
        "update, without validation, start-up or checkpoints); a mean over the seeds that reached it "
        "(n/a: none did). Rounds: sampling rounds per step under dynamic sampling (n/a: off); groups with "
        "signal: trained groups per step whose rewards had a spread (all ranks).",
    ]


def write_report(sweep_dirs: list[Path], out: Path, *, title: str, note: str = "") -> list[dict]:
    """`table.md`, `table.json` and `curves.png` in `out` from the jobs under `sweep_dirs`."""
    jobs, unfinished = read_jobs(sweep_dirs)
    if not jobs:
        raise FileNotFoundError(f"no finished runs (metrics.json) under {', '.join(map(str, sweep_dirs))}")
    if unfinished:
        note = (
            (note + "\n\n" if note else "")
            + f"{len(unfinished)} job(s) without results left out: "
            + ", ".join(str(p) for p in unfinished)
        )
        log.warning("%d job folder(s) without metrics.json left out", len(unfinished))
    settings = group_settings(jobs)
    rows = summarize(settings)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(markdown_table(rows, title=title, note=note))
    (out / "table.json").write_text(json.dumps(rows, indent=1))
    plot_curves(settings, out / "curves.png", title=title)
    return rows

"""From finished Hydra multirun folders to an answer: a table with confidence intervals and curves.

A job folder (`<sweep>/<n>/`) holds `.hydra/overrides.yaml` (what the job set), `config.yaml` and
`metrics.json` (`RunSummary`: the summary and every metric's history). Jobs are grouped into
settings by their overrides, leaving out `seed` and the overrides every job shares; each setting's
numbers are the mean over its seeds with a two-sided 95% Student-t confidence interval
(mean +- t(0.975, n-1) * sd / sqrt(n); none with a single seed).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from loorl.research.curves import aligned, band
from loorl.research.stats import mean_ci

log = logging.getLogger(__name__)

SEED_KEYS = ("seed",)
# overrides that change how a run looks, not what it computes: never a setting of their own
COSMETIC_KEYS = ("trainer.enable_progress_bar",)
REACH_LEVELS = (0.70, 0.80)  # held-out accuracies whose first reaching the second table reports


@dataclass
class Job:
    path: Path
    overrides: list[str]  # as given to the job (`estimator=rloo`, `seed=1`, ...)
    seed: int
    summary: dict
    history: dict[str, list[tuple[int, float]]]
    config: dict

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of a metric's history."""
        points = self.history.get(key, [])
        return np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)

    def cumulative_tokens(self) -> np.ndarray:
        """Generated tokens up to and including each RL step's rollout, [steps]."""
        steps, tokens = self.series("rollout/gen_tokens")
        if not len(tokens):  # a run from before rollout/gen_tokens: mean length x samples per step
            steps, length = self.series("rollout/completion_len")
            rl = self.config.get("rl", {})
            tokens = length * rl.get("prompts_per_step", 0) * rl.get("samples_per_prompt", 0)
        return np.cumsum(tokens[np.argsort(steps)])

    def cumulative_step_seconds(self) -> np.ndarray:
        """Seconds of RL steps (rollout and update; no validation, start-up or checkpoint) up to and
        including each step, [steps]: the clock two settings are compared on."""
        steps, seconds = self.series("perf/step_seconds")
        return np.cumsum(seconds[np.argsort(steps)])


def cost_before(cumulative: np.ndarray, step: float) -> float:
    """A cumulative count (tokens, seconds) over the rollouts before `step`: what the policy validated
    at `step` (after `step` updates) had cost."""
    if step == 0 or not len(cumulative):
        return 0.0 if step == 0 else float("nan")
    return float(cumulative[min(int(step) - 1, len(cumulative) - 1)])


def cost_through(cumulative: np.ndarray, step: float) -> float:
    """A cumulative count over the rollouts up to and including `step`: what step `step`'s own
    rollout (its reward) had cost."""
    return float(cumulative[min(int(step), len(cumulative) - 1)])


@dataclass
class Setting:
    label: str
    jobs: list[Job] = field(default_factory=list)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def read_jobs(sweep_dirs: list[Path]) -> tuple[list[Job], list[Path]]:
    """The finished jobs under the sweep folders (in job order), and the job folders without results."""
    jobs, unfinished = [], []
    for sweep in sweep_dirs:
        found = Path(sweep).rglob(".hydra/overrides.yaml")
        for overrides_file in sorted(found, key=lambda f: _numeric_parts(f.relative_to(sweep))):
            folder = overrides_file.parent.parent
            metrics = folder / "metrics.json"
            if not metrics.is_file():
                unfinished.append(folder)
                continue
            overrides = [str(o) for o in yaml.safe_load(overrides_file.read_text()) or []]
            data = json.loads(metrics.read_text())
            config_file = folder / "config.yaml"
            config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
            seed = next((int(o.split("=", 1)[1]) for o in overrides if _key(o) in SEED_KEYS), 0)
            history = {k: [tuple(p) for p in v] for k, v in data["history"].items()}
            jobs.append(Job(folder, overrides, seed, data["summary"], history, config or {}))
    return jobs, unfinished


def _numeric_parts(path: Path) -> tuple:
    """A sort key that puts Hydra's job folders 0, 1, ..., 10 in numeric order."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts)


def group_settings(jobs: list[Job]) -> list[Setting]:
    """Jobs grouped by their overrides without the seed and without what every job shares; settings in
    the order their first job ran. A setting's label is its distinguishing overrides (the value
    alone when one key varies)."""
    shared = set.intersection(*(set(j.overrides) for j in jobs)) if jobs else set()
    ignored = SEED_KEYS + COSMETIC_KEYS
    settings: dict[tuple, Setting] = {}
    varying_keys = {_key(o) for j in jobs for o in j.overrides if o not in shared and _key(o) not in ignored}
    for job in jobs:
        own = tuple(o for o in job.overrides if o not in shared and _key(o) not in ignored)
        if own not in settings:
            parts = [o.split("=", 1)[1] if len(varying_keys) == 1 else o.lstrip("+") for o in own]
            settings[own] = Setting(", ".join(parts) or ("(no override)" if varying_keys else "(all runs)"))
        settings[own].jobs.append(job)
    return list(settings.values())


# ---- statistics ----------------------------------------------------------------------------------
def accuracy_auc(steps: np.ndarray, acc: np.ndarray) -> float:
    """Area under the held-out accuracy curve over the run, divided by its length in steps: the mean
    accuracy along training (rewards learning early, not only where it ends)."""
    if len(steps) < 2:
        return float(acc[0]) if len(acc) else float("nan")
    order = np.argsort(steps)
    s, a = steps[order], acc[order]
    return float(np.sum((a[1:] + a[:-1]) / 2 * np.diff(s)) / (s[-1] - s[0]))


def first_and_last(job: Job, key: str) -> tuple[float, float]:
    """A metric's value at its first and at its last logged step (NaN where it was never logged)."""
    steps, values = job.series(key)
    if not len(values):
        return float("nan"), float("nan")
    return float(values[np.argmin(steps)]), float(values[np.argmax(steps)])


def job_metrics(job: Job) -> dict[str, float]:
    steps, acc = job.series("val/accuracy")
    s, tokens = job.summary, job.cumulative_tokens()
    first_accuracy, final_accuracy = first_and_last(job, "val/accuracy")
    first_tool_use, final_tool_use = first_and_last(job, "val/tool_used_frac")
    return {
        "first_accuracy": first_accuracy,
        "final_accuracy": final_accuracy,
        "best_accuracy": float(acc.max()) if len(acc) else float("nan"),
        "accuracy_auc": accuracy_auc(steps, acc),
        "first_tool_use": first_tool_use,
        "final_tool_use": final_tool_use,
        "final_reward": float(s.get("reward_last", float("nan"))),
        "kl": float(s.get("kl_last", float("nan"))),
        "gen_tokens": float(tokens[-1]) if len(tokens) else float("nan"),
        "wall_seconds": float(s.get("wall_seconds", float("nan"))),
        "step_seconds": float(s.get("step_seconds", float("nan"))),
        "peak_host_gib": float(s.get("peak_host_gib", float("nan"))),
        "checkpoint_mb": checkpoint_bytes(job.path / "checkpoints" / "last.ckpt") / 1e6,
    }


def reach(
    job: Job, level: float, tokens: np.ndarray | None = None, seconds: np.ndarray | None = None
) -> dict[str, float]:
    """When the run's held-out accuracy first reached `level`: the validated step, the generated tokens
    and the RL-step seconds spent before it; NaN for each if it never did. `tokens` and `seconds` are
    the job's cumulative counts, computed here when not given."""
    steps, acc = job.series("val/accuracy")
    order = np.argsort(steps)
    reached = steps[order][acc[order] >= level - 1e-6]  # a float32 0.7 is logged as 0.699999988
    if not len(reached):
        return {"step": float("nan"), "tokens": float("nan"), "seconds": float("nan")}
    step = float(reached[0])
    tokens = job.cumulative_tokens() if tokens is None else tokens
    seconds = job.cumulative_step_seconds() if seconds is None else seconds
    return {"step": step, "tokens": cost_before(tokens, step), "seconds": cost_before(seconds, step)}


def reach_metrics(job: Job) -> dict[str, float]:
    """The second table's numbers for a job: reaching each of REACH_LEVELS, and the dynamic sampling
    rounds and trained groups with signal per step (NaN for runs without it)."""
    out = {}
    tokens, seconds = job.cumulative_tokens(), job.cumulative_step_seconds()
    for level in REACH_LEVELS:
        for what, value in reach(job, level, tokens, seconds).items():
            out[f"{what}_to_{round(level * 100)}"] = value
    rounds, signal = job.series("dynamic/rounds")[1], job.series("dynamic/groups_with_signal")[1]
    if not len(signal):  # without dynamic sampling: the groups whose rewards had a spread
        prompts = job.config.get("rl", {}).get("prompts_per_step", float("nan"))
        signal = (1 - job.series("rollout/zero_std_group_frac")[1]) * prompts
    out["rounds"] = float(rounds.mean()) if len(rounds) else float("nan")
    out["signal_groups"] = float(signal.mean()) if len(signal) else float("nan")
    return out


def checkpoint_bytes(path: Path) -> float:
    """The size of a checkpoint: a file (one process) or a folder of shards (FSDP); NaN if none."""
    if path.is_file():
        return float(path.stat().st_size)
    if path.is_dir():
        return float(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
    return float("nan")


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


# ---- curves --------------------------------------------------------------------------------------
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

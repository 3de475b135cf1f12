"""A finished job's numbers: the accuracy curve's area and ends, when it first reached a level (in
steps, generated tokens and RL-step seconds), dynamic sampling's rounds, and its checkpoint's size."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loorl.research.jobs import Job, cost_before

REACH_LEVELS = (0.70, 0.80)  # held-out accuracies whose first reaching the second table reports


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

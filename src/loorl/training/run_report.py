"""What `RunSummary` writes from the figures it collected: `summary.md`'s table (`summary_markdown`,
with the memory by phase, `phase_memory_table`) and `learning_curve.png` (`plot_learning_curve`)."""

from __future__ import annotations

import math
from pathlib import Path

from loorl.util.profiling import PHASES

PLOTTED = ("rollout/reward", "val/accuracy")
MEMORY_PHASES = tuple(p for p in PHASES if p != "other")  # the PhaseClock's phases, each with its peak


def finite_mean(values: list[float]) -> float:
    """The mean of the values that are not NaN (NaN where none is)."""
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def peak_memory_text(host_gib: float, cuda_gib: float) -> str:
    """`2.10 GiB resident on the host`, plus `; 30.50 GiB allocated on CUDA` where CUDA was used."""
    text = f"{host_gib:.2f} GiB resident on the host"
    return text if math.isnan(cuda_gib) else f"{text}; {cuda_gib:.2f} GiB allocated on CUDA"


def phase_memory_table(s: dict[str, float]) -> list[str]:
    """The summary's memory by phase as markdown lines ([] when no phase was measured): each phase's
    peak and its rise over what was in use when it started, the largest over steps
    (`loorl.util.peak_memory`). The CUDA columns only where CUDA was used."""
    phases = [p for p in MEMORY_PHASES if not math.isnan(s[f"{p}_peak_host_gib"])]
    if not phases:
        return []
    keys = ["peak_host", "rise_host"]
    if any(not math.isnan(s[f"{p}_peak_cuda_gib"]) for p in phases):
        keys += ["peak_cuda", "rise_cuda"]
    names = {"peak_host": "host peak", "rise_host": "host rise", "peak_cuda": "CUDA peak",
             "rise_cuda": "CUDA rise"}  # fmt: skip
    lines = ["", "Memory by phase, GiB (resident on the host, allocated on CUDA; the largest over steps; "
             "rise: above what was in use when the phase started):", ""]  # fmt: skip
    lines += ["| phase | " + " | ".join(names[k] for k in keys) + " |", "| --- |" + " --- |" * len(keys)]
    for p in phases:
        lines.append(f"| {p} | " + " | ".join(f"{s[f'{p}_{k}_gib']:.3f}" for k in keys) + " |")
    return lines


def summary_markdown(
    s: dict[str, float],
    *,
    title: str,
    pass_k: int,
    history: dict[str, list[tuple[int, float]]],
    facts: dict[str, str],
) -> str:
    """summary.md: `s` (`RunSummary.summary`'s figures) as a markdown table, with rows per source,
    curriculum level, dynamic sampling and tools where `history` (the per-step metrics) has them,
    `facts` as they are, and the memory by phase below it."""

    def series(key: str) -> list[float]:
        return [v for _, v in history.get(key, [])]

    def pct(x):
        return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"

    def num(x, fmt=".3f"):
        return "n/a" if math.isnan(x) else format(x, fmt)

    rows = [
        ("RL steps (optimizer steps)", f"{s['rl_steps']} ({s['optimizer_steps']})"),
        (
            "held-out greedy accuracy",
            f"{pct(s['val_accuracy_start'])} -> {pct(s['val_accuracy_end'])} "
            f"(best {pct(s['val_accuracy_best'])})",
        ),  # fmt: skip
    ]
    if pass_k:  # val_pass_k=0: not measured, no rows
        for name, key in (("pass", "val_pass_at_k"), ("maj", "val_maj_at_k")):
            rows.append(
                (
                    f"held-out {name}@{pass_k} (sampled)",
                    f"{pct(s[key + '_start'])} -> {pct(s[key + '_end'])}",
                )
            )
    sources = sorted(k.removeprefix("val/accuracy/") for k in history if k.startswith("val/accuracy/"))
    for metric in sorted(k for k in history if k.startswith("curriculum/level/")):
        source, levels = metric.removeprefix("curriculum/level/"), series(metric)
        if source not in sources:  # a task of one source (task=arithmetic's curriculum): its level alone
            span = f"{levels[0]:.0f} -> {levels[-1]:.0f}"
            rows.append((f"{source}: curriculum level (first -> last steps)", span))
    for source in sources:
        acc = series(f"val/accuracy/{source}")
        reward = series(f"rollout/reward/{source}")
        levels = series(f"curriculum/level/{source}")  # task.curriculum: first and last levels
        if not reward and not levels:  # a held-out set no rollout draws from (task.eval_levels')
            rows.append((f"{source}: held-out accuracy (held out only)", f"{pct(acc[0])} -> {pct(acc[-1])}"))
            continue
        window = max(1, min(10, len(reward) // 5))
        label = f"{source}: held-out accuracy; reward (first -> last steps)" + ("; level" if levels else "")
        first, last = num(finite_mean(reward[:window])), num(finite_mean(reward[-window:]))
        value = f"{pct(acc[0])} -> {pct(acc[-1])}; {first} -> {last}"
        rows.append((label, value + (f"; {levels[0]:.0f} -> {levels[-1]:.0f}" if levels else "")))
    rows += [
        ("reward (first -> last steps)", f"{num(s['reward_first'])} -> {num(s['reward_last'])}"),
        ("KL to reference (last step)", num(s["kl_last"], ".4f")),
        ("generated tokens", f"{s['gen_tokens']:,.0f}"),
        ("wall time", f"{s['wall_seconds']:.1f} s"),
        ("generation tokens/s", num(s["gen_tokens_per_s"], ".0f")),
        ("training tokens/s", num(s["train_tokens_per_s"], ".0f")),
        ("peak memory", peak_memory_text(s["peak_host_gib"], s["peak_cuda_gib"])),
    ]
    if not math.isnan(s["dynamic_rounds_mean"]):
        rounds, signal = s["dynamic_rounds_mean"], s["dynamic_groups_with_signal_mean"]
        value = f"{rounds:.2f} rounds; {signal:.1f} groups with signal, "
        value += f"{s['dynamic_filler_groups_mean']:.1f} without (the rounds ran out)"
        rows.append(("dynamic sampling (per step, mean)", value))
    if not math.isnan(s["tools_calls_per_sample_mean"]):
        value = (
            f"{s['tools_calls_per_sample_mean']:.2f} calls and {s['tools_turns_per_sample_mean']:.2f} "
            f"turns per sample, {100 * s['tools_used_frac_mean']:.1f}% of samples called one; per step "
            f"{s['tools_errors_mean']:.1f} errors, {s['tools_timeouts_mean']:.1f} time-outs, "
            f"{s['tools_seconds_mean']:.2f} tool s, {s['tools_inserted_tokens_mean']:,.0f} tokens "
            "inserted"
        )
        rows.append(("tools (rollouts, mean)", value))
    rows += list(facts.items())
    if not math.isnan(s["step_seconds"]):
        parts = ", ".join(f"{p} {s[p + '_seconds']:.2f}" for p in PHASES if not math.isnan(s[p + "_seconds"]))
        rows.append(("seconds per step (median): whole; phases", f"{s['step_seconds']:.2f}; {parts}"))
    lines = [f"## {title}", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines + phase_memory_table(s)) + "\n"


def plot_learning_curve(history: dict[str, list[tuple[int, float]]], path: Path, *, title: str) -> None:
    """learning_curve.png: the rollout reward and the held-out accuracy over RL steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in zip(PLOTTED, ("-", "o-")):
        points = history.get(key, [])
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=key, markersize=3)
    ax.set_xlabel("RL step (policy updates so far)")
    ax.set_ylabel("reward / accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

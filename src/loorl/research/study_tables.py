"""A study part's tables, from its finished runs: the summary of each setting over seeds, the paired
comparisons it names (Holm-adjusted across each table), the training levels of a curriculum, the
gradient norms before clipping, and the length of correct and wrong answers along training. Each
returns its markdown lines (and, where the report keeps them, the numbers)."""

from __future__ import annotations

import math

import numpy as np

from loorl.research.job_metrics import accuracy_auc, first_and_last
from loorl.research.jobs import Job
from loorl.research.stats import holm, mean_ci, paired_difference
from loorl.research.study import Part

LENGTH_WINDOW = 10  # steps averaged at the start and at the end of training for the length table


def sources(jobs: dict[str, dict[int, Job]]) -> list[str]:
    """The datasets of a mixed task, from the runs' per-dataset validation keys."""
    names = set()
    for by_seed in jobs.values():
        for job in by_seed.values():
            names |= {k.split("/", 2)[2] for k in job.history if k.startswith("val/accuracy/")}
    return sorted(names)


def run_metrics(job: Job, names: list[str]) -> dict[str, float]:
    steps, acc = job.series("val/accuracy")
    first, final = first_and_last(job, "val/accuracy")
    out = {"first": first, "final": final, "auc": accuracy_auc(steps, acc)}
    for name in names:
        out[f"final/{name}"] = first_and_last(job, f"val/accuracy/{name}")[1]
        s, a = job.series(f"val/accuracy/{name}")
        out[f"auc/{name}"] = accuracy_auc(s, a) if len(a) else math.nan
    out["step_minutes"] = float(job.cumulative_step_seconds()[-1] / 60) if job.history else math.nan
    out["wall_minutes"] = float(job.summary.get("wall_seconds", math.nan)) / 60
    return out


def per_seed(jobs: dict[int, Job], seeds: list[int], names: list[str]) -> dict[str, list[float]]:
    """metric -> [value of seed i] (NaN for a seed without a run), in `seeds` order."""
    rows = [run_metrics(jobs[s], names) if s in jobs else None for s in seeds]
    keys = next((r.keys() for r in rows if r), [])
    return {k: [r[k] if r else math.nan for r in rows] for k in keys}


def mean_pm(mean: float, half: float, *, scale: float = 1.0, digits: int = 1) -> str:
    """`mean ± half` (each times `scale`, to `digits` decimals); the mean alone without a half-width,
    `n/a` without a mean."""
    if math.isnan(mean):
        return "n/a"
    return f"{scale * mean:.{digits}f}" + ("" if math.isnan(half) else f" ± {scale * half:.{digits}f}")


def in_points(mean: float, half: float) -> str:
    """An accuracy's mean ± half-width in points (`n/a` where there is none)."""
    return mean_pm(mean, half, scale=100)


def summary_table(part: Part, jobs: dict[str, dict[int, Job]]) -> tuple[list[str], dict]:
    names = sources(jobs)
    head = ["setting", "seeds", "first acc.", "final acc.", "acc. AUC"]
    head += [f"final {n}" for n in names] + ["RL-step min", "wall min"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    data = {}
    for setting in part.settings:
        values = per_seed(jobs[setting.label], part.seeds, names)
        data[setting.label] = values
        if not values:
            lines.append(f"| {setting.label} | 0 |" + " n/a |" * (len(head) - 2))
            continue
        n = sum(not math.isnan(v) for v in values["final"])
        cells = [setting.label, str(n)]
        cells += [in_points(*mean_ci(values[k])) for k in ("first", "final", "auc")]
        cells += [in_points(*mean_ci(values[f"final/{name}"])) for name in names]
        for key in ("step_minutes", "wall_minutes"):
            mean, half = mean_ci(values[key])
            cells.append(f"{mean:.1f}" + ("" if math.isnan(half) else f" ± {half:.1f}"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Held-out greedy accuracy in points, mean ± half-width of the 95% Student-t interval over seeds: "
        "first (before RL), final (the last validation), AUC (the mean along training, validations "
        "every few steps)" + (f"; final per dataset ({', '.join(names)})" if names else "") + ". RL-step "
        "minutes: rollout and update only; wall: the whole run with start-up and validation.",
    ]
    return lines, data


def metric_title(metric: str) -> str:
    """A compared metric's name in the tables: final, auc, final/<dataset> or auc/<dataset>."""
    kind, _, name = metric.partition("/")
    if not name:
        return {"final": "final acc.", "auc": "acc. AUC"}[kind]
    return f"{'final' if kind == 'final' else 'AUC'} {name}"


def comparison_table(
    part: Part,
    data: dict,
    metrics=None,
    *,
    scale=100.0,
    unit="points",
):
    """The part's paired comparisons, a - b per seed, for each metric ((key, title) pairs; default: the
    part's `metrics`); Holm-adjusted over the table. Values are shown times `scale` (accuracy fractions
    in points), in `unit`."""
    if metrics is None:
        metrics = [(m, metric_title(m)) for m in part.metrics]
    rows = []
    for a, b in part.comparisons:
        for key, title in metrics:
            if not data.get(a) or not data.get(b) or key not in data[a] or key not in data[b]:
                continue
            difference = paired_difference(data[a][key], data[b][key])
            if difference.n:  # a setting without runs yet has no row
                rows.append((a, b, title, difference))
    adjusted = holm([r[3].p for r in rows])
    head = f"| a - b | metric | difference ({unit}) | 95% CI | p | p (Holm) | a won, tied, lost |"
    lines = [head, "|" + " --- |" * 7]
    records = []
    for (a, b, title, d), p_holm in zip(rows, adjusted):
        ci = "n/a" if math.isnan(d.low) else f"[{scale * d.low:+.1f}, {scale * d.high:+.1f}]"
        p = "n/a" if math.isnan(d.p) else f"{d.p:.3f}"
        ph = "n/a" if math.isnan(p_holm) else f"{p_holm:.3f}"
        lines.append(
            f"| {a} - {b} | {title} | {scale * d.mean:+.1f} | {ci} | {p} | {ph} "
            f"| {d.wins}, {d.ties}, {d.losses} |"
        )
        records.append({"a": a, "b": b, "metric": title, **d.as_dict(), "p_holm": p_holm})
    lines += [
        "",
        "Paired over seeds (run i of both settings shares seed i: "
        + (
            "its warm start and its prompts, in the same order"
            if part.pairing == "prompts"
            else "its starting policy and its RL seed; the problems differ by design"
        )
        + "): the mean per-seed difference, its 95% Student-t interval and the two-sided paired "
        "t-test's p; Holm's adjustment across every row of this table.",
    ]
    return lines, records


def level_table(part: Part, jobs: dict[str, dict[int, Job]]) -> list[str]:
    """The training level of each dataset with a logged one (`curriculum/level/<name>`), per setting and
    seed: its last value and the steps it first reached each higher level. Empty without levels; one
    line where no run's level moved (fixed levels: a row per run would say nothing)."""
    lines, fixed = [], {}  # fixed: dataset -> the levels it trained at, while nothing moved
    moved = False
    for setting in part.settings:
        for seed, job in sorted(jobs[setting.label].items()):
            for key in sorted(k for k in job.history if k.startswith("curriculum/level/")):
                steps, levels = job.series(key)
                order = np.argsort(steps)
                steps, levels = steps[order], levels[order].astype(int)
                reached = [f"L{lv} at step {int(steps[np.argmax(levels >= lv)])}"
                           for lv in range(int(levels[0]) + 1, int(levels.max()) + 1)]  # fmt: skip
                name = key.split("/", 2)[2]
                moved |= bool(reached) or levels[-1] != levels[0]
                fixed.setdefault(name, set()).add(int(levels[0]))
                lines.append(
                    f"| {setting.label} | {seed} | {name} | L{levels[0]} | L{levels[-1]} "
                    f"| {', '.join(reached) or 'never moved'} |"
                )
    if not lines:
        return []
    if not moved:
        held = ", ".join(f"{name} L{'/L'.join(map(str, sorted(lv)))}" for name, lv in sorted(fixed.items()))
        return [f"Training levels (`curriculum/level/<dataset>`): fixed in every run: {held}."]
    head = ["| setting | seed | dataset | first level | last level | levels reached |", "|" + " --- |" * 6]
    return (
        head
        + lines
        + [
            "",
            "The level each dataset trained at (`curriculum/level/<dataset>`, logged every RL step): at the "
            "first and the last step, and the step each higher level was first reached.",
        ]
    )


def length_data(part: Part, jobs) -> dict[str, dict[str, list[float]]]:
    """label -> per seed: the mean length (tokens) of wrong and of correct answers over the first and the
    last LENGTH_WINDOW steps, and the wrong answers' change."""
    out = {}
    for setting in part.settings:
        values = {k: [] for k in ("wrong_start", "wrong_end", "wrong_change", "correct_start", "correct_end")}
        for seed in part.seeds:
            job = jobs[setting.label].get(seed)
            for verdict in ("wrong", "correct"):
                steps, length = job.series(f"rollout/completion_len_{verdict}") if job else ([], [])
                if len(length):
                    order = np.argsort(steps)
                    start, end = length[order][:LENGTH_WINDOW].mean(), length[order][-LENGTH_WINDOW:].mean()
                else:
                    start = end = math.nan
                values[f"{verdict}_start"].append(float(start))
                values[f"{verdict}_end"].append(float(end))
            values["wrong_change"].append(values["wrong_end"][-1] - values["wrong_start"][-1])
        out[setting.label] = values
    return out


def length_table(part: Part, data: dict) -> list[str]:
    head = "| setting | wrong, start | wrong, end | wrong, change | correct, start | correct, end |"
    lines = [head, "|" + " --- |" * 6]
    for setting in part.settings:
        v = data[setting.label]
        cells = []
        for key in ("wrong_start", "wrong_end", "wrong_change", "correct_start", "correct_end"):
            cells.append(mean_pm(*mean_ci(v[key])))
        lines.append(f"| {setting.label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Mean completion length in tokens of the wrong and of the correct rollout samples, over the first "
        f"and the last {LENGTH_WINDOW} RL steps; mean ± 95% interval over seeds.",
    ]
    return lines


def grad_norm_table(part: Part, jobs, clip: dict) -> list[str]:
    """Per setting: the gradient norm before clipping (`train/grad_norm`) over every step of every seed,
    and the share of steps it was clipped (above `loss.max_grad_norm`)."""
    lines = [
        "| setting | grad norm: median | min | max | steps clipped (loss.max_grad_norm) |",
        "|" + " --- |" * 5,
    ]
    for setting in part.settings:
        norms = [v for job in jobs[setting.label].values() for _, v in job.history.get("train/grad_norm", [])]
        if not norms:
            continue
        limit = clip[setting.label]
        share = (
            "never clipped"
            if limit is None
            else f"{100 * np.mean(np.array(norms) > limit):.0f}% (at {limit:g})"
        )
        lines.append(
            f"| {setting.label} | {np.median(norms):.3g} | {min(norms):.3g} | {max(norms):.3g} | {share} |"
        )
    return lines + [
        "",
        "The gradient's norm before clipping, over every RL step of every seed. Adam is blind to a "
        "constant scale of the gradient but not to clipping: a setting clipped at every step feeds Adam "
        "gradients of one norm, one never clipped feeds them in the proportions they come in.",
    ]


def window_mean(history: dict, key: str, *, from_share: float) -> float:
    """The mean of `key` over the run's steps from `from_share` of the way on (0.5: the second half);
    NaN where the run never logged it."""
    points = history.get(key) or []
    if not points:
        return float("nan")
    last = max(step for step, _ in points)
    return float(np.mean([v for step, v in points if step >= from_share * (last + 1)]))


DYNAMICS_WINDOWS = (  # (metric, where the window starts, its column): where the recipe has collapsed
    ("train/entropy", 2 / 3, "entropy, last third of the steps (nats a token)"),
    ("rollout/zero_std_group_frac", 1 / 3, "groups without spread, after the first third (%)"),
)


def dynamics_table(part: Part, jobs: dict[str, dict[int, Job]]) -> tuple[list[str], dict]:
    """Per setting, each `DYNAMICS_WINDOWS` metric's mean over its window, mean ± 95% interval over the
    seeds: how far entropy fell and how many groups stayed without a learning signal."""
    header = "| setting | seeds | " + " | ".join(title for _, _, title in DYNAMICS_WINDOWS) + " |"
    lines, data = [header, "|" + " --- |" * (2 + len(DYNAMICS_WINDOWS))], {}
    for setting in part.settings:
        runs = list(jobs[setting.label].values())
        if not runs:
            continue
        cells, data[setting.label] = [], {}
        for key, start, _ in DYNAMICS_WINDOWS:
            values = [window_mean(job.history, key, from_share=start) for job in runs]
            data[setting.label][key] = values
            scale, digits = (100, 1) if key.endswith("_frac") else (1, 3)
            cells.append(mean_pm(*mean_ci(values), scale=scale, digits=digits))
        lines.append(f"| {setting.label} | {len(runs)} | " + " | ".join(cells) + " |")
    note = ("Each run's mean over the window (the recipe's collapse is over by then), then the mean ± "
            "half-width of the 95% Student-t interval over the seeds.")  # fmt: skip
    return [*lines, "", note], data

"""A study's tables and plots, written from its finished runs (`scripts/study.py`): per part a summary of
each setting over seeds, the paired comparisons it names (with Holm's correction across them), the
accuracy curves against samples drawn and against RL-step minutes, and for the estimators the length of
correct and wrong answers along training. Nothing here is typed in by hand: the docs page includes
these files.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from loorl.research.ablation import Job, accuracy_auc, cost_before, first_and_last, read_jobs
from loorl.research.curves import aligned, band
from loorl.research.probe import read_results
from loorl.research.stats import holm, mean_ci, paired_difference
from loorl.research.study import Part, did_all_steps, probe_folder, run_dir

STYLE = {"lw": 1.4, "alpha": 0.15}  # the study's curves: many settings on a panel, thinner than an ablation's
LENGTH_WINDOW = 10  # steps averaged at the start and at the end of training for the length table


def part_jobs(out: Path, part: Part) -> dict[str, dict[int, Job]]:
    """label -> seed -> the finished run."""
    found = {}
    for setting in part.settings:
        jobs = {}
        for seed in part.seeds:
            run = read_jobs([run_dir(out, setting, seed)])[0]
            if run and did_all_steps(run[0].summary, setting.steps):  # a run stopped early is not tabulated
                jobs[seed] = replace(run[0], seed=seed)
        found[setting.label] = jobs
    return found


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


def _pts(mean: float, half: float) -> str:
    if math.isnan(mean):
        return "n/a"
    return f"{100 * mean:.1f}" + ("" if math.isnan(half) else f" ± {100 * half:.1f}")


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
        cells += [_pts(*mean_ci(values[k])) for k in ("first", "final", "auc")]
        cells += [_pts(*mean_ci(values[f"final/{name}"])) for name in names]
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


# ---- curves -----------------------------------------------------------------------------------------
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


# ---- length of correct and wrong answers ------------------------------------------------------------
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
            mean, half = mean_ci(v[key])
            cells.append(
                "n/a" if math.isnan(mean) else f"{mean:.1f}" + ("" if math.isnan(half) else f" ± {half:.1f}")
            )
        lines.append(f"| {setting.label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Mean completion length in tokens of the wrong and of the correct rollout samples, over the first "
        f"and the last {LENGTH_WINDOW} RL steps; mean ± 95% interval over seeds.",
    ]
    return lines


def plot_length(part: Part, jobs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = plt.get_cmap("tab10")
    for i, setting in enumerate(part.settings):
        runs = list(jobs[setting.label].values())
        for ax, verdict in zip(axes, ("wrong", "correct")):
            key = f"rollout/completion_len_{verdict}"
            if runs and all(j.history.get(key) for j in runs):
                steps, values = aligned(runs, key)
                band(ax, steps, values, setting.label, colors(i % 10), **STYLE)
    for ax, verdict in zip(axes, ("wrong", "correct")):
        ax.set_title(f"{verdict} answers", fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel("mean completion length (tokens)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Length of rollout answers: {part.title} (band: 95% CI over seeds)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1, default=float))


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


# ---- the report --------------------------------------------------------------------------------------
def probe_table(out: Path, part: Part, learning: dict[str, dict[str, list[float]]]) -> tuple[list[str], dict]:
    """Each estimator's relative gradient variance at each probed step, beside how it learned in the
    estimators part (`learning`: label -> per-seed metrics; empty when that part has no runs)."""
    results = {}
    for folder in sorted(probe_folder(out, part, 0).parent.glob("step*"), key=lambda p: int(p.name[4:])):
        if (found := read_results(folder)) is not None:
            results[int(folder.name[4:])] = found
    if not results:
        return ["(no probe results yet)"], {}
    steps = list(results)
    names = [r["estimator"] for r in results[steps[0]]["rows"] if r["shift"] == 0]
    beside = part.probe.get("beside", "")
    shift = next((r["shift"] for r in results[steps[0]]["rows"] if r["shift"] != 0), None)
    shifted = [f"step {steps[0]}, rewards + {shift:g}"] if shift is not None else []
    head = ["estimator"] + [f"step {s}" for s in steps] + shifted
    head += [f"acc. AUC ({beside})", f"final acc. ({beside})"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in names:
        cells = [name]
        for step, at in [(step, 0) for step in steps] + ([(steps[0], shift)] if shifted else []):
            row = next(r for r in results[step]["rows"] if r["estimator"] == name and r["shift"] == at)
            low, high = row["ci95"]
            cells.append(f"{row['relative_variance']:.2f} [{low:.2f}, {high:.2f}]")
        metrics = learning.get(name)
        cells += [_pts(*mean_ci(metrics[k])) if metrics else "n/a" for k in ("auc", "final")]
        lines.append("| " + " | ".join(cells) + " |")
    accuracy = ", ".join(f"step {s}: {100 * r['rollout_accuracy']:.1f}%" for s, r in results.items())
    first = results[steps[0]]
    lines += [
        "",
        f"Relative variance tr(Cov[g]) / ||E[g]||^2 of the policy gradient over {first['repeats']} "
        f"rollouts of the same {first['prompts']} prompts x {first['samples']} samples, at the policy of "
        f"the RLOO run (seed {part.probe.get('seed', 0)}) after that many RL steps [95% bootstrap "
        f"interval]; every estimator with the run's loss aggregation ({first['loss_agg']}). Rollout "
        f"accuracy of the probed policies: {accuracy}. The shifted column adds a constant to every reward "
        "first: baselines that subtract a mean of rewards are unmoved by it; REINFORCE is not. "
        "`batch_mean`: REINFORCE with the batch's mean "
        f"reward as its baseline. Beside it, how the same estimator learned in the {beside} part (mean "
        "± 95% interval over its seeds).",
    ]
    return lines, results


def headline(part: Part, data: dict, records: list[dict]) -> list[str]:
    """The part's findings as markdown bullets: the settings by accuracy AUC, and the comparisons whose
    interval leaves out 0 (with their p before and after Holm's adjustment)."""
    ranked = sorted(
        ((mean_ci(v["auc"]), label) for label, v in data.items() if v), key=lambda item: -item[0][0]
    )
    counts = [sum(not math.isnan(x) for x in v["auc"]) for v in data.values() if v]
    n = (
        f"{min(counts)}-{max(counts)}"
        if counts and min(counts) != max(counts)
        else str(max(counts, default=0))
    )
    lines = [
        f"- **{part.title}**, by held-out accuracy AUC (points, mean ± 95% CI over {n} seeds): "
        + ", ".join(f"{label} {_pts(*ci)}" for ci, label in ranked)
        + "."
    ]
    clear = [r for r in records if not math.isnan(r["low"]) and (r["low"] > 0 or r["high"] < 0)]
    if clear:
        lines += [
            "  Paired differences whose 95% interval leaves out 0: "
            + "; ".join(
                f"{r['a']} - {r['b']}, {r['metric']}: {100 * r['mean']:+.1f} [{100 * r['low']:+.1f}, "
                f"{100 * r['high']:+.1f}] (p {r['p']:.3f}, Holm {r['p_holm']:.3f})"
                for r in clear
            )
            + "."
        ]
    else:
        lines += [f"  No paired difference's 95% interval leaves out 0 ({len(records)} compared)."]
    return lines


def write_study_report(
    study, out: Path, report_dir: Path, per_step: dict, *, command: str, machine: str
) -> None:
    """`<part>.md`, `<part>.json` and the plots of every part into `report_dir`."""
    from loorl.research.study import check_pairing

    report_dir.mkdir(parents=True, exist_ok=True)
    images = report_dir.name  # the page that includes the tables sits beside the folder
    learning = {}  # part name -> label -> per-seed metrics
    headlines = {}  # part title -> its bullet lines
    for part in study.parts:
        only = f"{command.split(' --', 1)[0]} --only {part.name}"
        if part.kind == "probe":
            lines, results = probe_table(out, part, learning.get(part.probe.get("beside"), {}))
            seconds = sum(r["seconds"] for r in results.values())
            text = [f"Command: `{only}` ({seconds / 60:.1f} min of probes; {machine})", "", *lines]
            (report_dir / f"{part.name}.md").write_text("\n".join(text) + "\n")
            write_json(report_dir / f"{part.name}.json", results)
            continue
        jobs = part_jobs(out, part)
        runs = sum(len(v) for v in jobs.values())
        if not runs:  # the page that includes the part's table still builds
            (report_dir / f"{part.name}.md").write_text(f"No finished runs yet: `{only}` runs them.\n")
            continue
        wall = sum(float(j.summary.get("wall_seconds", 0)) for v in jobs.values() for j in v.values())
        samples = {label: b_and_n[1] for label, b_and_n in per_step[part.name].items()}
        text = [
            f"Command: `{only}`: {runs} runs of {len(part.settings) * len(part.seeds)}, {wall / 60:.0f} min "
            f"of compute (the runs' wall time; {machine}).",
            "",
        ]
        if part.plan:
            first = part.settings[0].label
            text += [f"The settings' resolved configs differ from {first}'s in these keys only (checked "
                     "before the runs):", "", *(f"- {line}" for line in part.plan), ""]  # fmt: skip
        summary, data = summary_table(part, jobs)
        comparisons, records = comparison_table(part, data)
        headlines[part.title] = headline(part, data, records)
        text += summary + ["", *comparisons, "", f"![{part.title}]({images}/{part.name}_accuracy.png)", ""]
        plot_accuracy(part, jobs, samples, report_dir / f"{part.name}_accuracy.png")
        payload = {"settings": data, "comparisons": records}
        learning[part.name] = data
        clip = {label: info[2] for label, info in per_step[part.name].items()}
        text += [*grad_norm_table(part, jobs, clip), ""]
        if levels := level_table(part, jobs):
            text += [*levels, ""]
        if part.lengths:
            lengths = length_data(part, jobs)
            text += ["", *length_table(part, lengths), "", f"![lengths]({images}/{part.name}_length.png)", ""]
            plot_length(part, jobs, report_dir / f"{part.name}_length.png")
            length_cmp, length_records = comparison_table(
                part,
                lengths,
                metrics=(("wrong_change", "change in wrong answers' length"),),
                scale=1.0,
                unit="tokens",
            )
            payload |= {"lengths": lengths, "length_comparisons": length_records}
            text += length_cmp + [""]
        try:
            histories = {label: {s: j.history for s, j in v.items()} for label, v in jobs.items()}
            b = {label: b_and_n[0] for label, b_and_n in per_step[part.name].items()}
            pairing = check_pairing(histories, b, pairing=part.pairing)
            text += ["Seeds paired: " + " ".join(pairing)]
        except ValueError as error:
            text += [f"**Seeds NOT paired:** {error}"]
            payload["pairing_error"] = str(error)
        (report_dir / f"{part.name}.md").write_text("\n".join(text) + "\n")
        write_json(report_dir / f"{part.name}.json", payload)
    if headlines:
        path = report_dir / "headline.md"
        path.write_text(merge_headlines(path.read_text() if path.exists() else "", headlines))


def merge_headlines(existing: str, blocks: dict[str, list[str]]) -> str:
    """headline.md with the reported parts' bullets (`blocks`: part title -> lines) in place of their
    earlier ones; other parts' bullets (a report of `--only` some parts) stay where they were, and a
    part new to the file goes last."""
    kept: list[tuple[str | None, list[str]]] = []  # (title or None, lines), in the file's order
    for line in existing.splitlines():
        if line.startswith("- **"):
            kept.append((line[4:].split("**", 1)[0], [line]))
        elif kept:
            kept[-1][1].append(line)
    titles = [title for title, _ in kept]
    out = [blocks.get(title, lines) for title, lines in kept]
    out += [lines for title, lines in blocks.items() if title not in titles]
    return "\n".join(line for lines in out for line in lines) + "\n"

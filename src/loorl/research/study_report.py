"""A study's report, written from its finished runs (`scripts/research/study.py`): per part `<part>.md` and
`<part>.json` with its tables (`loorl.research.study_tables`: a summary of each setting over seeds,
the paired comparisons it names with Holm's correction across them, gradient norms, levels, lengths)
and its plots (`loorl.research.study_plots`: the accuracy curves against samples drawn and against
RL-step minutes, and for the estimators the length of correct and wrong answers along training), a
probe part's table of relative gradient variance, and `headline.md`, the findings of every part
reported so far. Nothing here is typed in by hand: the docs page includes these files.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

from loorl.research.jobs import Job
from loorl.research.probe import read_results
from loorl.research.stats import mean_ci
from loorl.research.study import Part
from loorl.research.study_pairing import check_pairing
from loorl.research.study_plots import plot_accuracy, plot_dynamics, plot_length
from loorl.research.study_records import keep_record, read_record, read_run, record_path
from loorl.research.study_runs import did_all_steps, kept_probes, probe_folder, run_dir
from loorl.research.study_tables import (
    comparison_table,
    dynamics_table,
    grad_norm_table,
    in_points,
    length_data,
    length_table,
    level_table,
    summary_table,
)


def part_jobs(out: Path, part: Part, records: Path | None = None) -> dict[str, dict[int, Job]]:
    """label -> seed -> the finished run: from its run folder (and then kept in `records`), else from
    its record (`loorl.research.study_records`). A run stopped early is not tabulated."""
    found = {}
    for setting in part.settings:
        jobs = {}
        for seed in part.seeds:
            folder = run_dir(out, setting, seed)
            run = read_run(folder)
            if run and did_all_steps(run.summary, setting.steps):
                if records is not None:
                    keep_record(folder, record_path(records, setting, seed))
            elif records is not None:
                run = read_record(record_path(records, setting, seed), seed)
            if run and did_all_steps(run.summary, setting.steps):
                jobs[seed] = replace(run, seed=seed)
        found[setting.label] = jobs
    return found


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1, default=float))


def probe_table(
    out: Path, part: Part, learning: dict[str, dict[str, list[float]]], kept: dict[int, dict] | None = None
) -> tuple[list[str], dict]:
    """Each estimator's relative gradient variance at each probed step, beside how it learned in the
    estimators part (`learning`: label -> per-seed metrics; empty when that part has no runs); `kept`:
    step -> results the report held before (`kept_probes`), where `out` has none for that step."""
    results = dict(kept or {})
    for folder in sorted(probe_folder(out, part, 0).parent.glob("step*"), key=lambda p: int(p.name[4:])):
        if (found := read_results(folder)) is not None:
            results[int(folder.name[4:])] = found
    results = dict(sorted(results.items()))
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
        cells += [in_points(*mean_ci(metrics[k])) if metrics else "n/a" for k in ("auc", "final")]
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
        + ", ".join(f"{label} {in_points(*ci)}" for ci, label in ranked)
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
    report_dir.mkdir(parents=True, exist_ok=True)
    images = report_dir.name  # the page that includes the tables sits beside the folder
    learning = {}  # part name -> label -> per-seed metrics
    headlines = {}  # part title -> its bullet lines
    for part in study.parts:
        only = f"{command.split(' --', 1)[0]} --only {part.name}"
        if part.kind == "probe":
            beside = learning.get(part.probe.get("beside"), {})
            lines, results = probe_table(out, part, beside, kept_probes(report_dir, part))
            seconds = sum(r["seconds"] for r in results.values())
            text = [f"Command: `{only}` ({seconds / 60:.1f} min of probes; {machine})", "", *lines]
            (report_dir / f"{part.name}.md").write_text("\n".join(text) + "\n")
            write_json(report_dir / f"{part.name}.json", results)
            continue
        jobs = part_jobs(out, part, report_dir)
        runs = sum(len(v) for v in jobs.values())
        if not runs:  # the page that includes the part's table still builds
            (report_dir / f"{part.name}.md").write_text(f"No finished runs yet: `{only}` runs them.\n")
            continue
        wall = sum(float(j.summary.get("wall_seconds", 0)) for v in jobs.values() for j in v.values())
        samples = {label: b_and_n[1] for label, b_and_n in per_step[part.name].items()}
        made, mixed = made_on([j for v in jobs.values() for j in v.values()], machine)
        text = [
            f"Command: `{only}`: {runs} runs of {len(part.settings) * len(part.seeds)}, {wall / 60:.0f} min "
            f"of compute (the runs' wall time; {made}).",
            "",
            *([mixed, ""] if mixed else []),
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
        if part.dynamics:
            dynamics, payload["dynamics"] = dynamics_table(part, jobs)
            text += [*dynamics, "", f"![dynamics]({images}/{part.name}_dynamics.png)", ""]
            plot_dynamics(part, jobs, report_dir / f"{part.name}_dynamics.png")
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
        existing = path.read_text() if path.exists() else ""
        path.write_text(merge_headlines(existing, headlines, study.part_titles))


def made_on(runs: list[Job], writer: str) -> tuple[str, str]:
    """Where a part's runs were made, from the `machine` each run kept (`loorl.util.hardware.machine_line`),
    and a warning line where they were made on more than one (else ""). `writer`: the machine writing
    the report, named only where no run kept its own (runs from before they did)."""
    machines = Counter(j.facts.get("machine") for j in runs)
    unknown = machines.pop(None, 0)
    if not machines:
        return f"the runs did not keep their machine; the report was written on {writer}", ""
    if len(machines) == 1 and not unknown:
        return f"made on {next(iter(machines))}", ""

    def count(n: int) -> str:
        return f"{n} run" + ("s" if n != 1 else "")

    named = [f"{name} ({count(n)})" for name, n in sorted(machines.items(), key=lambda m: (-m[1], m[0]))]
    if unknown:
        named.append(f"{count(unknown)} from before runs kept their machine")
    warning = (
        f"**The runs were made on {len(machines)} machines:** a setting's wall time, and a paired difference "
        "whose seeds ran on different machines, mix them (other kernels, cores or torch versions may "
        "follow other float sums and draw other samples from the same seed)."
        if len(machines) > 1
        else ""
    )
    return "made on " + "; ".join(named), warning


def merge_headlines(existing: str, blocks: dict[str, list[str]], order: tuple[str, ...] = ()) -> str:
    """headline.md with the reported parts' bullets (`blocks`: part title -> lines) in place of their
    earlier ones; other parts' bullets (a report of `--only` some parts) are kept. The bullets follow
    `order` (the study file's part titles); those it does not name (a part the file no longer has) come
    last, in their order."""
    kept: dict[str, list[str]] = {}  # title -> lines, in the file's order
    title = None
    for line in existing.splitlines():
        if line.startswith("- **"):
            title = line[4:].split("**", 1)[0]
            kept[title] = [line]
        elif title is not None:
            kept[title].append(line)
    merged = kept | blocks  # a replaced part keeps its place; a new one comes after the old ones
    rank = {title: i for i, title in enumerate(order)}
    titles = sorted(merged, key=lambda t: rank.get(t, len(order)))  # stable: unranked keep their order
    return "\n".join(line for title in titles for line in merged[title]) + "\n"

"""The markdown table of reasoning-gym runs (`task=reasoning_gym`): per run and dataset, held-out
greedy accuracy at the first and last validation, the curriculum level at the end (the mean row: the
mean level; `task.eval_levels`' held-out sets, `<name>@L<level>`, are columns of their own, outside
"all"), the run's wall time, its peak memory and its training steps' (the largest of their phases'
peaks: where the run's is higher, validation, start-up or the export set it); then the mean over runs.

    python scripts/research/reasoning_gym_table.py outputs/rg_seed0 outputs/rg_seed1 outputs/rg_seed2

Each argument is a run folder (its metrics.json; curriculum levels from it, or from csv/metrics.csv
for a run whose metrics.json predates them).

    python scripts/research/reasoning_gym_table.py --answers letter_counting outputs/rg_seed0

prints instead what one dataset's held-out greedy answers were at the first and the last validation
(the run needs `sample_rows=-1`): how often each answer was given, how often it was right, and the
accuracy of the best constant answer, which a policy that does not read the question can reach.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import math
from pathlib import Path


def load_run(run: Path) -> dict:
    """{datasets: {name: {first, last, level}}, wall, peak, first, last} of one run folder."""
    metrics = json.loads((run / "metrics.json").read_text())
    history, summary = metrics["history"], metrics["summary"]
    levels = {k: [v for _, v in xs] for k, xs in history.items() if k.startswith("curriculum/level/")}
    table = run / "csv" / "metrics.csv"
    if not levels and table.is_file():
        with table.open(newline="") as f:
            for row in csv.DictReader(f):
                for key, value in row.items():
                    if key.startswith("curriculum/level/") and value:
                        levels.setdefault(key, []).append(float(value))
    datasets = {}
    for key, xs in history.items():
        if key.startswith("val/accuracy/"):
            name = key.removeprefix("val/accuracy/")
            lv = levels.get(f"curriculum/level/{name}", [])
            datasets[name] = {"first": xs[0][1], "last": xs[-1][1], "level": lv[-1] if lv else math.nan}
    phases = [v for k, v in summary.items() if k.endswith("_peak_host_gib") and k != "peak_host_gib"]
    return {"datasets": datasets, "wall": summary["wall_seconds"], "peak": summary["peak_host_gib"],
            "train_peak": max(phases, default=math.nan),
            "first": history["val/accuracy"][0][1], "last": history["val/accuracy"][-1][1]}  # fmt: skip


def markdown(runs: dict[str, dict]) -> str:
    names = list(next(iter(runs.values()))["datasets"])
    # a further level's held-out set (task.eval_levels: <name>@L<level>) trains nothing: it has no level
    head = ["run"] + [f"{n} first -> last" + ("" if "@L" in n else " (level)") for n in names]
    head += ["all first -> last", "wall", "peak", "training steps' peak"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]

    def cell(d: dict) -> str:
        level = "" if math.isnan(d["level"]) else f" (L{d['level']:.0f})"
        return f"{100 * d['first']:.0f}% -> {100 * d['last']:.0f}%{level}"

    for label, r in runs.items():
        cells = [cell(r["datasets"][n]) for n in names]
        accuracy = f"{100 * r['first']:.1f}% -> {100 * r['last']:.1f}%"
        memory = f"{r['peak']:.2f} GiB | {r['train_peak']:.2f} GiB"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {accuracy} "
                     f"| {r['wall'] / 60:.1f} min | {memory} |")  # fmt: skip
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    rs = list(runs.values())
    cells = [cell({k: mean([r["datasets"][n][k] for r in rs]) for k in ("first", "last", "level")})
             for n in names]  # fmt: skip
    lines.append("| mean | " + " | ".join(cells) + f" | {100 * mean([r['first'] for r in rs]):.1f}% -> "
                 f"{100 * mean([r['last'] for r in rs]):.1f}% | {mean([r['wall'] for r in rs]) / 60:.1f} min "
                 f"| {max(r['peak'] for r in rs):.2f} GiB (max) "
                 f"| {max(r['train_peak'] for r in rs):.2f} GiB (max) |")  # fmt: skip
    return "\n".join(lines)


def heldout_answers(run: Path, dataset: str) -> str:
    """The markdown of `dataset`'s held-out greedy answers at the run's first and last validation:
    right and wrong are the run's own grading (samples.csv's `correct`: reasoning-gym's scorer)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    task = instantiate(OmegaConf.load(run / "config.yaml").task)
    truth = {p.meta["question"]: p.answer for p in task.eval_prompts() if p.meta["source"] == dataset}
    by_step: dict[int, list[tuple[str, bool]]] = collections.defaultdict(list)  # step -> (given, right)
    with (run / "samples.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            question = next((q for q in truth if q in row["prompt"]), None)
            if question is not None:
                given = task.extract_answer(None, row["completion"])
                right = row["correct"] in ("True", "1", "1.0")
                by_step[int(row["step"])].append(("(no answer)" if given is None else given, right))
    if not by_step:
        raise SystemExit(f"{run}/samples.csv holds no held-out {dataset} problem: run with sample_rows=-1")
    steps = sorted(by_step)
    best, hits = collections.Counter(truth.values()).most_common(1)[0]
    lines = [f"{dataset}: {len(truth)} held-out problems; the best constant answer, {best!r}, is right on "
             f"{100 * hits / len(truth):.0f}%", "",
             "| step | accuracy | answers given (count: right) |", "| --- | --- | --- |"]  # fmt: skip
    for step in (steps[0], steps[-1]):
        rows = by_step[step]
        counts = collections.Counter(g for g, _ in rows)
        right_by = collections.Counter(g for g, ok in rows if ok)
        given = ", ".join(f"{g!r} {n}: {right_by[g]}" for g, n in counts.most_common())
        lines.append(f"| {step} | {100 * sum(right_by.values()) / len(rows):.0f}% | {given} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run folders")
    parser.add_argument("--answers", metavar="DATASET", help="one dataset's held-out answers instead")
    args = parser.parse_args()
    if args.answers:
        print("\n\n".join(heldout_answers(run, args.answers) for run in args.runs))
    else:
        print(markdown({run.name: load_run(run) for run in args.runs}))


if __name__ == "__main__":
    main()

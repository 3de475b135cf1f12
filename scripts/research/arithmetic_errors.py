"""What a `task=chat_arithmetic` run gets wrong, validation by validation: the held-out greedy answers
sorted into kinds of error, and how much of each step's rollout could teach anything.

    python src/train.py experiment=smollm2_arithmetic sample_rows=-1 hydra.run.dir=outputs/arith
    python scripts/research/arithmetic_errors.py outputs/arith

The run needs `sample_rows=-1` (every held-out completion in samples.csv). Kinds of a wrong answer to
a + b (the last number of the answer, as the reward reads it):

- carry dropped: a + b - 10 where the units carry (38 + 48 = 76);
- single digit read twice: one operand d < 10 read as dd (4 + 34 = 78, 6 + 32 = 98);
- other tens-digit error: off by another multiple of ten;
- units digit wrong: any other number; no number: the answer has none;
- sum not at the end: the last number is right, and the task's grading
  (`task.answer_mode=strict`: the answer must end with it) says wrong.

Right and wrong are the run's own grading (samples.csv's `correct`).

Beside them, from csv/metrics.csv, the means over the steps since the previous validation of
`rollout/zero_std_group_frac` (the share of groups whose K samples were all right or all wrong: no
gradient) and `train/entropy` (nats per token of the trained samples).
"""

from __future__ import annotations

import argparse
import collections
import csv
import math
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

from loorl.tasks.verifiers import extract_final_number

KINDS = (
    "carry dropped",
    "single digit read twice",
    "other tens-digit error",
    "units digit wrong",
    "no number",
    "sum not at the end",
)
QUESTION = re.compile(r"(\d+) \+ (\d+)\?")


def error_kind(a: int, b: int, answer: int | None) -> str | None:
    """The kind of a wrong answer to a + b (None: the answer is right)."""
    if answer == a + b:
        return None
    if answer is None:
        return "no number"
    small, large = min(a, b), max(a, b)
    if small < 10 <= large and answer == 11 * small + large:
        return "single digit read twice"
    if (a % 10 + b % 10) >= 10 and answer == a + b - 10:
        return "carry dropped"
    if (answer - (a + b)) % 10 == 0:
        return "other tens-digit error"
    return "units digit wrong"


def last_number(text: str) -> int | None:
    """The last number of an answer as the task's flexible mode reads it (None: none, or not whole)."""
    value = extract_final_number(text, mode="flexible")
    try:
        number = Decimal(value) if value is not None else None
    except InvalidOperation:
        return None
    return int(number) if number is not None and number == number.to_integral_value() else None


def step_means(run: Path, keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each key from csv/metrics.csv."""
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in keys}
    with (run / "csv" / "metrics.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            for key in keys:
                if row.get(key):
                    out[key].append((int(row["epoch"]), float(row[key])))
    return out


def table(run: Path) -> str:
    kinds: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    with (run / "samples.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            match = QUESTION.search(row["prompt"])
            if match is None:
                continue
            step = int(row["step"])
            totals[step] += 1
            if row["correct"] in ("True", "1", "1.0"):  # the task's own grading (task.answer_mode)
                continue
            kind = error_kind(int(match[1]), int(match[2]), last_number(row["completion"]))
            kinds[step][kind or "sum not at the end"] += 1
    if not totals:
        raise SystemExit(f"{run}/samples.csv holds no arithmetic question: a task=chat_arithmetic run?")
    series = step_means(run, ("rollout/zero_std_group_frac", "train/entropy"))
    head = ["step", "accuracy", "wrong", *KINDS, "groups without spread", "entropy"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    previous = 0
    for step in sorted(totals):  # the validation at step s follows RL steps 0..s-1
        wrong = sum(kinds[step].values())
        means = []
        for key in ("rollout/zero_std_group_frac", "train/entropy"):
            xs = [v for s, v in series[key] if previous <= s < step and not math.isnan(v)]
            means.append(f"{sum(xs) / len(xs):.2f}" if xs else "")
        previous = step
        cells = [str(step), f"{100 * (1 - wrong / totals[step]):.1f}%", str(wrong)]
        lines.append("| " + " | ".join(cells + [str(kinds[step][k]) for k in KINDS] + means) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (run with sample_rows=-1)")
    args = parser.parse_args()
    print("\n\n".join(f"{run.name}\n\n{table(run)}" for run in args.runs))


if __name__ == "__main__":
    main()

"""scripts/research/arithmetic_errors.py: each kind of wrong answer to a + b is told apart, and a run folder's
samples.csv and metrics.csv give the table the how-to page shows (docs/how-to/cpu-real-model.md)."""

from __future__ import annotations

import csv

import pytest

from fixtures import load_script

errors = load_script("research/arithmetic_errors.py")


@pytest.mark.parametrize(
    ("a", "b", "answer", "kind"),
    [
        (38, 48, 86, None),
        (38, 48, 76, "carry dropped"),
        (4, 34, 78, "single digit read twice"),  # 4 read as 44
        (32, 6, 98, "single digit read twice"),  # either order
        (41, 40, 41, "other tens-digit error"),  # 81 - 40
        (12, 30, 52, "other tens-digit error"),  # no carry: +10 is not a dropped carry
        (8, 5, 11, "units digit wrong"),
        (8, 5, None, "no number"),
        (4, 5, 49, "other tens-digit error"),  # two single digits: never "read twice" (44 + 5)
    ],
)
def test_error_kinds(a, b, answer, kind):
    assert errors.error_kind(a, b, answer) == kind


def test_table_from_a_run_folder(tmp_path):
    rows = [  # step, question, completion, correct (the run's own grading)
        (0, 38, 48, "38 + 48 = 76", False),
        (0, 4, 34, "4 + 34 = 78", False),
        (0, 1, 2, "1 + 2 = 3", True),
        (0, 2, 2, "2 + 2 is 4, I think", False),  # the sum, but the answer does not end with it
        (5, 38, 48, "38 + 48 = 86", True),
        (5, 4, 34, "4 + 34 = 38", True),
        (5, 1, 2, "1 + 2 = 3", True),
        (5, 2, 2, "2 + 2 = 5", False),
    ]
    with (tmp_path / "samples.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "prompt", "completion", "reward", "correct"])
        for step, a, b, text, ok in rows:
            w.writerow([step, f"<|im_start|>user\nWhat is {a} + {b}? Answer with just the number.", text,
                        float(ok), ok])  # fmt: skip
    (tmp_path / "csv").mkdir()
    with (tmp_path / "csv" / "metrics.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "rollout/zero_std_group_frac", "train/entropy"])
        for epoch, frac, ent in [(0, 0.5, 1.0), (1, 0.7, 0.5), (4, 0.9, 0.1), (5, 0.2, 0.2)]:
            w.writerow([epoch, frac, ent])
    lines = errors.table(tmp_path).splitlines()
    assert lines[2] == "| 0 | 25.0% | 3 | 1 | 1 | 0 | 0 | 0 | 1 |  |  |"
    assert lines[3] == "| 5 | 75.0% | 1 | 0 | 0 | 0 | 1 | 0 | 0 | 0.70 | 0.53 |"  # steps 0, 1, 4

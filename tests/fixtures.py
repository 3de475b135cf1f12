"""Small GSM8K- and MATH-style data sets written by the tests themselves (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

NAMES = ["Tom", "Ann", "Li", "Sam", "Eva", "Raj"]
ITEMS = ["apples", "pens", "cards", "books"]


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    """Original GSM8K jsonl rows: `question`, and `answer` = reasoning + `#### N`."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(1, 20, size=2))
        who, what = NAMES[rng.integers(len(NAMES))], ITEMS[rng.integers(len(ITEMS))]
        rows.append(
            {
                "question": f"{who} has {a} {what} and gets {b} more. How many {what} now?",
                "answer": f"{a}+{b}={a + b}\n#### {a + b}",
            }
        )
    return rows


def write_gsm8k(root: Path, *, train: int = 64, test: int = 16) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", train, 0), ("test", test, 1)):
        with open(root / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in gsm8k_rows(n, seed))
    return root


def write_math(root: Path, *, train: int = 32, test: int = 8) -> Path:
    """MATH-style rows: `problem` and a `solution` ending in a boxed fraction."""
    root.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", train, 2), ("test", test, 3)):
        rng = np.random.default_rng(seed)
        with open(root / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                a, b = (int(x) for x in rng.integers(1, 9, size=2))
                row = {
                    "problem": f"What is {a}/{a * b} as a fraction?",
                    "solution": f"It is \\boxed{{\\frac{{1}}{{{b}}}}}.",
                }
                f.write(json.dumps(row) + "\n")
    return root

"""Write arithmetic.jsonl: the 200 held-out problems of loorl's `task=arithmetic` (its defaults), one
JSON object a line, for the lm-eval tasks beside this file (arithmetic.yaml, arithmetic_mc.yaml).

    PYTHONPATH=src python examples/lm_eval/make_arithmetic.py

Each line: `question` ("17+25="), `answer` ("42"), and for the multiple-choice task four `choices` (the
sum, the sum +1, the sum -1 or +2, the sum +10, in a fixed shuffled order) with `label`, the index of
the sum among them. tests/test_lm_eval.py checks that the file still equals the task's held-out set.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loorl.tasks.arithmetic import ArithmeticTask

HERE = Path(__file__).resolve().parent


def rows() -> list[dict]:
    out = []
    rng = np.random.default_rng(0)
    for prompt in ArithmeticTask().eval_prompts():
        total = int(prompt.answer)
        choices = [total, total + 1, total - 1 if total > 0 else total + 2, total + 10]
        order = rng.permutation(len(choices))
        shuffled = [str(choices[i]) for i in order]
        out.append({"question": prompt.text, "answer": prompt.answer, "choices": shuffled,
                    "label": int(np.flatnonzero(order == 0)[0])})  # fmt: skip
    return out


if __name__ == "__main__":
    lines = [json.dumps(r) for r in rows()]
    (HERE / "arithmetic.jsonl").write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} problems to {HERE / 'arithmetic.jsonl'}")

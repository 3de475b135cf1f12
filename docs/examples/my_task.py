"""A task written outside loorl: sums of two numbers, with half credit for the right last digit.

`PYTHONPATH=docs/examples python src/train.py task._target_=my_task.LastDigitSums` trains on it.
The keys of `conf/task/arithmetic.yaml` (name, min_operand, ...) arrive as keyword arguments.
"""

from __future__ import annotations

import numpy as np

from loorl.tasks.base import Task
from loorl.types import Prompt


class LastDigitSums(Task):
    """Prompts `17+25=`; reward 1 for the exact sum, 0.5 when only the last digit is right, else 0."""

    def __init__(
        self,
        *,
        name: str = "last_digit_sums",
        min_operand: int = 0,
        max_operand: int = 29,
        eval_size: int = 200,
        eval_seed: int = 1234,
        **_,  # the other keys of the task's config (exclude_eval_from_train, max_new_tokens)
    ) -> None:
        self.name = name
        pairs = [
            (a, b) for a in range(min_operand, max_operand + 1) for b in range(min_operand, max_operand + 1)
        ]
        order = np.random.default_rng(eval_seed).permutation(len(pairs))
        self._eval = [pairs[i] for i in order[:eval_size]]  # fixed held-out problems
        self._train = pairs

    @staticmethod
    def _prompt(a: int, b: int) -> Prompt:
        return Prompt(text=f"{a}+{b}=", answer=str(a + b), meta={"a": a, "b": b})

    def train_prompts(self, n: int, *, rng: np.random.Generator) -> list[Prompt]:
        # rng is seeded from (seed, step): a resumed run draws the same prompts
        return [self._prompt(*self._train[i]) for i in rng.integers(0, len(self._train), size=n)]

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(a, b) for a, b in self._eval]

    def reward(self, prompt: Prompt, completion: str) -> float | None:
        answer = completion.strip()
        if answer == prompt.answer:
            return 1.0
        if answer[-1:] == prompt.answer[-1]:
            return 0.5
        return 0.0

    def grade(self, prompt: Prompt, completion: str) -> tuple[float | None, bool]:
        # correct only for the exact sum (the default would call any positive reward correct)
        return self.reward(prompt, completion), completion.strip() == prompt.answer

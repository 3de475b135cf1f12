"""`task=arithmetic`: prompts like `17+25=`, reward 1 for the exact sum and 0 otherwise."""

from __future__ import annotations

import numpy as np

from loorl.tasks.base import Prompt, Task


class ArithmeticTask(Task):
    name = "arithmetic"

    def __init__(
        self,
        *,
        name: str = "arithmetic",
        min_operand: int = 0,
        max_operand: int = 29,
        eval_size: int = 200,
        eval_seed: int = 1234,
        exclude_eval_from_train: bool = False,
        max_new_tokens: int = 5,
    ) -> None:
        if max_operand < min_operand:
            raise ValueError("task.max_operand must be >= task.min_operand")
        self.name = name
        self.min_operand, self.max_operand = min_operand, max_operand
        self.max_new_tokens = max_new_tokens
        pairs = [
            (a, b) for a in range(min_operand, max_operand + 1) for b in range(min_operand, max_operand + 1)
        ]
        order = np.random.default_rng(eval_seed).permutation(len(pairs))
        eval_size = min(eval_size, len(pairs) // 2)
        self._eval_pairs = [pairs[i] for i in order[:eval_size]]
        train_idx = order[eval_size:] if exclude_eval_from_train else order
        self._train_pairs = [pairs[i] for i in np.sort(train_idx)]

    @staticmethod
    def _prompt(a: int, b: int) -> Prompt:
        return Prompt(text=f"{a}+{b}=", answer=str(a + b), meta={"a": a, "b": b})

    def train_prompts(self, n: int, *, rng: np.random.Generator) -> list[Prompt]:
        idx = rng.integers(0, len(self._train_pairs), size=n)
        return [self._prompt(*self._train_pairs[i]) for i in idx]

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(a, b) for a, b in self._eval_pairs]

    def reward(self, prompt: Prompt, completion: str) -> float | None:
        return 1.0 if completion.strip() == prompt.answer else 0.0

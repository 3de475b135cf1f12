"""A task written outside loorl that adapts to the policy: sums whose operands grow as it masters them.

`PYTHONPATH=docs/examples python src/train.py task._target_=growing_sums.GrowingSums` trains on it.
Level L draws both operands from 0..max_operands[L]; loorl's `Curriculum` raises the level once the
policy's success rate over its last `window` training samples reaches `raise_above`. Three hooks of
`loorl.tasks.base.Task` make it adapt: `observe` (every step's outcomes), `state_dict` and
`load_state_dict` (the level goes into every checkpoint, so a resumed run draws what the uninterrupted
one would). A task of one source needs no `source_names`: its outcomes come under its `name`.
"""

from __future__ import annotations

import numpy as np

from loorl.tasks.base import Task
from loorl.tasks.curriculum import Curriculum
from loorl.types import Prompt


class GrowingSums(Task):
    """Prompts `7+5=`, reward 1 for the exact sum; the operands' range grows level by level."""

    def __init__(
        self,
        *,
        name: str = "growing_sums",
        max_operands: tuple[int, ...] = (9, 19, 29),  # the largest operand at each level
        window: int = 64,  # training samples a decision reads
        raise_above: float = 0.8,  # the success rate that raises the level
        eval_size: int = 200,
        eval_seed: int = 1234,
        **_,  # the other keys of the task's config (min_operand, exclude_eval_from_train, ...)
    ) -> None:
        self.name = name
        self.max_operands = list(max_operands)
        self.curriculum = Curriculum(
            levels={name: 0},
            max_levels={name: len(self.max_operands) - 1},
            window=window,
            raise_above=raise_above,
        )
        top = self.max_operands[-1]
        pairs = [(a, b) for a in range(top + 1) for b in range(top + 1)]
        order = np.random.default_rng(eval_seed).permutation(len(pairs))
        self._eval = [pairs[i] for i in order[:eval_size]]  # fixed held-out sums of every level

    @property
    def level(self) -> int:
        return self.curriculum.levels[self.name]

    @staticmethod
    def _prompt(a: int, b: int) -> Prompt:
        return Prompt(text=f"{a}+{b}=", answer=str(a + b))

    def train_prompts(self, n: int, *, rng: np.random.Generator) -> list[Prompt]:
        # rng is seeded from (seed, step) and the level is restored on resume: a resumed run draws the same
        a, b = rng.integers(0, self.max_operands[self.level] + 1, size=(2, n))
        return [self._prompt(int(x), int(y)) for x, y in zip(a, b)]

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(a, b) for a, b in self._eval]

    def reward(self, prompt: Prompt, completion: str) -> float | None:
        return float(completion.strip() == prompt.answer)

    # ---- the hooks -------------------------------------------------------------------------------
    def observe(self, step: int, outcomes: dict[str, list[int]]) -> dict[str, float]:
        # outcomes: {self.name: [1, 0, ...]}, every rank's samples of the step; returns what to log
        self.curriculum.observe(step, outcomes)  # moves at most once per step, whoever calls again
        return {f"curriculum/level/{self.name}": float(self.level)}

    def state_dict(self) -> dict:
        return self.curriculum.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:  # empty from a checkpoint written without a task state
            self.curriculum.load_state_dict(state)

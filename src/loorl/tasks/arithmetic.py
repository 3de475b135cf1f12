"""`task=arithmetic`: prompts like `17+25=`, reward 1 for the exact sum and 0 otherwise.

`task=arithmetic_offset` is the same task with every reward shifted by a constant (`reward_offset`),
as a reward model's scores are, whose zero point is arbitrary: leave-one-out and group-mean baselines
are blind to the shift, REINFORCE without a baseline is not (docs/how-to/research.md).

`task.curriculum` (both tasks, off by default): a difficulty curriculum over the operands. Level L
trains on the pairs whose both operands are at most `max_operands[L]` (the last level: all of them),
moved by the policy's rolling success rate (`loorl.tasks.curriculum.Curriculum`, one source: the
task's `name`). Held-out pairs and the warm start's examples do not depend on the level."""

from __future__ import annotations

import numpy as np

from loorl.errors import ConfigError
from loorl.tasks.base import Task
from loorl.tasks.curriculum import Curriculum
from loorl.tasks.data import filter_by_length, format_prompt
from loorl.tasks.verifiers import check_answer_mode, extract_final_number
from loorl.types import Prompt

CURRICULUM_KEYS = ("enabled", "max_operands", "window", "raise_above", "lower_below")
CURRICULUM_DEFAULTS = {
    "enabled": False,
    "max_operands": None,
    "window": 64,
    "raise_above": 0.75,
    "lower_below": None,
}


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
        max_new_tokens: int = 5,  # the default of rollout.max_new_tokens; unused here
        reward_offset: float = 0.0,
        curriculum: dict | None = None,
    ) -> None:
        if max_operand < min_operand:
            raise ValueError("task.max_operand must be >= task.min_operand")
        self.name, self.reward_offset = name, reward_offset
        self.min_operand, self.max_operand = min_operand, max_operand
        cur = self._curriculum_settings(curriculum)  # checked before any pair is built
        pairs = [
            (a, b) for a in range(min_operand, max_operand + 1) for b in range(min_operand, max_operand + 1)
        ]
        order = np.random.default_rng(eval_seed).permutation(len(pairs))
        eval_size = min(eval_size, len(pairs) // 2)
        self._eval_pairs = [pairs[i] for i in order[:eval_size]]
        train_idx = order[eval_size:] if exclude_eval_from_train else order
        self._train_pairs = [pairs[i] for i in np.sort(train_idx)]
        self.curriculum, self.max_operands, self._level_pairs = None, None, []
        if cur["enabled"]:
            self.max_operands = cur["max_operands"]
            # each level's training pairs, once: both operands at most its bound (held-out ones stay out)
            self._level_pairs = [[p for p in self._train_pairs if max(p) <= top] for top in self.max_operands]
            for level, (top, level_pairs) in enumerate(zip(self.max_operands, self._level_pairs)):
                if not level_pairs:
                    raise ConfigError(
                        f"task.curriculum.max_operands[{level}]={top} leaves level {level} no training pair "
                        "(all of them are held out, task.exclude_eval_from_train): raise it"
                    )
            self.curriculum = Curriculum.from_settings(
                cur, levels={name: 0}, max_levels={name: len(self.max_operands) - 1}
            )

    def _curriculum_settings(self, curriculum) -> dict:
        """`task.curriculum` with its defaults, checked: one-line errors naming the setting and the fix."""
        cur = {**CURRICULUM_DEFAULTS, **dict(curriculum or {})}
        unknown = sorted(set(cur) - set(CURRICULUM_KEYS))
        if unknown:
            raise ConfigError(
                f"task.curriculum.{unknown[0]} is not a curriculum setting ({', '.join(CURRICULUM_KEYS)})"
            )
        if not isinstance(cur["enabled"], bool):
            raise ConfigError(f"task.curriculum.enabled={cur['enabled']!r} must be true or false")
        if not cur["enabled"]:
            return cur
        tops = cur["max_operands"]
        lo, hi = self.min_operand, self.max_operand
        example = [t for t in sorted({(lo + hi) // 2, hi}) if t >= lo]  # a valid value: half the range, all
        fix = f"e.g. task.curriculum.max_operands=[{','.join(map(str, example))}]"
        if tops is None:
            raise ConfigError(
                "task.curriculum.enabled=true needs task.curriculum.max_operands: the largest training "
                f"operand of each level, ascending, the last = task.max_operand={self.max_operand} ({fix})"
            )
        tops = None if isinstance(tops, (str, bytes)) or not hasattr(tops, "__iter__") else list(tops)
        if not tops or not all(isinstance(t, int) and not isinstance(t, bool) for t in tops):
            raise ConfigError(
                f"task.curriculum.max_operands={cur['max_operands']!r} must be a non-empty list of ints, "
                f"the largest training operand of each level ({fix})"
            )
        if any(b <= a for a, b in zip(tops, tops[1:])):
            raise ConfigError(f"task.curriculum.max_operands={tops} must be strictly ascending ({fix})")
        if tops[0] < self.min_operand:
            raise ConfigError(
                f"task.curriculum.max_operands={tops}: level 0's {tops[0]} is below "
                f"task.min_operand={self.min_operand}, which leaves it no pair ({fix})"
            )
        if tops[-1] != self.max_operand:
            raise ConfigError(
                f"task.curriculum.max_operands={tops} must end at task.max_operand={self.max_operand}, "
                f"the last level training on every pair ({fix})"
            )
        return {**cur, "max_operands": tops}

    @property
    def level(self) -> int | None:
        """The curriculum's current level (None without one)."""
        return None if self.curriculum is None else self.curriculum.levels[self.name]

    @staticmethod
    def _prompt(a: int, b: int) -> Prompt:
        return Prompt(text=f"{a}+{b}=", answer=str(a + b), meta={"a": a, "b": b})

    def _draw(self, pairs: list[tuple[int, int]], n: int, rng: np.random.Generator) -> list[Prompt]:
        idx = rng.integers(0, len(pairs), size=n)
        return [self._prompt(*pairs[i]) for i in idx]

    def train_prompts(self, n: int, *, rng: np.random.Generator) -> list[Prompt]:
        """`n` pairs drawn uniformly with `rng`: among every training pair, or with the curriculum on,
        among those of its current level."""
        pairs = self._train_pairs if self.curriculum is None else self._level_pairs[self.level]
        return self._draw(pairs, n, rng)

    def sft_examples(self, n: int, *, rng: np.random.Generator) -> list[tuple[str, str]]:
        """The tiny model's warm start: every training pair, whatever the curriculum's level (the
        curriculum leaves the tiny model's cache key alone, `models.tiny.REWARD_ONLY_TASK_KEYS`, so a
        run with it starts from the same warm-started model as one without)."""
        return [(p.text, p.answer) for p in self._draw(self._train_pairs, n, rng)]

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(a, b) for a, b in self._eval_pairs]

    def is_exact(self, prompt: Prompt, completion: str) -> bool:
        return self.extract_answer(prompt, completion) == prompt.answer

    def reward(self, prompt: Prompt, completion: str) -> float | None:
        """1 + offset for the exact sum, the offset otherwise."""
        return float(self.is_exact(prompt, completion)) + self.reward_offset

    def grade(self, prompt: Prompt, completion: str) -> tuple[float | None, bool]:
        """The reward (a subclass's `reward` included), and correct for the exact sum: with an
        offset a wrong answer's reward is positive too."""
        return self.reward(prompt, completion), self.is_exact(prompt, completion)

    # ---- curriculum ------------------------------------------------------------------------------
    def observe(self, step: int, outcomes: dict[str, list[int]]) -> dict[str, float]:
        """A training step's outcomes (under the task's `name`) move the curriculum; returns its level
        to log (nothing without a curriculum)."""
        if self.curriculum is None:
            return {}
        self.curriculum.observe(step, outcomes)
        return {f"curriculum/level/{self.name}": float(self.level)}

    def state_dict(self) -> dict:
        """The curriculum's level and window, as plain values (nothing without a curriculum)."""
        return {} if self.curriculum is None else {"curriculum": self.curriculum.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.curriculum is None or not state.get("curriculum"):
            return  # (a checkpoint written without a curriculum: the run starts at level 0)
        saved = state["curriculum"]
        if set(saved["levels"]) - {self.name}:
            raise ConfigError(
                f"the checkpoint's curriculum is task {sorted(saved['levels'])[0]}'s, not "
                f"task.name={self.name}'s: resume with the task it was trained with"
            )
        top = len(self.max_operands) - 1
        if any(int(v) > top for v in saved["levels"].values()):
            raise ConfigError(
                f"the checkpoint's curriculum level {max(saved['levels'].values())} is beyond the "
                f"{top + 1} levels of task.curriculum.max_operands={self.max_operands}: resume with the "
                "settings it was trained with"
            )
        self.curriculum.load_state_dict(saved)

    def run_facts(self) -> dict[str, str]:
        if self.curriculum is None:
            return {}
        tops = ", ".join(map(str, self.max_operands))
        return {"curriculum": f"operands up to {tops} by level; {self.curriculum.describe()}"}


class ChatArithmeticTask(ArithmeticTask):
    """`task=chat_arithmetic`: the same sums asked as a question in the policy's chat template, for
    instruct models: "What is 17 + 25? Answer with just the number." The reward reads the number the
    answer ends with (`answer_mode`: strict, or flexible = the last number anywhere), so "17 + 25 = 42"
    and "42" both count. A subclass rather than options of `task=arithmetic`: the prompt needs the
    tokenizer (rendered in `prepare`) and the reward parses free text, where the tiny model's task
    compares exact strings; the operand pairs and the held-out split are shared.
    """

    name = "chat_arithmetic"

    def __init__(
        self,
        *,
        name: str = "chat_arithmetic",
        min_operand: int = 0,
        max_operand: int = 49,
        eval_size: int = 200,
        eval_seed: int = 1234,
        exclude_eval_from_train: bool = True,
        max_new_tokens: int = 32,  # the default of rollout.max_new_tokens; unused here
        question: str = "What is {a} + {b}? Answer with just the number.",
        chat_template: bool | str = "auto",
        system_prompt: str | None = None,
        answer_mode: str = "strict",
        curriculum: dict | None = None,
    ) -> None:
        check_answer_mode(answer_mode)
        try:
            question.format(a=1, b=2)
            ok = "{a}" in question and "{b}" in question
        except (KeyError, IndexError, ValueError):
            ok = False
        if not ok:
            raise ConfigError(f"task.question={question!r} must name both operands, as {{a}} and {{b}}")
        super().__init__(
            name=name,
            min_operand=min_operand,
            max_operand=max_operand,
            eval_size=eval_size,
            eval_seed=eval_seed,
            exclude_eval_from_train=exclude_eval_from_train,
            curriculum=curriculum,
        )
        self.question, self.answer_mode = question, answer_mode
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.tokenizer = None  # set by prepare(): prompts are plain text until then

    def prepare(self, tokenizer, *, max_prompt_length: int) -> None:
        """Render with the tokenizer's chat template from now on; every prompt must fit the limit."""
        self.tokenizer = tokenizer
        widest = self._prompt(self.max_operand, self.max_operand).text
        filter_by_length([widest], tokenizer, max_length=max_prompt_length, on_overflow="error")

    def _prompt(self, a: int, b: int) -> Prompt:
        question = self.question.format(a=a, b=b)
        text = format_prompt(
            question,
            tokenizer=self.tokenizer,
            use_chat_template=self.chat_template if self.tokenizer is not None else False,
            system_prompt=self.system_prompt,
            tools=self.tools_for({}),
        )
        return Prompt(text=text, answer=str(a + b), meta={"a": a, "b": b, "question": question})

    def extract_answer(self, prompt: Prompt, completion: str) -> str | None:
        return extract_final_number(completion, mode=self.answer_mode)

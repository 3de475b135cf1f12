"""`task=arithmetic`: prompts like `17+25=`, reward 1 for the exact sum and 0 otherwise.

`task=arithmetic_offset` is the same task with every reward shifted by a constant (`reward_offset`),
as a reward model's scores are, whose zero point is arbitrary: leave-one-out and group-mean baselines
are blind to the shift, REINFORCE without a baseline is not (docs/how-to/research.md)."""

from __future__ import annotations

import numpy as np

from loorl.errors import ConfigError
from loorl.tasks.base import Task
from loorl.tasks.data import filter_by_length, format_prompt
from loorl.tasks.verifiers import check_answer_mode, extract_final_number
from loorl.types import Prompt


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
    ) -> None:
        if max_operand < min_operand:
            raise ValueError("task.max_operand must be >= task.min_operand")
        self.name, self.reward_offset = name, reward_offset
        self.min_operand, self.max_operand = min_operand, max_operand
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

    def is_exact(self, prompt: Prompt, completion: str) -> bool:
        return self.extract_answer(prompt, completion) == prompt.answer

    def reward(self, prompt: Prompt, completion: str) -> float | None:
        """1 + offset for the exact sum, the offset otherwise."""
        return float(self.is_exact(prompt, completion)) + self.reward_offset

    def grade(self, prompt: Prompt, completion: str) -> tuple[float | None, bool]:
        """The reward (a subclass's `reward` included), and correct for the exact sum: with an
        offset a wrong answer's reward is positive too."""
        return self.reward(prompt, completion), self.is_exact(prompt, completion)


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

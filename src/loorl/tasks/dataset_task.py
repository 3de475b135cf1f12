"""`task=gsm8k` and `task=math`: prompts from a data set, rewards from a rule-based verifier."""

from __future__ import annotations

import logging

import numpy as np

from loorl.errors import ConfigError
from loorl.tasks.base import Task
from loorl.tasks.data import Example, filter_by_length, format_prompt, load_examples
from loorl.tasks.verifiers import (
    check_answer_mode,
    extract_gsm8k_answer,
    gsm8k_reward,
    last_boxed,
    math_reward,
    normalize_math_answer,
)
from loorl.types import Prompt

log = logging.getLogger(__name__)

VERIFIERS = ("gsm8k", "math")


class DatasetTask(Task):
    def __init__(
        self,
        *,
        name: str,
        verifier: str,
        data: dict,
        suffix: str = "",
        chat_template: bool | str = "auto",
        system_prompt: str | None = None,
        answer_mode: str = "strict",
        format_score: float = 0.0,
        on_long_prompt: str = "filter",
        max_new_tokens: int = 512,  # the default of rollout.max_new_tokens; unused here
    ) -> None:
        if verifier not in VERIFIERS:
            raise ConfigError(f"task.verifier={verifier!r} is not one of: {', '.join(VERIFIERS)}")
        check_answer_mode(answer_mode)
        if data.get("path") in (None, "", "???"):
            raise ConfigError(
                f"data.path is not set: point it at the {name} data (a parquet/jsonl file or folder)"
            )
        self.name, self.verifier = name, verifier
        self.suffix, self.chat_template, self.system_prompt = suffix, chat_template, system_prompt
        self.answer_mode, self.format_score, self.on_long_prompt = answer_mode, format_score, on_long_prompt
        common = {"layout": data.get("layout", "auto"), "question_key": data.get("question_key"),
                  "answer_key": data.get("answer_key")}  # fmt: skip
        self.train_examples = load_examples(data["path"], split=data.get("train_split", "train"),
                                            limit=data.get("limit"), **common)  # fmt: skip
        self.val_examples = load_examples(data["path"], split=data.get("val_split", "test"),
                                          limit=data.get("val_limit"), **common)  # fmt: skip
        self.train: list[Prompt] = [self._prompt(e, self._text(e, None)) for e in self.train_examples]
        self.val: list[Prompt] = [self._prompt(e, self._text(e, None)) for e in self.val_examples]
        self.dropped = {"train": 0, "validation": 0}

    def _text(self, example: Example, tokenizer) -> str:
        return format_prompt(
            example.question,
            suffix=self.suffix,
            tokenizer=tokenizer,
            use_chat_template=self.chat_template if tokenizer is not None else False,
            system_prompt=self.system_prompt,
            tools=self.tools_for(example.columns),
        )

    @staticmethod
    def _prompt(example: Example, text: str) -> Prompt:
        return Prompt(
            text=text, answer=example.answer, meta={"question": example.question, **example.columns}
        )

    def prepare(self, tokenizer, *, max_prompt_length: int) -> None:
        """Render prompts with the policy's chat template and drop (or refuse) those over the limit."""
        for split, examples in (("train", self.train_examples), ("validation", self.val_examples)):
            prompts = [self._prompt(e, self._text(e, tokenizer)) for e in examples]
            keep, dropped = filter_by_length(
                [p.text for p in prompts],
                tokenizer,
                max_length=max_prompt_length,
                on_overflow=self.on_long_prompt,
            )
            self.dropped[split] = dropped
            if dropped:
                log.warning("%s: %d %s prompts longer than rollout.max_prompt_length=%d were dropped",
                            self.name, dropped, split, max_prompt_length)  # fmt: skip
            kept = [prompts[i] for i in keep]
            if split == "train":
                self.train = kept
            else:
                self.val = kept
        if not self.train:
            raise ConfigError(
                f"no {self.name} training prompt fits rollout.max_prompt_length={max_prompt_length}"
            )

    def prompts_for_step(self, step: int, n: int, *, seed: int) -> list[Prompt]:
        """Epochs over the training set, each in its own seeded order (no prompt repeats within one)."""
        size = len(self.train)
        out = []
        for index in range(step * n, (step + 1) * n):
            epoch, offset = divmod(index, size)
            order = np.random.default_rng([seed, epoch]).permutation(size)
            out.append(self.train[order[offset]])
        return out

    def train_prompts(self, n: int, *, rng: np.random.Generator) -> list[Prompt]:
        return [self.train[i] for i in rng.integers(0, len(self.train), size=n)]

    def eval_prompts(self) -> list[Prompt]:
        return list(self.val)

    def reward(self, prompt: Prompt, completion: str) -> float:
        if self.verifier == "gsm8k":
            return gsm8k_reward(
                completion, prompt.answer, mode=self.answer_mode, format_score=self.format_score
            )
        return math_reward(completion, prompt.answer, format_score=self.format_score)

    def extract_answer(self, prompt: Prompt, completion: str) -> str | None:
        if self.verifier == "gsm8k":
            return extract_gsm8k_answer(completion, mode=self.answer_mode)
        boxed = last_boxed(completion)
        return None if boxed is None else normalize_math_answer(boxed) or None

    def grade(self, prompt: Prompt, completion: str) -> tuple[float, bool]:
        r = self.reward(prompt, completion)
        return r, r >= 1.0  # a format score alone is not a correct answer

    def sft_examples(self, n: int, *, rng: np.random.Generator) -> list[tuple[str, str]]:
        """Worked solutions when the data has them, else just the formatted final answer."""
        pairs = []
        for i in rng.integers(0, len(self.train_examples), size=n):
            e = self.train_examples[i]
            target = e.columns.get("solution") or (
                f"#### {e.answer}" if self.verifier == "gsm8k" else f"\\boxed{{{e.answer}}}"
            )
            pairs.append((self._text(e, None), str(target)))
        return pairs

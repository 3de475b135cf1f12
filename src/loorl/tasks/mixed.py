"""`task=mix`: training data from several sources in one run, each with its own verifier.

As verl's `data.train_files="['gsm8k/train.parquet', 'math/train.parquet']"`, where each row's data
source chooses its reward: `data.sources` maps a source name to its data and verifier
(`{verifier: gsm8k|math, path: ..., weight: 1.0, suffix: ..., ...}`, the options of `task=gsm8k`).
Every prompt carries its source (`Prompt.meta["source"]`); grading dispatches to that source's
verifier; a step's B prompts are split over the sources in proportion to their weights (largest
remainders, so the split is exact and the same every step) and shuffled; validation covers every
source's held-out prompts. The rollout and validation metrics come per source as well as overall
(`rollout/reward/<source>`, `val/accuracy/<source>`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from loorl.errors import ConfigError
from loorl.tasks.base import Task
from loorl.tasks.dataset_task import VERIFIERS, DatasetTask
from loorl.types import Prompt

SOURCE_DEFAULTS = {"weight": 1.0, "suffix": "", "answer_mode": "strict", "format_score": 0.0}
DATA_KEYS = ("path", "train_split", "val_split", "layout", "question_key", "answer_key", "limit", "val_limit")


def quotas(n: int, weights: list[float]) -> list[int]:
    """n split in proportion to `weights`, rounding by largest remainders (sums to n exactly)."""
    total = sum(weights)
    exact = [n * w / total for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


class MixedTask(Task):
    def __init__(
        self,
        *,
        name: str = "mix",
        sources: dict,
        chat_template: bool | str = "auto",
        system_prompt: str | None = None,
        on_long_prompt: str = "filter",
        max_new_tokens: int = 512,  # the default of rollout.max_new_tokens; unused here
    ) -> None:
        if not sources:
            raise ConfigError("data.sources is empty: name at least one source {verifier, path, weight}")
        self.name = name
        self.sources: dict[str, DatasetTask] = {}
        self.weights: list[float] = []
        for source, spec in sources.items():
            spec = {**SOURCE_DEFAULTS, **dict(spec)}
            if spec.get("verifier") not in VERIFIERS:
                choices = ", ".join(VERIFIERS)
                raise ConfigError(
                    f"data.sources.{source}.verifier={spec.get('verifier')!r} is not one of: {choices}"
                )
            if not float(spec["weight"]) > 0:
                raise ConfigError(f"data.sources.{source}.weight={spec['weight']} must be positive")
            unknown = set(spec) - set(SOURCE_DEFAULTS) - set(DATA_KEYS) - {"verifier"}
            if unknown:
                raise ConfigError(f"data.sources.{source}.{sorted(unknown)[0]} is not a source setting")
            self.sources[source] = DatasetTask(
                name=source,
                verifier=spec["verifier"],
                data={k: spec[k] for k in DATA_KEYS if k in spec},
                suffix=spec["suffix"],
                chat_template=chat_template,
                system_prompt=system_prompt,
                answer_mode=spec["answer_mode"],
                format_score=spec["format_score"],
                on_long_prompt=on_long_prompt,
            )
            self.weights.append(float(spec["weight"]))

    @property
    def source_names(self) -> list[str]:
        return list(self.sources)

    @staticmethod
    def _tag(prompts: list[Prompt], source: str) -> list[Prompt]:
        return [replace(p, meta={**p.meta, "source": source}) for p in prompts]

    def prepare(self, tokenizer, *, max_prompt_length: int) -> None:
        for task in self.sources.values():
            task.prompt_tools, task.route_column = self.prompt_tools, self.route_column  # (set by build_task)
            task.prepare(tokenizer, max_prompt_length=max_prompt_length)

    def prompts_for_step(self, step: int, n: int, *, seed: int) -> list[Prompt]:
        """Each source's quota of the step's n prompts (its own epoch order), shuffled together."""
        out = []
        for (source, task), count in zip(self.sources.items(), quotas(n, self.weights)):
            if count:  # each source keeps its own stream: step * count onwards in its epochs
                out += self._tag(task.prompts_for_step(step, count, seed=seed), source)
        order = np.random.default_rng([seed, step, 7]).permutation(len(out))
        return [out[i] for i in order]

    def train_prompts(self, n: int, *, rng: np.random.Generator) -> list[Prompt]:
        out = []
        for (source, task), count in zip(self.sources.items(), quotas(n, self.weights)):
            out += self._tag(task.train_prompts(count, rng=rng), source)
        return [out[i] for i in rng.permutation(len(out))]

    def eval_prompts(self) -> list[Prompt]:
        return [p for source, task in self.sources.items() for p in self._tag(task.eval_prompts(), source)]

    def _source(self, prompt: Prompt) -> DatasetTask:
        return self.sources[prompt.meta["source"]]

    def reward(self, prompt: Prompt, completion: str) -> float | None:
        return self._source(prompt).reward(prompt, completion)

    def grade(self, prompt: Prompt, completion: str):
        return self._source(prompt).grade(prompt, completion)

    def grade_with_tools(self, prompt: Prompt, completion: str, calls):
        return self._source(prompt).grade_with_tools(prompt, completion, calls)

    def grade_many(self, prompts, completions, tool_calls=None):
        """Each source's verifier over its own samples (batched where the source batches)."""
        rewards, correct, first = [None] * len(prompts), [False] * len(prompts), None
        for source, task in self.sources.items():
            idx = [i for i, p in enumerate(prompts) if p.meta["source"] == source]
            if not idx:
                continue
            calls = None if tool_calls is None else [tool_calls[i] for i in idx]
            r, c, err = task.grade_many(
                [prompts[i] for i in idx], [completions[i] for i in idx], tool_calls=calls
            )
            for j, i in enumerate(idx):
                rewards[i], correct[i] = r[j], c[j]
            first = first or err
        return rewards, correct, first

    def extract_answer(self, prompt: Prompt, completion: str) -> str | None:
        return self._source(prompt).extract_answer(prompt, completion)

    def votes_on_answers(self, prompt: Prompt) -> bool:
        return self._source(prompt).votes_on_answers(prompt)

    def run_facts(self) -> dict[str, str]:
        return {key: value for task in self.sources.values() for key, value in task.run_facts().items()}

    def sft_examples(self, n: int, *, rng: np.random.Generator) -> list[tuple[str, str]]:
        out = []
        for task, count in zip(self.sources.values(), quotas(n, self.weights)):
            out += task.sft_examples(count, rng=rng)
        return [out[i] for i in rng.permutation(len(out))]

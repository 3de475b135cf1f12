"""The weighted sum of reward functions over a rollout's [B, K] completions (`RewardComposer`, built
from the `reward` settings by `build_composer`): the task's verifier runs once per sample for both the
reward and the correctness (`Graded`), the other functions through `loorl.rewards.calling`."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loorl.rewards.calling import RewardFn, call_isolated, finite_or_nan
from loorl.settings import RewardSettings
from loorl.tasks.base import Task
from loorl.types import Prompt

log = logging.getLogger(__package__)  # "loorl.rewards", the logger's name before the code moved here


@dataclass
class WeightedReward:
    name: str
    fn: RewardFn | str  # a callable, or TASK_VERIFIER
    weight: float = 1.0


TASK_VERIFIER = "task"  # `fn: task` in conf/reward: the task's own verifier (Task.grade)


@dataclass
class Graded:
    """A rollout's rewards and correctness, from one verifier pass per sample."""

    rewards: torch.Tensor  # [B, K] the combined reward; NaN = unscorable
    correct: torch.Tensor  # [B, K] 1.0 correct, 0.0 wrong, NaN where the task's verifier gave no verdict
    # (unscorable: left out of accuracy, pass@k and maj@k rather than counted as wrong)
    unscorable: int  # samples whose combined reward is NaN
    parts: dict[str, torch.Tensor]  # [B, K] each function's reward (NaN = unscorable) by its name

    def columns(self, cols: slice) -> Graded:
        """The samples `cols` of every group (the K sampled ones, apart from a greedy one beside them)."""
        rewards = self.rewards[:, cols]  # [B, k]
        return Graded(rewards, self.correct[:, cols], int(rewards.isnan().sum()),
                      {name: v[:, cols] for name, v in self.parts.items()})  # fmt: skip


def verify_samples(task: Task, prompts: Sequence[Prompt], completions: Sequence[str], tool_calls=None):
    """The task's verifier once per sample (`Task.grade_many`; `tool_calls`: each sample's calls, with
    tools on): (rewards, correct, first error); a sample whose verifier fails or gives no verdict gets a
    NaN reward and a NaN correctness (unscorable: neither right nor wrong)."""
    rewards, correct, first = task.grade_many(list(prompts), list(completions), tool_calls=tool_calls)
    rewards = [finite_or_nan(r) for r in rewards]
    return (
        rewards,
        [float(bool(ok)) if not math.isnan(r) else math.nan for r, ok in zip(rewards, correct)],
        first,
    )


def correctness(task: Task, prompts: Sequence[Prompt], texts: Sequence[Sequence[str]]) -> torch.Tensor:
    """1.0 correct, 0.0 wrong, NaN unscorable, [B, K] for `texts` [B][K] (`verify_samples`: the task's
    verifier once per sample)."""
    flat_prompts, flat_texts = _flatten(prompts, texts)
    _, correct, _ = verify_samples(task, flat_prompts, flat_texts)
    return torch.tensor(correct).view(len(prompts), len(texts[0]))  # [B, K]


def _flatten(prompts: Sequence[Prompt], texts: Sequence[Sequence[str]]) -> tuple[list[Prompt], list[str]]:
    """Group-major flat lists: sample k of prompt b at b*K + k, its prompt repeated K times."""
    k = len(texts[0])
    return [p for p in prompts for _ in range(k)], [t for group in texts for t in group]


class RewardComposer:
    """Weighted sum of reward functions over a rollout's [B, K] completions."""

    def __init__(
        self,
        functions: list[WeightedReward],
        *,
        task: Task | None = None,
        clip: tuple[float, float] | None = None,
    ) -> None:
        if not functions:
            raise ValueError("reward.functions is empty: name at least one reward function")
        if task is None and any(wr.fn == TASK_VERIFIER for wr in functions):
            raise ValueError("a `task` reward function needs the task")
        self.functions, self.task, self.clip = functions, task, clip
        self.warned: set[str] = set()

    @property
    def weights(self) -> dict[str, float]:
        """Each function's weight in the sum, by its name (the keys of `Graded.parts`)."""
        return {wr.name: wr.weight for wr in self.functions}

    def __call__(self, prompts: Sequence[Prompt], texts: Sequence[Sequence[str]], tool_calls=None) -> Graded:
        """Rewards [B, K] (NaN = unscorable), correctness [B, K], the unscorable count and each
        function's rewards [B, K]. The task's verifier runs once per sample, for both. `tool_calls`
        [B][K] (tools on): each sample's calls, for the task and the functions that take them."""
        k = len(texts[0])
        flat_prompts, flat_texts = _flatten(prompts, texts)
        flat_calls = None if tool_calls is None else [c for group in tool_calls for c in group]
        verdicts = (
            verify_samples(self.task, flat_prompts, flat_texts, flat_calls) if self.task is not None else None
        )
        total = torch.zeros(len(flat_texts), dtype=torch.float64)  # [B*K]
        parts = {}
        for wr in self.functions:
            if wr.fn == TASK_VERIFIER:
                values, _, error = verdicts
            else:
                values, error = call_isolated(wr.fn, flat_prompts, flat_texts, flat_calls)
            v = torch.tensor(values, dtype=torch.float64)  # [B*K]
            bad = int(v.isnan().sum())
            if bad:
                # once per function at warning level; the count is logged every step (rollout/unscorable)
                level = logging.DEBUG if wr.name in self.warned else logging.WARNING
                self.warned.add(wr.name)
                log.log(
                    level,
                    "reward %s: %d of %d samples unscorable (first error: %r)",
                    wr.name,
                    bad,
                    len(v),
                    error,
                )
            parts[wr.name] = v.float().view(len(prompts), k)  # [B, K]
            total += wr.weight * v
        if self.clip is not None:
            total = total.clamp(*self.clip)  # NaN stays NaN
        rewards = total.float().view(len(prompts), k)  # [B, K]
        correct = torch.tensor(verdicts[1] if verdicts else [0.0] * len(flat_texts)).view(len(prompts), k)
        return Graded(rewards, correct, int(rewards.isnan().sum()), parts)


def build_composer(reward: RewardSettings, task: Task) -> RewardComposer:
    """From the `reward` settings: `fn: task` is the task's verifier, a mapping is instantiated by Hydra."""
    from hydra.utils import instantiate

    functions = []
    for name, spec in reward.functions.items():
        fn = TASK_VERIFIER if spec.fn == TASK_VERIFIER else instantiate(spec.fn)
        functions.append(WeightedReward(name=name, fn=fn, weight=float(spec.weight)))
    return RewardComposer(functions, task=task, clip=reward.clip)

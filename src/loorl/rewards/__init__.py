"""Rewarding completions: the task's verifier, reward models and custom functions, combined with weights.

A reward function is any callable with TRL's signature,
`fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]`, where `columns`
holds the dataset's other columns as lists (one value per sample). With tools on (`tools.max_turns`
> 0), a function that takes `tool_calls` (by name, or `**kwargs`) also gets each sample's calls, a
list of `loorl.tools.ToolCall` (`.text`, `.result`, `.status`, `.made`) per sample; the completion
text is the whole transcript, results included. `conf/reward/*.yaml` names them:

    functions:
      correct: {fn: task, weight: 1.0}                       # the task's own verifier
      short: {fn: {_target_: my.module.brevity, _partial_: true}, weight: 0.1}
    clip: [-1, 1]                                            # optional, after combining

A sample whose reward cannot be computed (the function raises for it, or returns None, NaN or
inf) is unscorable: its combined reward is NaN, which the estimators leave out of every baseline,
and it is counted. When a batched call raises, the function is called again one sample at a time
so that one bad sample does not take its whole batch down.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loorl.settings import RewardSettings
from loorl.tasks.base import Task
from loorl.types import Prompt

log = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float | None]]


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


def grade(task: Task, prompts: Sequence[Prompt], completions: Sequence[str], tool_calls=None):
    """The task's verifier once per sample (`Task.grade_many`; `tool_calls`: each sample's calls, with
    tools on): (rewards, correct, first error); a sample whose verifier fails or gives no verdict gets a
    NaN reward and a NaN correctness (unscorable: neither right nor wrong)."""
    rewards, correct, first = task.grade_many(list(prompts), list(completions), tool_calls=tool_calls)
    rewards = [_as_float(r) for r in rewards]
    return (
        rewards,
        [float(bool(ok)) if not math.isnan(r) else math.nan for r, ok in zip(rewards, correct)],
        first,
    )


def correctness(task: Task, prompts: Sequence[Prompt], texts: Sequence[Sequence[str]]) -> torch.Tensor:
    """1.0 correct, 0.0 wrong, NaN unscorable, [B, K] for `texts` [B][K] (one `grade` per sample)."""
    flat_prompts, flat_texts = _flatten(prompts, texts)
    _, correct, _ = grade(task, flat_prompts, flat_texts)
    return torch.tensor(correct).view(len(prompts), len(texts[0]))  # [B, K]


def _flatten(prompts: Sequence[Prompt], texts: Sequence[Sequence[str]]) -> tuple[list[Prompt], list[str]]:
    """Group-major flat lists: sample k of prompt b at b*K + k, its prompt repeated K times."""
    k = len(texts[0])
    return [p for p in prompts for _ in range(k)], [t for group in texts for t in group]


def takes_tool_calls(fn: RewardFn) -> bool:
    """Whether a reward function takes `tool_calls`: by name, or through `**kwargs`."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    return any(p.name == "tool_calls" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _as_float(value) -> float:
    try:
        value = float("nan") if value is None else float(value)
    except (TypeError, ValueError):
        return float("nan")
    return value if math.isfinite(value) else float("nan")


def _call(fn: RewardFn, prompts: list[Prompt], completions: list[str], tool_calls=None) -> list[float]:
    columns: dict[str, list] = {}
    for key in sorted({k for p in prompts for k in p.meta}):
        columns[key] = [p.meta.get(key) for p in prompts]
    if tool_calls is not None and takes_tool_calls(fn):
        columns["tool_calls"] = [list(calls) for calls in tool_calls]
    out = list(fn(prompts=[p.text for p in prompts], completions=completions, **columns))
    if len(out) != len(completions):
        raise ValueError(f"returned {len(out)} rewards for {len(completions)} completions")
    return [_as_float(v) for v in out]


def call_isolated(
    fn: RewardFn, prompts: list[Prompt], completions: list[str], tool_calls=None
) -> tuple[list[float], Exception | None]:
    """Rewards of a batch, NaN where unscorable; on a raising batch, retry sample by sample."""
    try:
        return _call(fn, prompts, completions, tool_calls), None
    except Exception as err:  # noqa: BLE001 - user reward code may raise anything
        first = err
    values = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        try:
            values.append(_call(fn, [p], [c], None if tool_calls is None else [tool_calls[i]])[0])
        except Exception:  # noqa: BLE001
            values.append(float("nan"))
    return values, first


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

    def __call__(self, prompts: Sequence[Prompt], texts: Sequence[Sequence[str]], tool_calls=None) -> Graded:
        """Rewards [B, K] (NaN = unscorable), correctness [B, K], the unscorable count and each
        function's rewards [B, K]. The task's verifier runs once per sample, for both. `tool_calls`
        [B][K] (tools on): each sample's calls, for the task and the functions that take them."""
        k = len(texts[0])
        flat_prompts, flat_texts = _flatten(prompts, texts)
        flat_calls = None if tool_calls is None else [c for group in tool_calls for c in group]
        verdicts = grade(self.task, flat_prompts, flat_texts, flat_calls) if self.task is not None else None
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

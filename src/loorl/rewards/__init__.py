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

The package holds: `composer` (`RewardComposer`, the weighted sum; `WeightedReward`, `TASK_VERIFIER`,
the verifier pass `verify_samples`, `correctness`, `Graded`, `build_composer`), `calling` (one
function called: its columns, its tool calls, one bad sample isolated), `model` (a learned reward
model), `library` (length and format rewards) and `shaping` (the overlong penalty on tokens). The
names of `composer` and `calling` are imported from `loorl.rewards` itself.
"""

from __future__ import annotations

from loorl.rewards.calling import RewardFn, call_isolated, takes_tool_calls
from loorl.rewards.composer import (
    TASK_VERIFIER,
    Graded,
    RewardComposer,
    WeightedReward,
    build_composer,
    correctness,
    verify_samples,
)

__all__ = [
    "TASK_VERIFIER",
    "Graded",
    "RewardComposer",
    "RewardFn",
    "WeightedReward",
    "build_composer",
    "call_isolated",
    "correctness",
    "takes_tool_calls",
    "verify_samples",
]

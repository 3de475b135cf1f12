"""Multi-turn rollouts with tools (`tools.max_turns` > 0): what the DataModule reads of them.

The engine that generates in turns, `ToolEngine`, wraps the run's engine
(`loorl.rollout.engines.wrappers.tool_engine`, re-exported here); this module holds the pure functions
over its completions: the step's `tools/*` counts and metrics (`tool_counts`, `tool_stats`),
validation's per-group counts (`environment_failures`, `used_a_tool`), the tool calls a reward
function reads (`tool_calls_of`), an environment's own rewards (`environment_rewards`) and the row an
environment's `reset` takes (`row_of`).
"""

from __future__ import annotations

import math

import torch

from loorl.rewards import Graded
from loorl.rollout.engines.wrappers.tool_engine import (  # noqa: F401 - importable here, as before
    ToolEngine,
    Transcript,
    check_engine,
    session_seed,
    turn_seed,
    user_message_tail,
)
from loorl.tools.base import ToolCall
from loorl.types import Completion, Prompt

# Completion.environment_events, counted per step
ENVIRONMENT_EVENTS = ("reset_failed", "reward_failed", "worker_lost", "session_lost", "reset_text_in_prompt",
                      "reset_text_after")  # fmt: skip
TOOL_COUNTS = ("samples", "calls", "used", "errors", "timeouts", "truncated", "unclosed", "turns", "seconds",
               "generated", "inserted", "crashes", *ENVIRONMENT_EVENTS)  # fmt: skip


def tool_counts(completions: list[Completion]) -> list[float]:
    """This rank's sums over its samples, in `TOOL_COUNTS` order (summed over ranks by the caller)."""
    calls = [call for c in completions for call in c.tool_calls]
    made = [call for call in calls if call.made]
    return [
        float(len(completions)),
        float(len(made)),
        float(sum(any(call.made for call in c.tool_calls) for c in completions)),
        float(sum(call.status in ("error", "nested") for call in made)),
        float(sum(call.status == "timeout" for call in made)),
        float(sum(call.status == "truncated" for call in made)),
        float(sum(not call.made for call in calls)),
        float(sum(c.turns for c in completions)),
        float(sum(call.seconds for call in made)),
        float(sum(len(c.token_ids) - c.inserted for c in completions)),
        float(sum(c.inserted for c in completions)),
        float(sum(call.status == "crashed" for call in made)),
        *(float(sum(c.environment_events.count(kind) for c in completions)) for kind in ENVIRONMENT_EVENTS),
    ]


def tool_stats(counts: list[float]) -> dict[str, float]:
    """The step's `tools/*` metrics from the summed `tool_counts`."""
    n = dict(zip(TOOL_COUNTS, counts))
    samples = max(n["samples"], 1.0)
    return {
        "tools/calls_per_sample": n["calls"] / samples,
        "tools/used_frac": n["used"] / samples,  # samples that called a tool at least once
        # calls whose tool raised, or that were malformed (nested, no opening tag)
        "tools/errors": n["errors"],
        "tools/timeouts": n["timeouts"],
        "tools/truncated": n["truncated"],  # results cut to tools.max_result_chars
        "tools/unclosed": n["unclosed"],  # calls opened and never closed (the sample ended first)
        "tools/turns_per_sample": n["turns"] / samples,
        "perf/tool_seconds": n["seconds"],  # the calls' own seconds, summed (tools.workers run at a time)
        "tools/generated_tokens": n["generated"],
        "tools/inserted_tokens": n["inserted"],
        # an environment's failures (environment._target_): calls whose worker process exited, died by a
        # signal or ran out of memory; samples whose constructor or reset failed; get_reward failures (also
        # in rollout/unscorable); worker processes killed or dead (timeouts and crashes in calls, resets and
        # get_reward); samples whose instance went down with a worker another sample's call ended
        "tools/crashes": n["crashes"],
        "tools/env_reset_failures": n["reset_failed"],
        "tools/env_reward_failures": n["reward_failed"],
        "tools/env_workers_lost": n["worker_lost"],
        "tools/env_sessions_lost": n["session_lost"],
        # samples whose reset's text went into their group's shared prompt (the K texts agreed), and
        # samples whose text was inserted after the prompt (they differed)
        "tools/env_reset_text_in_prompt": n["reset_text_in_prompt"],
        "tools/env_reset_text_after": n["reset_text_after"],
    }


FAILURE_EVENTS = ("reset_failed", "reward_failed", "worker_lost", "session_lost")  # an instance that failed


def environment_failures(groups: list[list[Completion]]) -> torch.Tensor:
    """[B] each group's samples whose environment instance failed (`FAILURE_EVENTS`): validation's
    count of what the training steps count in `tools/env_*`."""
    return torch.tensor([float(sum(any(e in FAILURE_EVENTS for e in c.environment_events) for c in g))
                         for g in groups])  # fmt: skip


def used_a_tool(groups: list[list[Completion]]) -> torch.Tensor | None:
    """[B] 1.0 where the group's first completion made a tool call (validation's greedy answers); None
    for completions of a run without tools."""
    calls = tool_calls_of([g[:1] for g in groups])  # [B][1]
    return None if calls is None else torch.tensor([float(any(c.made for c in g[0])) for g in calls])


def tool_calls_of(groups: list[list[Completion]]) -> list[list[tuple[ToolCall, ...]]] | None:
    """[B][K] each completion's tool calls, for the rewards; None for completions of a run without
    tools (their reward functions are called as before, without `tool_calls`)."""
    if not any(c.policy_mask is not None for g in groups for c in g):
        return None
    return [[c.tool_calls for c in g] for g in groups]


def environment_rewards(graded: Graded, groups: list[list[Completion]]) -> Graded:
    """`graded` with an environment's `get_reward()` as the reward of each sample that carries one
    (`Completion.reward`; NaN where it failed: unscorable, counted), the task's correctness kept for
    accuracy; `graded` itself where no sample does (no environment, or one without `get_reward`)."""
    owned = [[c.reward for c in g] for g in groups]  # [B][K]
    if all(r is None for row in owned for r in row):
        return graded
    has = torch.tensor([[r is not None for r in row] for row in owned])  # [B, K]
    env = torch.tensor([[math.nan if r is None else r for r in row] for row in owned])  # [B, K]
    rewards = torch.where(has, env, graded.rewards)  # [B, K]
    return Graded(rewards, graded.correct, int(rewards.isnan().sum()), {"environment": rewards})


def row_of(prompt: Prompt) -> dict:
    """A prompt's fields as an environment's `reset(**row)` takes them: its columns (`meta`), the
    prompt's text as `prompt` and the reference answer as `answer`."""
    return {**prompt.meta, "prompt": prompt.text, "answer": prompt.answer}

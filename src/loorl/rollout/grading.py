"""Grading a step's completions: the reward functions' and the verifier's verdicts on every sample
(one pass), the truncation and overlong-length rules, the batch assembled, and the step's statistics
(every rank's samples). What the task learns from them (`Task.observe`: a curriculum) is returned
beside the rollout, not given to it: the caller decides when the rollout is the one trained on.
"""

from __future__ import annotations

from typing import Any

import torch

from loorl.parallel.distributed import all_reduce
from loorl.rewards import RewardComposer
from loorl.rewards.shaping import overlong_penalty
from loorl.rollout.batch import assemble
from loorl.rollout.multi_turn import environment_rewards, tool_calls_of, tool_counts, tool_stats
from loorl.rollout.step_stats import (
    gather_graded,
    prompt_digest,
    rollout_stats,
    source_index,
    source_outcomes,
    source_stats,
)
from loorl.settings import OverlongSettings
from loorl.tasks.base import Task
from loorl.types import Completion, Prompt, Rollout
from loorl.util.profiling import PhaseClock

# each source's samples of a whole step as 1 (correct) or 0, what `Task.observe` reads
Outcomes = dict[str, list[int]]


class Grader:
    """Turns a step's completions into its `Rollout`: rewards (`rewards`, the task's verifier by
    default), `rollout.truncated`'s rule for samples cut at the length limit, `reward.overlong`'s
    penalty against `completion_tokens`, and the step's statistics."""

    def __init__(
        self,
        *,
        task: Task,
        tokenizer: Any,
        rewards: RewardComposer,
        truncated: str,
        overlong: OverlongSettings,
        completion_tokens: int,
    ) -> None:
        self.task, self.tokenizer, self.rewards = task, tokenizer, rewards
        self.truncated, self.overlong, self.completion_tokens = truncated, overlong, completion_tokens

    def texts(self, groups: list[list[Completion]]) -> list[list[str]]:
        """Completion texts [B][K], without the end-of-sequence token that ended them."""
        return [[self.tokenizer.decode(c.text_ids, skip_special_tokens=True) for c in g] for g in groups]

    def graded_rollout(
        self,
        prompts: list[Prompt],
        prompt_ids: list[list[int]],
        groups: list[list[Completion]],
        *,
        gen_seconds: float,
        step: int,
    ) -> tuple[Rollout, Outcomes]:
        """The completions [B][K] of `prompts` graded and assembled into the step's rollout, and the
        step's outcomes for `Task.observe` (the same on every rank). Collectives: every rank calls it."""
        clock = PhaseClock()
        with clock.phase("grade"):
            graded = self.rewards(prompts, self.texts(groups), tool_calls_of(groups))  # [B, K]
            graded = environment_rewards(graded, groups)  # [B, K] an environment's get_reward()
        rewards = graded.rewards  # [B, K]
        finished = torch.tensor([[c.finished for c in g] for g in groups])  # [B, K]
        if self.truncated == "zero":
            rewards = torch.where(finished | rewards.isnan(), rewards, torch.zeros_like(rewards))
        sizes = torch.tensor([[len(c.token_ids) for c in g] for g in groups], dtype=torch.float)  # [B, K]
        inserted = torch.tensor([[c.inserted for c in g] for g in groups], dtype=torch.float)  # [B, K]
        lengths = sizes - inserted  # [B, K] the tokens each sample generated (without tool results)
        if self.overlong.buffer:  # against the sample's limit, which counts inserted tool results too
            penalty = overlong_penalty(sizes, max_len=self.completion_tokens, buffer=self.overlong.buffer,
                                       penalty=self.overlong.penalty)  # fmt: skip
            rewards = rewards + penalty  # [B, K] NaN stays NaN
        batch = assemble(
            [g[0].prompt_ids or ids for g, ids in zip(groups, prompt_ids)],  # reset's text placed in some
            groups,
            pad_token_id=self.tokenizer.pad_token_id,
            rewards=rewards,
            loss_on_truncated=self.truncated != "mask",
            correct=graded.correct,
        )
        everyone = gather_graded(graded, lengths, finished)  # the whole step's, over all ranks
        stats = rollout_stats(*everyone, gen_seconds=float(all_reduce(gen_seconds, "max")))
        stats["rollout/prompt_digest"] = prompt_digest(prompts)
        if self.overlong.buffer:  # the mean penalty over the step's samples (all ranks)
            total, count = all_reduce(torch.stack([penalty.sum(), torch.tensor(penalty.numel())])).tolist()
            stats["rollout/overlong_penalty"] = total / count
        names = self.task.source_names
        if names:  # task=mix, task=reasoning_gym: per source
            index = source_index(prompts, names)  # [W*B] one all-gather for both
            stats |= source_stats(index, everyone[0], names)
        else:  # one source, the task itself
            index, names = torch.zeros(len(everyone[0].correct), dtype=torch.long), [self.task.name]  # [W*B]
        outcomes = source_outcomes(index, everyone[0], names)  # what a curriculum moves on
        flat = [c for g in groups for c in g]
        if any(c.policy_mask is not None for c in flat):  # multi-turn rollouts with tools (all ranks)
            stats |= tool_stats(all_reduce(tool_counts(flat)).tolist())
        stats["perf/grade_seconds"] = clock.seconds["grade"]
        return Rollout(step=step, batch=batch, stats=stats), outcomes

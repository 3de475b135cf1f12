"""Grading a step's completions: the reward functions' and the verifier's verdicts on every sample
(one pass), the truncation and overlong-length rules, the batch assembled, and the step's statistics
(every rank's samples). What the task learns from them (`Task.observe`: a curriculum) is returned
beside the rollout, not given to it: the caller decides when the rollout is the one trained on.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from loorl.parallel.distributed import all_reduce
from loorl.rewards import Graded, RewardComposer
from loorl.rewards.shaping import overlong_penalty
from loorl.rollout.batch import RewardParts, assemble
from loorl.rollout.multi_turn import environment_rewards, tool_calls_of, tool_counts, tool_stats
from loorl.rollout.step_stats import (
    gather_graded,
    gen_tokens_per_s,
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
        keep_parts: bool = False,
    ) -> None:
        self.task, self.tokenizer, self.rewards = task, tokenizer, rewards
        self.truncated, self.overlong, self.completion_tokens = truncated, overlong, completion_tokens
        self.keep_parts = keep_parts  # each reward function's rewards kept apart in the batch (GDPO)

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
        greedy: list[Completion] | None = None,
    ) -> tuple[Rollout, Outcomes]:
        """The completions [B][K] of `prompts` graded and assembled into the step's rollout, and the
        step's outcomes for `Task.observe` (the same on every rank). `greedy` [B]: a greedy completion
        of each prompt (ReMax's baseline), graded in the same pass by the same rules, its reward kept as
        the group's `reward_baselines`, never trained on and counted (`rollout/greedy_*`). Collectives:
        every rank calls it."""
        clock = PhaseClock()
        k = len(groups[0])
        graded_groups = groups if greedy is None else [g + [c] for g, c in zip(groups, greedy)]  # [B][K(+1)]
        with clock.phase("grade"):
            graded = self.rewards(prompts, self.texts(graded_groups), tool_calls_of(graded_groups))
            graded = environment_rewards(graded, graded_groups)  # [B, K(+1)] an environment's get_reward()
        finished = torch.tensor([[c.finished for c in g] for g in graded_groups])  # [B, K(+1)] ended by EOS
        rewards, parts, penalty = self._scored(graded, graded_groups, finished)  # [B, K(+1)]
        generated = [[len(c.token_ids) - c.inserted for c in g] for g in graded_groups]  # results left out
        lengths = torch.tensor(generated, dtype=torch.float)  # [B, K(+1)] the tokens each sample generated
        samples = graded.columns(slice(0, k))  # the sampled ones; column K is the greedy one
        batch = assemble(
            [g[0].prompt_ids or ids for g, ids in zip(groups, prompt_ids)],  # reset's text placed in some
            groups,
            pad_token_id=self.tokenizer.pad_token_id,
            rewards=rewards[:, :k],
            loss_on_truncated=self.truncated != "mask",
            correct=samples.correct,
            baselines=None if greedy is None else rewards[:, k],  # [B]
            parts=None if parts is None else replace(parts, values=parts.values[:, :k]),  # [B, K, D]
        )
        everyone = gather_graded(samples, lengths[:, :k], finished[:, :k])  # the whole step's, all ranks
        stats = rollout_stats(*everyone, gen_seconds=float(all_reduce(gen_seconds, "max")))
        stats["rollout/prompt_digest"] = prompt_digest(prompts)
        if self.overlong.buffer:  # the mean penalty over the step's samples (all ranks)
            mine = penalty[:, :k]  # [B, K]
            total, count = all_reduce(torch.stack([mine.sum(), torch.tensor(mine.numel())])).tolist()
            stats["rollout/overlong_penalty"] = total / count
        if greedy is not None:
            stats |= greedy_stats(rewards[:, k], graded.correct[:, k], lengths[:, k])
            stats["perf/gen_tokens_per_s"] = gen_tokens_per_s(stats)  # the greedy tokens took time too
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

    def _scored(self, graded: Graded, groups: list[list[Completion]], finished: torch.Tensor):
        """The rewards [B, K] after `rollout.truncated`'s rule (`finished` [B, K]: which samples ended)
        and `reward.overlong`'s penalty; with `keep_parts`, each reward function's rewards [B, K, D] after
        the same rule, the penalty as a part of its own (`overlong`, weight 1); the penalty [B, K] (0 when
        off)."""
        rewards = graded.rewards  # [B, K]
        values = torch.stack(list(graded.parts.values()), dim=-1) if self.keep_parts else None  # [B, K, D]
        if self.truncated == "zero":
            rewards = torch.where(finished | rewards.isnan(), rewards, torch.zeros_like(rewards))
            if values is not None:
                cut = ~finished.unsqueeze(-1) & ~values.isnan()  # [B, K, D]
                values = torch.where(cut, torch.zeros_like(values), values)
        sizes = torch.tensor([[len(c.token_ids) for c in g] for g in groups], dtype=torch.float)  # [B, K]
        penalty = torch.zeros_like(sizes)  # [B, K]
        if self.overlong.buffer:  # against the sample's limit, which counts inserted tool results too
            penalty = overlong_penalty(sizes, max_len=self.completion_tokens, buffer=self.overlong.buffer,
                                       penalty=self.overlong.penalty)  # fmt: skip
            rewards = rewards + penalty  # [B, K] NaN stays NaN
        parts = None
        if values is not None:
            names = tuple(graded.parts)
            weights = tuple(self.rewards.weights.get(n, 1.0) for n in names)  # an environment's reward: 1
            if self.overlong.buffer:
                values = torch.cat([values, penalty.unsqueeze(-1)], dim=-1)  # [B, K, D + 1]
                names, weights = (*names, "overlong"), (*weights, 1.0)
            parts = RewardParts(values, names, weights)
        return rewards, parts, penalty


def greedy_stats(rewards: torch.Tensor, correct: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """The step's greedy completions (ReMax's baselines, [B] on this rank: their rewards after the
    rules, verdicts and tokens), over all ranks: how many, their mean reward and accuracy over the
    scorable ones, the unscorable ones (their groups get advantage 0) and their tokens. A collective."""
    scorable = ~rewards.isnan()  # [B]
    totals = torch.stack([
        torch.tensor(float(len(rewards))), scorable.sum().float(), torch.where(scorable, rewards, 0.0).sum(),
        torch.where(correct.isnan(), 0.0, correct).sum(), (~correct.isnan()).sum().float(), lengths.sum(),
    ])  # fmt: skip
    count, n_scorable, reward_sum, right, verdicts, tokens = all_reduce(totals).tolist()
    return {
        "rollout/greedy_samples": count,
        "rollout/greedy_reward_mean": reward_sum / max(n_scorable, 1.0),
        "rollout/greedy_accuracy": right / max(verdicts, 1.0),
        "rollout/greedy_unscorable": count - n_scorable,
        "rollout/greedy_gen_tokens": tokens,
    }

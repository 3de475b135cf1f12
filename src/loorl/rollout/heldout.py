"""Held-out evaluation of a batch of prompts: greedy correctness and reward, and sampled pass@k and
maj@k (`loorl.algo.sample_metrics`). The validation loop (`RolloutDataModule.val_dataloader`) and
`src/eval.py` both run it, through `RolloutDataModule.heldout_results`.
"""

from __future__ import annotations

import torch

from loorl.algo.sample_metrics import maj_at_k, pass_at_k
from loorl.rewards import correctness
from loorl.rollout.multi_turn import environment_failures, environment_rewards, tool_calls_of, used_a_tool
from loorl.rollout.sampling import StepSampler
from loorl.tasks.base import Task
from loorl.types import Prompt


@torch.no_grad()
def heldout_results(
    prompts: list[Prompt], *, sampler: StepSampler, pass_k: int, eval_samples: int, step: int
) -> dict:
    """Held-out metrics of a batch of prompts, per prompt: greedy correctness `correct` [n] and
    reward `reward` [n] (NaN: unscorable), the greedy `completions`; with `pass_k` = k > 0 also
    the unbiased pass@k and maj@k [n] of `eval_samples` (n >= k) sampled completions each, drawn with
    the seed of (`step`, the batch's first prompt)."""
    task, grader = sampler.task, sampler.grader
    ids = sampler.encode_prompts(prompts)
    completions = sampler.generate(ids, n=1, greedy=True, **sampler.rows(prompts))  # [n][1]
    greedy = grader.texts(completions)  # [n][1]
    graded = grader.rewards(prompts, greedy, tool_calls_of(completions))  # [n, 1]
    graded = environment_rewards(graded, completions)  # [n, 1]
    results = {
        "prompts": [p.text for p in prompts],
        "completions": [g[0] for g in greedy],
        "correct": graded.correct.view(-1),  # [n] NaN: unscorable (left out of val/accuracy)
        "reward": graded.rewards.view(-1),  # [n]
        "unscorable": graded.correct.view(-1).isnan().float(),  # [n] counted in val/unscorable
        "tool_used": used_a_tool(completions),  # [n] None without tools
        # [n] samples whose environment instance failed; None without an environment
        "env_failures": environment_failures(completions) if sampler.rows(prompts) else None,
        "pass_k": None,
        "maj_k": None,
        "sources": [p.meta.get("source") for p in prompts],  # task=mix: each prompt's source
        "source_names": task.eval_source_names,
        # [n] the prompts the overall val/* metrics cover (task.eval_levels' sets: their source's only)
        "in_overall": torch.tensor([p.meta.get("in_overall", True) for p in prompts]),
    }
    if pass_k > 0:
        seed = sampler.sampler_seed("validation", step, prompts[0].text)  # this batch's own stream
        sampler.use_step_temperature(step)  # rollout.temperature_schedule: the step's temperature
        sampled = sampler.generate(ids, n=eval_samples, seed=seed, **sampler.rows(prompts))
        if results["env_failures"] is not None:
            results["env_failures"] = results["env_failures"] + environment_failures(sampled)  # [n]
        sampled = grader.texts(sampled)  # [n][N]
        correct = correctness(task, prompts, sampled)  # [n, N] NaN: unscorable
        scorable = ~correct.isnan()  # [n, N]
        results["pass_k"] = pass_at_k(scorable.sum(-1), correct.nansum(-1), pass_k)  # [n] of the scorable
        answers = [[extracted_answer(task, p, t) for t in row] for p, row in zip(prompts, sampled)]
        majority = maj_at_k(answers, correct, pass_k)  # [n]
        voted = torch.tensor([task.votes_on_answers(p) for p in prompts])  # [n]
        results["maj_k"] = torch.where(voted, majority, torch.nan)  # [n] NaN: not a votable task
    return results


def extracted_answer(task: Task, prompt: Prompt, text: str) -> str | None:
    """The task's extracted answer; None where the extractor fails on odd text."""
    try:
        return task.extract_answer(prompt, text)
    except Exception:  # noqa: BLE001 - as a failing verifier: that sample has no answer
        return None

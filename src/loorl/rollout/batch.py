"""Prompts and their completions padded into one `RolloutBatch` (group-major: a prompt's K samples stay
together)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from loorl.types import Completion, RolloutBatch
from loorl.util.padding import pad


@dataclass(frozen=True)
class RewardParts:
    """Each reward function's rewards apart, for an estimator that combines them itself (GDPO)."""

    values: torch.Tensor  # [B, K, D] NaN: unscorable
    names: tuple[str, ...]  # [D]
    weights: tuple[float, ...]  # [D] their weights in the reward's sum


PER_ROW = ("reward_parts",)  # [N, D] fields: one row per sample, not per token


def assemble(
    prompt_ids: list[list[int]],
    completions: list[list[Completion]],
    *,
    pad_token_id: int,
    rewards: torch.Tensor,
    advantages: torch.Tensor | None = None,
    loss_on_truncated: bool = True,
    correct: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    parts: RewardParts | None = None,
) -> RolloutBatch:
    """Pad prompts (left) and completions (right) into one tensor per field.

    `loss_on_truncated=False` masks completions cut by the length limit out of the loss. `baselines`
    [B]: each group's greedy reward (ReMax), repeated over its rows; `parts`: each reward function's
    rewards [B, K, D] (GDPO).
    """
    k = len(completions[0])
    flat = [c for group in completions for c in group]  # row g*K + i is sample i of prompt g
    c_len = max(1, max(len(c.token_ids) for c in flat))
    prompts, prompt_mask = pad([p for p in prompt_ids for _ in range(k)], value=pad_token_id, side="left")
    tokens, token_mask = pad([c.token_ids for c in flat], value=pad_token_id, side="right", width=c_len)
    logprobs, _ = pad([c.logprobs for c in flat], value=0.0, side="right", width=c_len, dtype=torch.float)
    in_loss = torch.tensor([c.finished or loss_on_truncated for c in flat]).unsqueeze(-1)  # [N, 1]
    loss_mask = token_mask  # [N, C]
    # multi-turn: inserted tokens (tool results) carry no loss
    if any(c.policy_mask is not None for c in flat):
        own = [c.policy_mask if c.policy_mask is not None else [1] * len(c.token_ids) for c in flat]
        policy, _ = pad(own, value=0, side="right", width=c_len)  # [N, C] 1 on the policy's own tokens
        loss_mask = token_mask * policy  # the attention mask keeps the results: the policy saw them
    return RolloutBatch(
        input_ids=torch.cat([prompts, tokens], dim=1),  # [N, P + C]
        attention_mask=torch.cat([prompt_mask, token_mask], dim=1),  # [N, P + C]
        completion_mask=(loss_mask * in_loss).float(),  # [N, C]
        sampler_logprobs=logprobs,
        rewards=rewards.reshape(-1).float(),
        advantages=None if advantages is None else advantages.reshape(-1).float(),
        samples_per_prompt=k,
        prompt_len=prompts.shape[1],
        correct=None if correct is None else correct.reshape(-1).float(),
        reward_baselines=None if baselines is None else baselines.float().repeat_interleave(k),  # [N]
        reward_parts=None if parts is None else parts.values.reshape(-1, len(parts.names)).float(),  # [N, D]
        reward_part_names=() if parts is None else parts.names,
        reward_part_weights=() if parts is None else parts.weights,
    )


def concatenate(batches: list[RolloutBatch], *, pad_token_id: int) -> RolloutBatch:
    """Batches of whole groups (one step's sampling rounds) as one, as `assemble` would have padded
    their groups together: prompts left-padded to the longest prompt part, completions right-padded
    to the longest completion part. Per-token fields [N, C] are padded with 0."""
    if len(batches) == 1:
        return batches[0]
    p_len = max(b.prompt_len for b in batches)
    c_len = max(b.input_ids.shape[1] - b.prompt_len for b in batches)
    k = batches[0].samples_per_prompt

    def widen(b: RolloutBatch, name: str) -> torch.Tensor | None:
        v = getattr(b, name)
        if v is None or v.dim() == 1 or name in PER_ROW:  # [N] and [N, D] per-row fields (rewards, ...)
            return v
        value = pad_token_id if name == "input_ids" else 0
        c_pad = c_len - (b.input_ids.shape[1] - b.prompt_len)
        if name in ("input_ids", "attention_mask"):  # [N, P + C]: prompt part left, completion part right
            return torch.nn.functional.pad(v, (p_len - b.prompt_len, c_pad), value=value)
        return torch.nn.functional.pad(v, (0, c_pad), value=value)  # [N, C]

    values = {}
    for f in fields(RolloutBatch):
        if f.name in ("samples_per_prompt", "prompt_len"):
            continue
        if not isinstance(getattr(batches[0], f.name), torch.Tensor | None):  # the parts' names and weights
            values[f.name] = getattr(batches[0], f.name)
            continue
        parts = [widen(b, f.name) for b in batches]
        values[f.name] = None if any(v is None for v in parts) else torch.cat(parts)
    return RolloutBatch(**values, samples_per_prompt=k, prompt_len=p_len)

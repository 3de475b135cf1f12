"""Prompts and their completions padded into one `RolloutBatch` (group-major: a prompt's K samples stay
together)."""

from __future__ import annotations

import torch

from loorl.types import Completion, RolloutBatch
from loorl.util.padding import pad


def assemble(
    prompt_ids: list[list[int]],
    completions: list[list[Completion]],
    *,
    pad_token_id: int,
    rewards: torch.Tensor,
    advantages: torch.Tensor | None = None,
    loss_on_truncated: bool = True,
) -> RolloutBatch:
    """Pad prompts (left) and completions (right) into one tensor per field.

    `loss_on_truncated=False` masks completions cut by the length limit out of the loss.
    """
    k = len(completions[0])
    flat = [c for group in completions for c in group]  # row g*K + i is sample i of prompt g
    c_len = max(1, max(len(c.token_ids) for c in flat))
    prompts, prompt_mask = pad([p for p in prompt_ids for _ in range(k)], value=pad_token_id, side="left")
    tokens, token_mask = pad([c.token_ids for c in flat], value=pad_token_id, side="right", width=c_len)
    logprobs, _ = pad([c.logprobs for c in flat], value=0.0, side="right", width=c_len, dtype=torch.float)
    in_loss = torch.tensor([c.finished or loss_on_truncated for c in flat]).unsqueeze(-1)  # [N, 1]
    return RolloutBatch(
        input_ids=torch.cat([prompts, tokens], dim=1),  # [N, P + C]
        attention_mask=torch.cat([prompt_mask, token_mask], dim=1),  # [N, P + C]
        completion_mask=(token_mask * in_loss).float(),  # [N, C]
        sampler_logprobs=logprobs,
        rewards=rewards.reshape(-1).float(),
        advantages=None if advantages is None else advantages.reshape(-1).float(),
        samples_per_prompt=k,
        prompt_len=prompts.shape[1],
    )

"""The tensors of one rollout, laid out group-major so that a prompt's K samples stay together."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from loorl.rollout.engine import Completion


@dataclass
class RolloutBatch:
    """N = num_groups * group_size sequences; row g*K + k is sample k of prompt g.

    Each row is the prompt left-padded to P tokens followed by the completion right-padded to C.
    """

    input_ids: torch.Tensor  # [N, P + C]
    attention_mask: torch.Tensor  # [N, P + C]
    completion_mask: torch.Tensor  # [N, C] 1.0 on completion tokens that enter the loss
    sampler_logprobs: torch.Tensor  # [N, C]
    rewards: torch.Tensor  # [N] task reward (NaN = unscorable)
    advantages: torch.Tensor  # [N]
    group_size: int
    prompt_len: int
    ref_logprobs: torch.Tensor | None = None  # [N, C] when a reference model is loaded
    old_logprobs: torch.Tensor | None = None  # [N, C] when the importance ratio can differ from 1

    @property
    def num_groups(self) -> int:
        return self.input_ids.shape[0] // self.group_size

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len :]  # [N, C]

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions counted from each row's first real token (left padding must not shift them)."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, P + C]

    def select_groups(self, groups: list[int]) -> RolloutBatch:
        """The rows of whole groups, in the given order."""
        k = self.group_size
        rows = torch.tensor([g * k + i for g in groups for i in range(k)], dtype=torch.long)  # [n*K]
        values = {}
        for f in fields(self):
            v = getattr(self, f.name)
            values[f.name] = v[rows] if isinstance(v, torch.Tensor) else v
        return RolloutBatch(**values)

    def to(self, device) -> RolloutBatch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutBatch(
            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        )


def assemble(
    prompt_ids: list[list[int]],
    completions: list[list[Completion]],
    *,
    pad_token_id: int,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    loss_on_truncated: bool = True,
) -> RolloutBatch:
    """Pad prompts (left) and completions (right) into one tensor per field.

    `loss_on_truncated=False` masks completions cut by the length limit out of the loss.
    """
    k = len(completions[0])
    p_len = max(map(len, prompt_ids))
    c_len = max(1, max(len(c.token_ids) for group in completions for c in group))
    n = len(prompt_ids) * k
    input_ids = torch.full((n, p_len + c_len), pad_token_id, dtype=torch.long)  # [N, P + C]
    attention = torch.zeros(n, p_len + c_len, dtype=torch.long)  # [N, P + C]
    comp_mask = torch.zeros(n, c_len)  # [N, C]
    logprobs = torch.zeros(n, c_len)  # [N, C]
    for g, (prompt, group) in enumerate(zip(prompt_ids, completions)):
        for i, c in enumerate(group):
            row, m = g * k + i, len(c.token_ids)
            input_ids[row, p_len - len(prompt) : p_len] = torch.tensor(prompt)
            attention[row, p_len - len(prompt) : p_len + m] = 1
            if m:
                input_ids[row, p_len : p_len + m] = torch.tensor(c.token_ids)
                logprobs[row, :m] = torch.tensor(c.logprobs)
                comp_mask[row, :m] = 1.0 if (c.finished or loss_on_truncated) else 0.0
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        completion_mask=comp_mask,
        sampler_logprobs=logprobs,
        rewards=rewards.reshape(-1).float(),
        advantages=advantages.reshape(-1).float(),
        group_size=k,
        prompt_len=p_len,
    )

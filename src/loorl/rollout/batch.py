"""The tensors of one rollout, laid out group-major so that a prompt's K samples stay together."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch

from loorl.padding import pad
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
    group_size: int
    prompt_len: int
    advantages: torch.Tensor | None = None  # [N] filled in by the learner (module.prepare)
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

    def groups_with_signal(self) -> list[int]:
        """The groups with a nonzero advantage in any row: a group whose every advantage is 0 (all its
        samples rewarded alike, under a group baseline) adds exactly nothing to the policy gradient.
        At least one group is returned, so that a pass still runs (and a data-parallel all-reduce
        still meets its peers)."""
        nonzero = (self.advantages != 0).view(self.num_groups, self.group_size).any(-1)  # [G]
        groups = nonzero.nonzero().flatten().tolist()
        return groups or [0]

    def group_chunks(self, groups_per_chunk: int | None) -> Iterator[RolloutBatch]:
        """The batch in consecutive pieces of whole groups (micro-batches, log-prob passes); the
        batch itself when one piece holds it all (`groups_per_chunk` None or large enough)."""
        size = self.num_groups if groups_per_chunk is None else max(1, groups_per_chunk)
        if size >= self.num_groups:
            yield self
            return
        for start in range(0, self.num_groups, size):
            yield self.select_groups(list(range(start, min(self.num_groups, start + size))))

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
        group_size=k,
        prompt_len=prompts.shape[1],
    )


@dataclass
class Rollout:
    """What the environment hands the learner for one RL iteration: the batch (prompts, completions,
    sampler log-probs, rewards) and the environment's statistics of it (reward spread, accuracy,
    lengths, generation speed). Not frozen: Lightning's batch transfer calls `to`."""

    step: int  # the RL iteration it belongs to
    batch: RolloutBatch
    stats: dict[str, float] = field(default_factory=dict)

    def to(self, device) -> Rollout:
        return Rollout(step=self.step, batch=self.batch.to(device), stats=self.stats)

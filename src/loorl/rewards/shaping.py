"""Reward shaping that depends on the completion's tokens, not its text: DAPO's soft overlong
punishment. Applied by the rollout DataModule after the reward functions (and their clip), before the
estimator and the dynamic-sampling filter see the reward."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of completions of `lengths` [...] tokens
    under a generation limit of `max_len`: 0 up to `max_len - buffer` tokens, then falling linearly to
    `-penalty` at `max_len` (a completion cut by the limit gets the whole penalty). `buffer` 0: no
    penalty. Same shape as `lengths`, float32, never positive."""
    if buffer == 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    excess = (lengths.to(torch.float32) - (max_len - buffer)).clamp(min=0) / buffer  # [...] 0-1 in it
    return -penalty * excess.clamp(max=1.0)

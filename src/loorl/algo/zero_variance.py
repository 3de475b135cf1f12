"""RL-ZVP (Le et al. 2025, arXiv 2509.21880, "No Prompt Left Behind"): a group whose samples were all
rewarded alike (a zero-variance prompt) still teaches, through token advantages shaped by entropy.

Where a group has reward spread, the estimator's advantage stands. Where it has none:

- all right (the common reward > 0): A_t = alpha * H_t, pushing up every token, the uncertain ones most;
- all wrong (the common reward <= 0): A_t = -alpha * (max_s H_s - H_t), pushing down the confident
  tokens of the sequence most and its most uncertain one not at all.

H_t is the policy's entropy over the vocabulary at token t, without gradient (`loss.zvp_alpha` turns
it on; `estimator=rl_zvp` is the paper's GRPO with alpha 0.1). The formula is the paper's equation 5
as two independent implementations write it (a NeMo-RL patch and a ludic plan, read in issue 81; the
paper's own text was not reachable from here): tests/test_zero_variance.py checks it by hand values.
No library computes it, hence by hand.

Shapes: B groups of K samples; n rows and C completion positions in the loss.
"""

from __future__ import annotations

import torch

from loorl.algo.estimator_registry import AdvantageInput


def zero_variance_signs(
    inp: AdvantageInput | torch.Tensor, verdicts: torch.Tensor | None = None
) -> torch.Tensor:
    """Each sample's group's direction [B, K]: +1 where every scorable sample of the group got the same
    reward and all were right, -1 where all were wrong; 0 where the rewards differ, the group has fewer
    than 2 scorable samples, or the sample itself is unscorable or missing.

    Right and wrong are the verifier's `verdicts` [B, K] (1, 0; NaN: none) where every scorable sample
    of the group has one, so that a reward offset (task=arithmetic_offset: 1 wrong, 2 right) or a
    shaping term does not turn a wrong group into a right one. A group without verdicts (a reward model)
    is right where its common reward is above 0, wrong at or below 0 (the paper's 0/1 and -1/1 rewards);
    a group with both verdicts under one reward is left at 0."""
    inp = AdvantageInput.of(inp)
    r = inp.rewards.detach().to(torch.float32)  # [B, K]
    valid = torch.isfinite(r)  # [B, K]
    if inp.mask is not None:
        valid = valid & inp.mask.to(device=r.device, dtype=torch.bool)
    high = torch.where(valid, r, -torch.inf).amax(-1, keepdim=True)  # [B, 1]
    low = torch.where(valid, r, torch.inf).amin(-1, keepdim=True)  # [B, 1]
    alike = (valid.sum(-1, keepdim=True) >= 2) & (high == low)  # [B, 1] no spread among >= 2 scored
    direction = torch.where(high > 0, 1.0, -1.0)  # [B, 1] by the reward
    if verdicts is not None:
        v = verdicts.to(device=r.device, dtype=torch.float32)  # [B, K]
        known = (valid <= torch.isfinite(v)).all(-1, keepdim=True)  # [B, 1] every scored sample has one
        right = (valid <= (v == 1)).all(-1, keepdim=True)  # [B, 1]
        wrong = (valid <= (v == 0)).all(-1, keepdim=True)  # [B, 1]
        by_verdict = torch.where(right, 1.0, torch.where(wrong, -1.0, 0.0))  # [B, 1]
        direction = torch.where(known, by_verdict, direction)  # [B, 1]
    return torch.where(valid & alike, direction, 0.0)  # [B, K]


def zvp_token_advantages(
    advantages: torch.Tensor,
    signs: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    alpha: float,
) -> torch.Tensor:
    """Token advantages [n, C]: the estimator's advantage [n] on the rows whose sign [n] is 0, the
    entropy-shaped ones (module docstring) on the others. `entropy` [n, C] is detached here; the
    maximum is over the row's real tokens (`mask` [n, C]). Positions outside the mask are 0."""
    valid = mask.bool()  # [n, C]
    h = torch.where(valid, entropy.detach().float(), 0.0)  # [n, C]
    h_max = torch.where(valid, h, -torch.inf).amax(-1, keepdim=True).clamp(min=0.0)  # [n, 1]
    sign = signs.to(h.dtype).unsqueeze(-1)  # [n, 1]
    shaped = torch.where(sign > 0, alpha * h, -alpha * (h_max - h))  # [n, C]
    base = advantages.detach().to(h.dtype).unsqueeze(-1).expand_as(h)  # [n, C]
    return torch.where(valid, torch.where(sign != 0, shaped, base), 0.0)  # [n, C]

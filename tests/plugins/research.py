"""A new advantage estimator and a new policy loss, written as a researcher would, outside loorl.

`python src/train.py estimator._target_=plugins.research.length_normalised_rloo
loss._target_=plugins.research.dual_clip_token_loss` trains with them (tests/test_plugins.py). Each call
is appended to the file named by LOORL_PLUGIN_CALLS, when set, so a test can see that they ran.
"""

from __future__ import annotations

import os

import torch

from loorl.algo.estimators import AdvantageInput
from loorl.algo.masked import masked_mean
from loorl.algo.objectives import LossParams
from loorl.types import RolloutBatch


def _record(what: str) -> None:
    if path := os.environ.get("LOORL_PLUGIN_CALLS"):
        with open(path, "a") as f:
            f.write(what + "\n")


def length_normalised_rloo(inp: AdvantageInput, *, whiten: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """RLOO on reward per token: r_i / L_i minus the mean of its scorable siblings' r_j / L_j.

    Needs the lengths, which a rewards-only estimator could not see. [B, K] -> [B, K]."""
    _record("estimator")
    if inp.lengths is None:
        raise ValueError("length_normalised_rloo needs AdvantageInput.lengths")
    valid = inp.rewards.isfinite() & (inp.mask if inp.mask is not None else True)  # [B, K]
    per_token = torch.where(valid, inp.rewards.float() / inp.lengths.float().clamp(min=1), 0.0)  # [B, K]
    n = valid.sum(-1, keepdim=True)  # [B, 1]
    baseline = (per_token.sum(-1, keepdim=True) - per_token) / (n - 1).clamp(min=1)  # [B, K]
    adv = torch.where(valid & (n >= 2), per_token - baseline, 0.0)  # [B, K]
    if whiten:
        adv = (adv - masked_mean(adv, valid)) / (adv[valid].std() + eps)
    return torch.where(valid & (n >= 2), adv, 0.0)


# The minimum K that `check_config` enforces for a `_target_` estimator (what `register(name,
# min_group_size=2)` would set; not registering keeps loorl's registry as it was, whoever imports this)
length_normalised_rloo.min_group_size = 2


DUAL_CLIP = 3.0  # verl's default `clip_ratio_c`: the bound on a negative advantage's loss, in units of -A


def dual_clip_token_loss(
    logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al. 2019, verl's default `vanilla` loss): PPO's clipped surrogate, and where
    A < 0 the loss is also capped at -A * DUAL_CLIP, so a token whose ratio has exploded cannot push
    with an unbounded weight. Returns [n, C] and the tokens where either clip was active. `settings` is
    the algorithm layer's `LossParams` (the run passes its `loss` section); this reads `clip_low` and
    `clip_high`."""
    _record("loss")
    old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs  # [n, C]
    valid = batch.completion_mask.bool()  # [n, C]
    ratio = torch.where(valid, logprobs - old, 0.0).clamp(-20, 20).exp()  # [n, C]
    adv = batch.advantages.to(logprobs.dtype).unsqueeze(-1)  # [n, 1]
    unclipped = -adv * ratio  # [n, C]
    ppo = torch.maximum(
        unclipped, -adv * ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
    )  # [n, C]
    loss = torch.where(adv < 0, torch.minimum(ppo, -adv * DUAL_CLIP), ppo)  # [n, C]
    return loss, valid & (loss != unclipped)

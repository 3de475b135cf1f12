"""A new advantage estimator and a new policy loss, written as a researcher would, outside loorl.

`python src/train.py estimator._target_=plugins.research.length_normalised_rloo
loss._target_=plugins.research.cispo_token_loss` trains with them (tests/test_plugins.py). Each call
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


def cispo_token_loss(
    logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * log pi per token.

    The clipped importance weight carries no gradient, so no token's gradient is ever dropped (PPO's
    clip zeroes it). On-policy the ratio is 1 and this is REINFORCE. Returns [n, C] and the tokens
    whose weight was clipped. `settings` is the algorithm layer's `LossParams` (the run passes its
    `loss` section); this reads `clip_low` and `clip_high`."""
    _record("loss")
    old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs  # [n, C]
    ratio = (logprobs.detach() - old).clamp(-20, 20).exp()  # [n, C]
    weight = ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)  # [n, C]
    adv = batch.advantages.to(logprobs.dtype).unsqueeze(-1)  # [n, 1]
    clipped = (weight != ratio) & batch.completion_mask.bool()  # [n, C]
    return -weight * adv * logprobs, clipped

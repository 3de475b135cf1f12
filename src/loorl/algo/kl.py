"""The KL penalty to the reference policy: per-token estimators, where each gives a KL gradient, and the
coefficient's controllers.

Shapes: N sequences, T completion positions; `mask` [N, T] is 1 on real completion tokens.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from loorl.errors import ConfigError

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS = get_args(KLEstimator)

# Where each estimator gives a KL gradient (exact expectations: tests/test_kl_gradients.py).
# Folded into the reward (a score-function term) only k1's gradient is that of KL(pi||ref);
# as a loss term k1's expected gradient is 0, k2's is that of KL(pi||ref), k3's that of the
# reverse KL(ref||pi) (what GRPO implementations use).
KL_ESTIMATORS_BY_PLACEMENT = {"reward": ("k1",), "loss": ("k2", "k3")}

MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: beyond it a ratio is meaningless and exp() heads for inf


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, estimator: str) -> torch.Tensor:
    """Per-token estimate [N, T] of KL(pi || ref) from the sampled tokens' logprobs (y ~ pi).

    With d = log pi - log ref: k1 = d (unbiased value, can be negative); k2 = d^2 / 2 (biased
    value, low variance); k3 = exp(-d) - 1 + d (Schulman's unbiased value, always >= 0).
    Their values all estimate KL(pi||ref), but their gradients differ, so each is accepted only
    where its expected gradient is a KL gradient (see check_kl_placement):
      in the reward (-coef * sum_t kl_t, a score-function term): k1 -> grad KL(pi||ref);
      as a loss term (coef * kl_t, differentiated through log pi): k2 -> grad KL(pi||ref),
      k3 -> grad of the reverse KL(ref||pi) (as GRPO implementations use). k1 as a loss term
      has expected gradient exactly 0; k2 or k3 in the reward give no KL's gradient.
    A loss term's KL is each token's given its sampled prefix: over several tokens it lacks the
    part of the sequence KL's gradient through which a token changes later tokens' KL, which the
    reward (k1) carries. scripts/research/kl_gradient_table.py prints all of them exactly.
    """
    if estimator not in KL_ESTIMATORS:
        raise ConfigError(f"kl.estimator={estimator!r} is not one of: {', '.join(KL_ESTIMATORS)}")
    d = logprobs - ref_logprobs  # [N, T]
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d  # [N, T]
    return torch.exp((-d).clamp(max=MAX_LOG_RATIO)) - 1.0 + d  # [N, T] k3


def check_kl_placement(estimator: str, in_reward: bool) -> None:
    """Raise ConfigError unless `estimator` gives a KL gradient where the KL term is placed."""
    placement = "reward" if in_reward else "loss"
    if estimator in KL_ESTIMATORS_BY_PLACEMENT[placement]:
        return
    why = "has expected gradient 0" if estimator == "k1" else "does not give a KL gradient"
    raise ConfigError(
        f"kl.estimator={estimator} with kl.in_reward={str(in_reward).lower()} {why}: "
        "in the reward (kl.in_reward=true) use kl.estimator=k1; as a loss term (kl.in_reward=false) "
        "use kl.estimator=k2 (gradient of KL(pi||ref)) or kl.estimator=k3 "
        "(gradient of the reverse KL(ref||pi), as GRPO implementations do)"
    )


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): steer the measured KL towards `target`.

    error = clip(KL / target - 1, -0.2, 0.2); value *= 1 + error * n_steps / horizon.
    The clip bounds how fast one noisy KL measurement can move the coefficient.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if not target > 0:
            raise ConfigError(f"kl.target={target} must be a positive number")
        if not horizon > 0:
            raise ConfigError(f"kl.horizon={horizon} must be a positive number")
        self.value, self.target, self.horizon = float(init_coef), float(target), horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def sequence_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, *, estimator: str
) -> torch.Tensor:
    """Per-sequence KL estimate [N]: the per-token estimate summed over each completion's real tokens.

    Folded into the reward as `reward - coef * sequence_kl` (before the baseline, so it sees it too).
    """
    kl_tok = kl_per_token(logprobs, ref_logprobs, estimator=estimator)  # [N, T]
    return torch.where(mask.bool(), kl_tok, 0.0).sum(-1)  # [N]

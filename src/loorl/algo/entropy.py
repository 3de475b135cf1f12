"""Entropy as something to train: the entropy bonus's coefficient (fixed, or adapted towards a target
entropy, Skywork-OR1's rule) and the top-entropy token mask (2506.01939).

The bonus itself is `-coef * H` averaged over the trained tokens, added in `policy_loss`; the entropies
carry a gradient there (`head_logprobs(..., entropy_grad=True)`: no [N, C, V] tensor). TRL's
`GRPOConfig` has the same three settings (`entropy_coef`, `entropy_target`, `top_entropy_quantile`);
tests/test_peer_oracles.py checks the rule and the mask against TRL's code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, share: float) -> torch.Tensor:
    """The real tokens [N, T] whose entropy is at or above the (1 - share) quantile of the real tokens'
    entropies (torch.quantile's linear interpolation, as TRL): `loss.top_entropy_quantile`, the
    "forking" tokens that 2506.01939 finds carry the learning. No gradient; none kept without tokens."""
    valid = mask.bool()  # [N, T]
    if share >= 1.0 or not valid.any():
        return valid
    values = entropy.detach()[valid].float()  # [m]
    threshold = torch.quantile(values, 1.0 - share)  # []
    return valid & (entropy.detach() >= threshold)  # [N, T]


@dataclass
class EntropyCoefficient:
    """The entropy bonus's coefficient, one value per optimizer step (`loss.entropy_coef` and the rest).

    Without a target it is `coef` throughout. With one (Skywork-OR1's adaptive rule, as TRL applies
    it): after each optimizer step, the step's mean token entropy H moves the coefficient by `delta`,
    up while H <= target and down otherwise, within [low, high]; and the bonus applies only while the
    last H was at or below the target, so a policy that explores enough is left alone."""

    coef: float = 0.0
    target: float | None = None
    delta: float = 0.005
    low: float = 0.0
    high: float = 1.0
    last_entropy: float | None = None  # the mean token entropy of the last optimizer step

    @property
    def value(self) -> float:
        """The coefficient the next optimizer step applies."""
        if self.target is None:
            return self.coef
        return self.coef if self.last_entropy is not None and self.last_entropy <= self.target else 0.0

    @property
    def needs_gradient(self) -> bool:
        """Whether any step may apply a bonus, so the entropies must carry a gradient."""
        return self.coef > 0 if self.target is None else self.high > 0

    def update(self, entropy: float) -> None:
        """After an optimizer step: its mean token entropy (all ranks')."""
        if self.target is None:
            return
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = float(state["coef"]), state["last_entropy"]

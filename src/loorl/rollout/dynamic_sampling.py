"""Dynamic sampling with whole groups (DAPO; verl `algorithm.filter_groups`): which groups carry a
learning signal, and how a step's groups are chosen from its sampling rounds.

A group teaches nothing when the estimator gives all K of its samples advantage 0. What counts as
"no spread" is the estimator's own: each group is run through it alone, as a batch of one. For the
group baselines (RLOO, GRPO, Dr. GRPO, REINFORCE++-baseline) that is "fewer than 2 distinct
scorable rewards"; for REINFORCE++, whose baseline is the batch, a group alone is whitened over
itself, so the same groups count as uniform (in a batch they would get the batch-relative
advantage, which a filtered batch gives up); for plain REINFORCE (no baseline) a group has signal
unless every reward is 0. Pure functions: the rounds themselves run in `RolloutDataModule.fill`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loorl.algo.estimators import AdvantageInput, Estimator


def groups_with_signal(rewards: torch.Tensor, estimator: Estimator) -> torch.Tensor:
    """Which of the groups `rewards` [B, K] (NaN: unscorable) have a nonzero advantage under `estimator`
    when each is the whole batch. [B] bool. One estimator call per group: B is a step's prompts."""
    signal = [bool((estimator(AdvantageInput(rewards[g : g + 1])) != 0).any()) for g in range(len(rewards))]
    return torch.tensor(signal, dtype=torch.bool)  # [B]


@dataclass(frozen=True)
class SetAside:
    """Groups set aside for want of a spread, by what their samples were."""

    all_right: int = 0  # every scorable sample correct
    all_wrong: int = 0  # every scorable sample wrong
    other: int = 0  # neither (equal partial rewards, unscorable samples only)

    def __add__(self, other: SetAside) -> SetAside:
        return SetAside(self.all_right + other.all_right, self.all_wrong + other.all_wrong,
                        self.other + other.other)  # fmt: skip

    @classmethod
    def of(cls, correct: torch.Tensor) -> SetAside:
        """The kinds of the groups `correct` [G, K] (1 right, 0 wrong, NaN no verdict)."""
        scorable = ~correct.isnan()  # [G, K]
        right = torch.where(scorable, correct, 0.0).sum(-1)  # [G]
        n = scorable.sum(-1)  # [G]
        all_right = int(((right == n) & (n > 0)).sum())
        all_wrong = int(((right == 0) & (n > 0)).sum())
        return cls(all_right, all_wrong, len(correct) - all_right - all_wrong)


@dataclass(frozen=True)
class Choice:
    """A step's groups after its rounds: (round, group) pairs in training order."""

    trained: list[tuple[int, int]]  # groups with signal first (round order), then fillers
    fillers: int  # groups without signal trained because the rounds ran out (max_rounds)
    surplus: int  # groups with signal left over when the last round brought more than needed


def choose_groups(signal_by_round: list[torch.Tensor], quota: int) -> Choice:
    """The `quota` groups a step trains on, from the signal flags [B_r] of each of its rounds: the
    groups with signal in the order they were drawn, and, when fewer than `quota` have one, the
    earliest groups without signal after them (so every rank keeps its B/W groups, and the loss's
    normalisers count what they would without dynamic sampling). Groups are never split: each is a
    (round, index) pair whose K samples come from that round's one generation call."""
    pairs = [(r, g, bool(flag)) for r, flags in enumerate(signal_by_round) for g, flag in enumerate(flags)]
    with_signal = [(r, g) for r, g, flag in pairs if flag]
    without = [(r, g) for r, g, flag in pairs if not flag]
    kept = with_signal[:quota]
    fillers = without[: quota - len(kept)]
    return Choice(kept + fillers, fillers=len(fillers), surplus=len(with_signal) - len(kept))

"""Scoring completions safely: a reward that raises or returns None/NaN marks one sample unscorable."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch

from loorl.tasks.base import Prompt

log = logging.getLogger(__name__)


def score_groups(
    reward_fn: Callable[[Prompt, str], float | None],
    prompts: Sequence[Prompt],
    texts: Sequence[Sequence[str]],
) -> tuple[torch.Tensor, int]:
    """Rewards [B, K] with NaN for unscorable samples, and how many there were.

    Failures are logged once per call (the first one's exception) and counted, never raised:
    one bad sample must not kill a run that has been training for hours.
    """
    rewards = torch.full((len(prompts), len(texts[0])), float("nan"))  # [B, K]
    failures, first_error = 0, None
    for g, (prompt, group) in enumerate(zip(prompts, texts)):
        for k, text in enumerate(group):
            try:
                value = reward_fn(prompt, text)
                value = float("nan") if value is None else float(value)
            except Exception as err:  # noqa: BLE001 - user reward code may raise anything
                value, first_error = float("nan"), first_error or err
            if math.isfinite(value):
                rewards[g, k] = value
            else:
                failures += 1
    if failures:
        log.warning(
            "%d of %d samples could not be scored (first error: %r)", failures, rewards.numel(), first_error
        )
    return rewards, failures


def correctness(is_correct: Callable[[Prompt, str], bool], prompts: Sequence[Prompt], texts) -> torch.Tensor:
    """1.0 where `is_correct` holds, [B, K]; a checker that raises counts as not correct."""

    def safe(prompt: Prompt, text: str) -> float:
        try:
            return float(bool(is_correct(prompt, text)))
        except Exception:  # noqa: BLE001 - the reward path has already counted the failure
            return 0.0

    return torch.tensor([[safe(p, t) for t in group] for p, group in zip(prompts, texts)])

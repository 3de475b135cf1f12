"""Held-out metrics of sampled completions: unbiased pass@k and majority-vote maj@k, per prompt.

Pure functions over correctness tensors and extracted answers; the validation loop and
`src/eval.py` both call them through `RolloutDataModule.evaluate`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch


def pass_at_k(num_samples: int, num_correct: torch.Tensor, k: int) -> torch.Tensor:
    """The unbiased pass@k estimator of Chen et al. (2021), per prompt: the probability that at least
    one of k samples drawn without replacement from the n generated is correct,
    1 - C(n - c, k) / C(n, k), computed as a product to stay exact for large n.

    `num_correct` [P]: correct samples of each prompt out of `num_samples` (n). Returns [P] float."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={num_samples}")
    c = num_correct.to(torch.float64)  # [P]
    j = torch.arange(k, dtype=torch.float64)  # [k]
    # C(n-c, k) / C(n, k) = prod_{j<k} (n-c-j) / (n-j); a factor <= 0 means fewer than k wrong: ratio 0
    ratio = ((num_samples - c[:, None] - j) / (num_samples - j)).clamp(min=0).prod(-1)  # [P]
    return (1.0 - ratio).float()  # [P]


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """Index of the first sample whose answer is the most frequent one (ties: the answer seen first);
    None when no sample has an answer. Unparsable samples (None) never win."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    winner = next(a for a in answers if a is not None and counts[a] == top)
    return answers.index(winner)


def maj_at_k(answers: Sequence[Sequence[str | None]], correct: torch.Tensor, k: int) -> torch.Tensor:
    """Majority-vote accuracy maj@k per prompt: the n samples of a prompt are split into n // k disjoint
    chunks of k; in each, the most frequent extracted answer wins and counts as correct when a sample
    giving it is correct. The mean over the chunks (one chunk when n = k) has lower variance than a
    single vote.

    `answers` [P][n]: each sample's extracted answer (None: none found); `correct` [P, n]. Returns [P]."""
    num_samples = correct.shape[-1]
    if not 1 <= k <= num_samples:
        raise ValueError(f"maj@k needs 1 <= k <= n, got k={k}, n={num_samples}")
    chunks = num_samples // k
    out = torch.zeros(correct.shape[0])  # [P]
    for p, row in enumerate(answers):
        for start in range(0, chunks * k, k):
            winner = majority_vote(list(row[start : start + k]))
            if winner is not None:
                out[p] += float(correct[p, start + winner])
    return out / chunks  # [P]

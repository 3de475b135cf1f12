"""Held-out metrics of sampled completions: unbiased pass@k and majority-vote maj@k, per prompt.

Pure functions over correctness tensors and extracted answers; the validation loop and
`src/eval.py` both call them through `loorl.rollout.heldout.heldout_results`
(`RolloutDataModule.heldout_results`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch


def pass_at_k(num_samples: int | torch.Tensor, num_correct: torch.Tensor, k: int) -> torch.Tensor:
    """The unbiased pass@k estimator of Chen et al. (2021), per prompt: the probability that at least
    one of k samples drawn without replacement from the n generated is correct,
    1 - C(n - c, k) / C(n, k), computed as a product to stay exact for large n.

    `num_samples`: n, one for all prompts or [P] (the scorable samples of each, when some had no
    verdict); `num_correct` [P]: correct samples of each prompt. Returns [P] float, NaN for a prompt
    with fewer than k scorable samples."""
    if k < 1 or (isinstance(num_samples, int) and num_samples < k):
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={num_samples}")
    n = torch.as_tensor(num_samples, dtype=torch.float64).expand(num_correct.shape)  # [P]
    c = num_correct.to(torch.float64)  # [P]
    j = torch.arange(k, dtype=torch.float64)  # [k]
    # C(n-c, k) / C(n, k) = prod_{j<k} (n-c-j) / (n-j); a factor <= 0 means fewer than k wrong: ratio 0
    ratio = ((n[:, None] - c[:, None] - j) / (n[:, None] - j)).clamp(min=0).prod(-1)  # [P]
    return torch.where(n >= k, 1.0 - ratio, torch.nan).float()  # [P]


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
    single vote. Unscorable samples (correct NaN) do not vote; a chunk of only unscorable samples is
    left out, and a prompt with no chunk left is NaN.

    `answers` [P][n]: each sample's extracted answer (None: none found); `correct` [P, n]. Returns [P]."""
    num_samples = correct.shape[-1]
    if not 1 <= k <= num_samples:
        raise ValueError(f"maj@k needs 1 <= k <= n, got k={k}, n={num_samples}")
    out = torch.full((correct.shape[0],), torch.nan)  # [P]
    for p, row in enumerate(answers):
        votes = []
        for start in range(0, (num_samples // k) * k, k):
            chunk = range(start, start + k)
            if all(correct[p, i].isnan() for i in chunk):
                continue
            winner = majority_vote([None if correct[p, i].isnan() else row[i] for i in chunk])
            votes.append(0.0 if winner is None else float(correct[p, start + winner]))
        if votes:
            out[p] = sum(votes) / len(votes)
    return out  # [P]

"""Critic-free advantage estimators over groups of K samples per prompt.

Every estimator maps an `AdvantageInput` (rewards [B, K], one row per prompt, with the samples'
lengths, the groups' prompt ids and which samples exist) to advantages [B, K] in float32.
A plain rewards tensor is accepted wherever an input is, as `AdvantageInput(rewards)`.
Uneven groups are padded to K with `mask` False on the missing samples, which count as unscorable.
A NaN reward marks an unscorable sample (its reward function failed): it is left out of every
baseline and statistic and gets advantage exactly 0, so one broken sample neither trains the
policy nor shifts its siblings' baselines. A group with too few scorable samples for its
baseline (fewer than 2, for every estimator with a group baseline) gets 0 everywhere.
The output never holds NaN or inf.
"""

from __future__ import annotations

import torch

from loorl.algo.estimator_registry import (  # noqa: F401 - the registry's API, re-exported from here
    NEEDS,
    AdvantageInput,
    Estimator,
    _finish,
    _prepare,
    _with_siblings,
    compute_advantages,
    get,
    min_group_size,
    names,
    needs,
    register,
    resolve,
    with_options,
)
from loorl.algo.masked import masked_mean, masked_std, masked_whiten


# ---- estimators --------------------------------------------------------------------------------
@register("reinforce")
def reinforce(inp: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """A = r: no baseline, the highest-variance estimator; a reference point for the others."""
    r, valid = _prepare(inp)  # [B, K], [B, K]
    return _finish(r, valid, whiten=whiten, eps=eps)


@register("w_reinforce")
def w_reinforce(
    inp: AdvantageInput | torch.Tensor,
    *,
    whiten: bool = False,
    eps: float = 1e-6,
    positive_weight: float = 0.1,
) -> torch.Tensor:
    """Weighted-REINFORCE (Zhu et al. 2025, arXiv 2506.01347): A = lambda * r - (1 - r), no baseline.

    With 0/1 rewards a right sample gets +lambda (`positive_weight`, the paper's 0.1) and a wrong one -1:
    most of the push is away from wrong answers, which keeps probability mass spread over the other
    answers (entropy) where plain REINFORCE sharpens onto the right ones. A group whose samples are
    all right or all wrong still teaches, unlike under a group baseline. Rewards between 0 and 1 are
    mapped on the same line; it is REINFORCE with the fixed baseline 1 / (1 + lambda), scaled by
    1 + lambda.
    """
    r, valid = _prepare(inp)  # [B, K], [B, K]
    return _finish(positive_weight * r - (1.0 - r), valid, whiten=whiten, eps=eps)  # [B, K]


@register("rloo", min_group_size=2)
def rloo(inp: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE leave-one-out: A_i = r_i - mean of the other scorable samples of the group.

    The baseline excludes the sample itself, so it is independent of it and the estimate stays
    unbiased. A sample with no scorable sibling has no baseline and gets 0.
    """
    r, valid = _prepare(inp)  # [B, K], [B, K]
    n = valid.sum(dim=-1, keepdim=True).to(r.dtype)  # [B, 1]
    total = r.sum(dim=-1, keepdim=True)  # [B, 1]
    baseline = (total - r) / (n - 1).clamp(min=1)  # [B, K]
    keep = _with_siblings(valid)  # [B, K]
    adv = torch.where(keep, r - baseline, 0.0)  # [B, K]
    return _finish(adv, valid, whiten=whiten, eps=eps, keep=keep)


@register("grpo", min_group_size=2)
def grpo(inp: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps), unbiased std over the scorable samples.

    The std division rescales every prompt to unit spread (biased towards easy/hard prompts,
    which Dr. GRPO drops); a group with fewer than 2 scorable samples has no std and gets 0.
    """
    r, valid = _prepare(inp)  # [B, K], [B, K]
    mean = masked_mean(r, valid, -1, keepdim=True)  # [B, 1]
    std = masked_std(r, valid, -1, keepdim=True)  # [B, 1]
    keep = _with_siblings(valid)  # [B, K]
    adv = torch.where(keep, (r - mean) / (std + eps), 0.0)  # [B, K]
    return _finish(adv, valid, whiten=whiten, eps=eps, keep=keep)


@register("rl_zvp", min_group_size=2)
def rl_zvp(inp: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """RL-ZVP (2509.21880): GRPO's advantage here. The groups without reward spread, where it is 0, get
    their token advantages in the loss (`loss.zvp_alpha`, `loorl.algo.zero_variance`), which needs the
    tokens' entropies; `estimator=rl_zvp` sets it (the config check refuses rl_zvp without it)."""
    return grpo(inp, whiten=whiten, eps=eps)


@register("dr_grpo", min_group_size=2)
def dr_grpo(inp: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO: r - group mean, without GRPO's per-group std division (K=1 would give 0)."""
    r, valid = _prepare(inp)  # [B, K], [B, K]
    mean = masked_mean(r, valid, -1, keepdim=True)  # [B, 1]
    return _finish(r - mean, valid, whiten=whiten, eps=eps, keep=_with_siblings(valid))


@register("reinforce_pp")
def reinforce_pp(
    inp: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++: rewards whitened over the whole batch (a global, not per-prompt, baseline)."""
    r, valid = _prepare(inp)  # [B, K], [B, K]
    adv = masked_whiten(r, valid, eps=eps)  # [B, K]
    return _finish(adv, valid, whiten=whiten, eps=eps)


@register("reinforce_pp_baseline", min_group_size=2)
def reinforce_pp_baseline(
    inp: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ with baseline: subtract the group mean, then whiten over the whole batch.

    The group mean removes per-prompt difficulty; the global whitening keeps the scale stable
    without GRPO's per-group std.
    """
    r, valid = _prepare(inp)  # [B, K], [B, K]
    keep = _with_siblings(valid)  # [B, K] the samples that have a group baseline
    centred = r - masked_mean(r, valid, -1, keepdim=True)  # [B, K]
    adv = masked_whiten(centred, keep, eps=eps)  # [B, K]
    return _finish(adv, valid, whiten=whiten, eps=eps, keep=keep)


# ---- the field's newer estimators (verl 0.9.1's core_algos registers each; tests/test_peer_oracles.py) --
@register("opo", min_group_size=2)
def opo(inp: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """OPO (Hao et al. 2025): A_i = r_i - sum_j l_j r_j / sum_j l_j over the group's scorable samples.

    The length-weighted mean is the baseline of least variance for a sequence-level loss summed over
    tokens (the gradient's variance grows with a sample's length). Needs the samples' lengths.
    """
    inp = AdvantageInput.of(inp)
    if inp.lengths is None:
        raise ValueError(
            "estimator=opo weights the baseline by completion length: pass AdvantageInput.lengths"
        )
    r, valid = _prepare(inp)  # [B, K], [B, K]
    length = torch.where(valid, inp.lengths.to(device=r.device, dtype=r.dtype), 0.0)  # [B, K]
    baseline = (length * r).sum(-1, keepdim=True) / length.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    keep = _with_siblings(valid)  # [B, K]
    return _finish(torch.where(keep, r - baseline, 0.0), valid, whiten=whiten, eps=eps, keep=keep)


@register("gpg", min_group_size=2)
def gpg(inp: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """GPG (Chu et al. 2025): A_i = alpha * (r_i - group mean), alpha = scorable samples / those with a
    non-zero reward, over the whole batch.

    Dr. GRPO's advantage scaled up by how sparse the batch's rewards are: with 0/1 rewards alpha is
    1 / (the share of correct samples), which undoes the dilution of the gradient by groups whose
    every sample failed (verl's `compute_gpg_outcome_advantage`, with its f_norm = 1).
    """
    r, valid = _prepare(inp)  # [B, K], [B, K]
    nonzero = (valid & (r != 0)).sum().clamp(min=1)  # []
    alpha = valid.sum() / nonzero  # []
    mean = masked_mean(r, valid, -1, keepdim=True)  # [B, 1]
    return _finish(alpha * (r - mean), valid, whiten=whiten, eps=eps, keep=_with_siblings(valid))


@register("grpo_passk", min_group_size=2)
def grpo_passk(
    inp: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Pass@k training (Chen et al. 2025): only the group's best sample is credited, with
    (r_max - r_second) / (group std + eps); every other sample gets 0.

    It optimises the group's best answer, not its mean: no sample is pushed down, which keeps the
    policy exploring. Ties at the top give 0 (no sample is better than its best sibling).
    """
    r, valid = _prepare(inp)  # [B, K], [B, K]
    if r.shape[-1] < 2:  # no group has a second sample to be better than
        return torch.zeros_like(r)  # [B, K]
    ranked = torch.where(valid, r, -torch.inf)  # [B, K] missing and unscorable samples rank last
    top2, best = ranked.topk(2, dim=-1)  # [B, 2], [B, 2]
    gap = (top2[:, 0] - top2[:, 1]).unsqueeze(-1)  # [B, 1] (inf or NaN without 2 scorable samples)
    std = masked_std(r, valid, -1, keepdim=True)  # [B, 1]
    is_best = torch.zeros_like(valid).scatter(-1, best[:, :1], True)  # [B, K]
    keep = _with_siblings(valid)  # [B, K]
    adv = torch.where(is_best & keep, gap / (std + eps), 0.0)  # [B, K]
    return _finish(adv, valid, whiten=whiten, eps=eps, keep=keep)


@register("remax", needs=("baselines",))
def remax(inp: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """ReMax (Li et al. 2023): A_i = r_i - r_greedy, the reward of a greedy completion of the same prompt
    as the baseline.

    The greedy completion is drawn beside the K samples (`rollout`: one per prompt), scored by the same
    rules and never trained on. The baseline does not depend on the samples, so one sample per prompt
    (K=1) already has one. A group whose greedy completion is unscorable has no baseline and gets 0.
    """
    inp = AdvantageInput.of(inp)
    if inp.baselines is None:
        raise ValueError(
            "estimator=remax subtracts the reward of a greedy completion of each prompt: pass "
            "AdvantageInput.baselines (the rollout draws them when the estimator needs them)"
        )
    r, valid = _prepare(inp)  # [B, K], [B, K]
    b = inp.baselines.detach().to(device=r.device, dtype=torch.float32).reshape(-1, 1)  # [B, 1]
    has_baseline = torch.isfinite(b)  # [B, 1]
    keep = valid & has_baseline  # [B, K]
    adv = torch.where(keep, r - torch.where(has_baseline, b, 0.0), 0.0)  # [B, K]
    return _finish(adv, valid, whiten=whiten, eps=eps, keep=keep)


@register("gdpo", min_group_size=2, needs=("parts",))
def gdpo(inp: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """GDPO (arXiv 2601.05242): each reward function's reward normalised within its group as GRPO does,
    (r_d - mean_d) / (std_d + eps), the D results summed with the functions' weights, and the sum
    whitened over the batch.

    Summing first (GRPO) lets the reward with the widest spread drown the others: a format reward that
    every sample earns but one moves the sum as much as a correctness reward would. A sample is
    unscorable if any of its parts is (its weighted sum is then NaN): it is left out of every part's
    statistics. Needs `AdvantageInput.parts`; `part_weights` default to 1.
    """
    inp = AdvantageInput.of(inp)
    if inp.parts is None:
        raise ValueError(
            "estimator=gdpo normalises each reward function's reward on its own: pass "
            "AdvantageInput.parts [B, K, D] (the rollout keeps them when the estimator needs them)"
        )
    _, valid = _prepare(inp)  # [B, K] the combined reward's scorable samples
    parts = inp.parts.detach().to(device=valid.device, dtype=torch.float32)  # [B, K, D]
    valid = valid & torch.isfinite(parts).all(-1)  # [B, K] unscorable in one part: in all
    d = parts.shape[-1]
    weights = (
        torch.ones(d) if inp.part_weights is None else torch.as_tensor(inp.part_weights, dtype=torch.float32)
    ).to(valid.device)  # [D]
    total = torch.zeros_like(parts[..., 0])  # [B, K]
    for i in range(d):  # GRPO on each part alone: its unscorable samples are the whole sample's
        part = torch.where(valid, parts[..., i], torch.nan)  # [B, K]
        total = total + weights[i] * grpo(AdvantageInput(part), eps=eps)  # [B, K]
    keep = _with_siblings(valid)  # [B, K]
    adv = masked_whiten(total, keep, eps=eps)  # [B, K]
    return _finish(adv, valid, whiten=whiten, eps=eps, keep=keep)

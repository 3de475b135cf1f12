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

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loorl.algo.masked import masked_mean, masked_std, masked_whiten
from loorl.errors import ConfigError
from loorl.util.plugins import import_object


@dataclass(frozen=True)
class AdvantageInput:
    """What an estimator may use. B groups (prompts) of K samples; only `rewards` is required."""

    rewards: torch.Tensor  # [B, K] NaN or inf: unscorable (its reward function failed)
    lengths: torch.Tensor | None = None  # [B, K] completion tokens of each sample
    group_ids: torch.Tensor | None = None  # [B] which prompt each group answers (equal ids: one prompt)
    mask: torch.Tensor | None = None  # [B, K] bool, False where a group has no sample (uneven groups)
    baselines: torch.Tensor | None = None  # [B] the reward of a greedy completion of each group's prompt
    # (ReMax; NaN: unscorable); what `needs=("baselines",)` asks the rollout for
    parts: torch.Tensor | None = None  # [B, K, D] each reward function's own reward before the weighted sum
    # (GDPO; NaN: unscorable); what `needs=("parts",)` asks the rollout for
    part_weights: torch.Tensor | None = None  # [D] their weights in the sum; None: all 1

    @classmethod
    def of(cls, value: AdvantageInput | torch.Tensor) -> AdvantageInput:
        return value if isinstance(value, AdvantageInput) else cls(rewards=value)

    def groups(self, rows: slice) -> AdvantageInput:
        """The groups `rows` alone, every per-group field cut alike (`part_weights` kept)."""
        cut = lambda v: None if v is None else v[rows]  # noqa: E731
        return AdvantageInput(cut(self.rewards), cut(self.lengths), cut(self.group_ids), cut(self.mask),
                              cut(self.baselines), cut(self.parts), self.part_weights)  # fmt: skip

    @classmethod
    def of_batch(cls, batch, rewards: torch.Tensor | None = None, lengths: torch.Tensor | None = None):
        """What the estimator sees of a `RolloutBatch` (rewards [N] and lengths [N] given: those, e.g.
        gathered over ranks or shaped by a KL penalty; else the batch's rewards and tokens in the loss)."""
        weights = batch.reward_part_weights
        return cls.of_samples(
            batch.rewards if rewards is None else rewards,
            batch.completion_mask.sum(-1) if lengths is None else lengths,
            batch.samples_per_prompt,
            baselines=batch.reward_baselines,
            parts=batch.reward_parts,
            part_weights=torch.tensor(weights) if weights else None,
        )

    @classmethod
    def of_samples(
        cls,
        rewards: torch.Tensor,
        lengths: torch.Tensor,
        k: int,
        *,
        baselines: torch.Tensor | None = None,
        parts: torch.Tensor | None = None,
        part_weights: torch.Tensor | None = None,
    ) -> AdvantageInput:
        """The input of a rollout's N = B*K samples in group order (rewards [N], lengths [N]: the
        completion tokens in the loss), one prompt per group: what the trainer hands an estimator.
        `baselines` [N]: each sample's group's greedy reward (equal within a group); `parts` [N, D]."""
        return cls(
            rewards=rewards.view(-1, k),  # [B, K]
            lengths=lengths.view(-1, k),  # [B, K]
            group_ids=torch.arange(len(rewards) // k, device=rewards.device),  # [B] one prompt per group
            baselines=None if baselines is None else baselines.view(-1, k)[:, 0],  # [B]
            parts=None if parts is None else parts.view(-1, k, parts.shape[-1]),  # [B, K, D]
            part_weights=part_weights,
        )


Estimator = Callable[..., torch.Tensor]  # fn(AdvantageInput | rewards [B, K], *, whiten, eps) -> [B, K]

_REGISTRY: dict[str, tuple[Estimator, int]] = {}
# what an estimator may need beyond the rewards and lengths, each a field of `AdvantageInput` that the
# rollout fills in only when asked (`needs`): a greedy completion per prompt, or the reward functions apart
NEEDS = ("baselines", "parts")


# ---- registry ----------------------------------------------------------------------------------
def register(
    name: str, *, min_group_size: int = 1, needs: tuple[str, ...] = ()
) -> Callable[[Estimator], Estimator]:
    """Register `fn(inp: AdvantageInput, *, whiten=False, eps=1e-6) -> [B, K]` under `name`.

    `min_group_size` is the K below which the estimator is meaningless (RLOO needs a sibling); `needs`
    names the `AdvantageInput` fields of `NEEDS` it reads (ReMax: "baselines", GDPO: "parts"), which
    the rollout then draws or keeps. Both are also set on the function, where `estimator._target_`
    finds them (an unregistered function may set them itself; default 1 and none).
    """
    unknown = set(needs) - set(NEEDS)
    if unknown:
        raise ValueError(f"estimator '{name}' needs {sorted(unknown)}: an estimator may need {list(NEEDS)}")

    def decorator(fn: Estimator) -> Estimator:
        if name in _REGISTRY:
            raise ValueError(f"estimator '{name}' is already registered")
        _REGISTRY[name] = (fn, min_group_size)
        fn.min_group_size, fn.needs = min_group_size, tuple(needs)
        return fn

    return decorator


def get(name: str) -> Estimator:
    if name not in _REGISTRY:
        raise KeyError(f"unknown estimator '{name}'; choose one of: {', '.join(names())}")
    return _REGISTRY[name][0]


def names() -> list[str]:
    return sorted(_REGISTRY)


def resolve(name: str, target: str | None = None) -> Estimator:
    """The function `estimator._target_` names (a dotted path), else the one registered as `name`."""
    return get(name) if target is None else import_object(target, "estimator._target_")


def min_group_size(name: str, target: str | None = None) -> int:
    return getattr(resolve(name, target), "min_group_size", 1)


def with_options(fn: Estimator, options: dict) -> Estimator:
    """`fn` with `estimator.options` bound as keyword arguments (W-REINFORCE's `positive_weight`), its
    `min_group_size` and `needs` kept; `fn` itself without options. An option `fn` does not take is a
    one-line error naming it and the ones it takes."""
    if not options:
        return fn
    taken = [p.name for p in inspect.signature(fn).parameters.values()
             if p.kind == p.KEYWORD_ONLY and p.name not in ("whiten", "eps")]  # fmt: skip
    unknown = sorted(set(options) - set(taken))
    if unknown:
        name = getattr(fn, "__name__", "the estimator")
        raise ConfigError(
            f"estimator.options.{unknown[0]}: estimator '{name}' has no such option; it takes "
            + (", ".join(taken) if taken else "none (remove estimator.options)")
        )
    bound = functools.partial(fn, **options)
    bound.min_group_size, bound.needs = getattr(fn, "min_group_size", 1), needs(fn)
    return bound


def needs(estimator: Estimator) -> tuple[str, ...]:
    """The fields of `NEEDS` the estimator reads (none for a function that does not say)."""
    return tuple(getattr(estimator, "needs", ()))


def compute_advantages(
    name: str, rewards: AdvantageInput | torch.Tensor, *, whiten: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages [B, K] under the estimator called `name` (rewards [B, K] or a whole input)."""
    return get(name)(AdvantageInput.of(rewards), whiten=whiten, eps=eps)


# ---- shared plumbing ---------------------------------------------------------------------------
def _prepare(inp: AdvantageInput | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 rewards with unscorable and missing entries zeroed, and the mask of the scorable
    samples that exist. Both [B, K]."""
    inp = AdvantageInput.of(inp)
    rewards = inp.rewards
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, K] (one row per prompt), got shape {tuple(rewards.shape)}")
    r = rewards.detach().to(torch.float32)  # [B, K]
    valid = torch.isfinite(r)  # [B, K]; inf is as unscorable as NaN
    if inp.mask is not None:
        valid = valid & inp.mask.to(device=r.device, dtype=torch.bool)  # [B, K] a missing sample never counts
    return torch.where(valid, r, 0.0), valid  # [B, K], [B, K]


def _with_siblings(valid: torch.Tensor) -> torch.Tensor:
    """Scorable samples [B, K] whose group has at least 2 scorable ones, i.e. has a group baseline.

    A lone sample minus its own mean is 0 anyway; this keeps it exactly 0 through whitening.
    """
    return valid & (valid.sum(dim=-1, keepdim=True) >= 2)  # [B, K]


def _finish(
    adv: torch.Tensor, valid: torch.Tensor, *, whiten: bool, eps: float, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Optional whitening, then exact zeros outside `keep`, and no NaN/inf anywhere.

    `keep` defaults to the scorable samples; estimators with a group baseline pass the samples
    that have one, so the zeros of groups left with a single scorable sample neither enter the
    whitening statistics nor come out of it non-zero."""
    keep = valid if keep is None else keep  # [B, K]
    if whiten:
        adv = masked_whiten(adv, keep, eps=eps)  # [B, K]
    adv = torch.where(keep, adv, 0.0)  # [B, K]
    return torch.nan_to_num(adv, nan=0.0, posinf=0.0, neginf=0.0)  # [B, K]


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

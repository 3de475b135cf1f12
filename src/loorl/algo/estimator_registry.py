"""What an advantage estimator sees (`AdvantageInput`), the registry estimators are found in by name,
and the plumbing they share: unscorable and missing samples, groups without a baseline, whitening.
The estimators themselves are `loorl.algo.estimators`' (which re-exports all of this).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loorl.algo.masked import masked_whiten
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


# ---- groups merged for the estimator (a prompt's K grown: several groups of K) ---------------------
def merged_rows(
    rewards: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor
) -> tuple[AdvantageInput, torch.Tensor]:
    """The samples [N] as groups by `ids` [N] (equal ids: one prompt, in order of first appearance), padded
    to the largest with `mask` False, and the row each entry came from ([G, M], -1 on padding): what an
    estimator sees when pass-rate pools grew a prompt's K to several groups of K (`rl.prompt_pools`)."""
    members: dict[int, list[int]] = {}
    for row, group in enumerate(ids.tolist()):
        members.setdefault(group, []).append(row)
    width = max(map(len, members.values()))
    index = torch.full((len(members), width), -1, dtype=torch.long)  # [G, M]
    for g, rows in enumerate(members.values()):
        index[g, : len(rows)] = torch.tensor(rows)
    mask, safe = index >= 0, index.clamp(min=0)  # [G, M], [G, M]
    inp = AdvantageInput(
        rewards=torch.where(mask, rewards[safe], torch.nan),  # [G, M]
        lengths=torch.where(mask, lengths[safe], 0),  # [G, M]
        group_ids=torch.arange(len(members)),  # [G]
        mask=mask,
    )
    return inp, index


def unmerged(advantages: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Advantages [G, M] of `merged_rows`' groups back on the samples' rows: [n]."""
    out = torch.zeros(n, dtype=advantages.dtype, device=advantages.device)  # [n]
    keep = index >= 0  # [G, M]
    out[index[keep]] = advantages[keep]
    return out

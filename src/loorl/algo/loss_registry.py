"""The registry of per-token policy losses and the settings they read (`LossParams`).

A per-token loss is `fn(logprobs [n, C], batch: RolloutBatch, settings: LossParams)`; it is chosen by
`loss.name` (registered here with `register_loss`) or `loss._target_` (a dotted path). The built-in
losses register themselves in `loorl.algo.objectives` (reinforce, auto, gpg) and
`loorl.algo.policy_losses` (clipped, and the field's newer ones); import the
registry's names from `loorl.algo.objectives`, which loads both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol, get_args

import torch

from loorl.errors import ConfigError
from loorl.util.plugins import import_object

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
RatioLevel = Literal["token", "sequence"]
ISMode = Literal["truncate", "token_mask", "sequence_mask"]  # `loss.is_mode`: how the sampler ratio corrects
AGGREGATIONS, RATIO_LEVELS, IS_MODES = get_args(Aggregation), get_args(RatioLevel), get_args(ISMode)


class LossParams(Protocol):
    """What a per-token loss and `policy_loss` read of the loss's settings: the algorithm layer's own
    type, so that a plug-in loss is written against `loorl.algo` alone. The `loss` section of the
    config (`loorl.settings.LossSettings`, a layer above this one: it checks `name` against the
    registry here) has these attributes and is passed as it is, with no conversion; so is any object
    that has them. Read-only: a loss never changes its settings."""

    @property
    def name(self) -> str: ...  # the registered per-token loss (`loss.name`)
    @property
    def target(self) -> str | None: ...  # a dotted path to a per-token loss outside loorl (wins over name)
    @property
    def agg(self) -> Aggregation: ...  # `aggregate`'s mode
    @property
    def clip_low(self) -> float: ...  # the clipped surrogate's band: [1 - clip_low, 1 + clip_high]
    @property
    def clip_high(self) -> float: ...
    @property
    def ratio_level(self) -> RatioLevel: ...  # token: pi/pi_old per token; sequence: GSPO's
    @property
    def tis_cap(self) -> float | None: ...  # the truncated importance weight's cap; None: off
    @property
    def is_mode(self) -> ISMode: ...  # truncate, or a mask of `sampler_ratio_mask`
    @property
    def is_low(self) -> float: ...  # the masks' band of the sampler ratio: [is_low, is_high]
    @property
    def is_high(self) -> float: ...
    @property
    def max_len(self) -> int: ...  # seq-mean-token-sum-norm's constant
    @property
    def off_policy_mask_threshold(self) -> float | None: ...  # DeepSeek-V3.2's sequence mask; None: off
    @property
    def top_entropy_quantile(self) -> float: ...  # the tokens' share, by entropy, that keeps its policy term
    # the field's newer losses (loorl.algo.policy_losses) read these; the others ignore them
    @property
    def dppo_ratio_cap(self) -> float: ...  # DPPO: the cap on its stop-gradient weight pi/pi_old
    @property
    def sapo_tau_pos(self) -> float: ...  # SAPO: the gate's temperature where A > 0 ...
    @property
    def sapo_tau_neg(self) -> float: ...  # ... and where A <= 0
    @property
    def cov_share(self) -> float: ...  # Clip-Cov, KL-Cov: the share of tokens they act on
    @property
    def clip_cov_low(self) -> float: ...  # Clip-Cov: the band of covariances a dropped token lies in
    @property
    def clip_cov_high(self) -> float: ...
    @property
    def kl_cov_coef(self) -> float: ...  # KL-Cov: the coefficient of |log pi/pi_old| on its tokens
    @property
    def dro_beta(self) -> float: ...  # DRO: the coefficient of its quadratic log-ratio penalty
    @property
    def zvp_alpha(self) -> float | None: ...  # RL-ZVP: entropy-shaped advantages of groups without spread


def token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The advantages as a loss multiplies them, without gradient, in `like`'s dtype: one per sequence
    [n] becomes [n, 1] (broadcast over its tokens); one per token [n, C] (RL-ZVP's shaped rows,
    `loss.zvp_alpha`) stays as it is."""
    adv = advantages.detach().to(like.dtype)
    return adv.unsqueeze(-1) if adv.dim() == 1 else adv  # [n, 1] or [n, C]


# ---- the registry of per-token policy losses ---------------------------------------------------
TokenLoss = Callable[..., "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]
_TOKEN_LOSSES: dict[str, TokenLoss] = {}


def register_loss(name: str) -> Callable[[TokenLoss], TokenLoss]:
    """Register `fn(logprobs [n, C], batch: RolloutBatch, settings: LossParams)` under `name`.

    It returns the per-token loss [n, C] (its gradient is the policy gradient), or that and a bool
    [n, C] marking the tokens where a clip was active (`train/clip_frac`). `batch` holds the
    advantages [n] (or [n, C] per token under RL-ZVP: read them with `token_advantages`), the
    completion mask [n, C] and, when the ratio can differ from 1, the old log-probs [n, C];
    `policy_loss` then applies truncated importance sampling, the KL loss term and the aggregation
    (`loss.agg`). Chosen by `loss.name`, or by `loss._target_` for a function
    outside loorl (registered or not)."""

    def decorator(fn: TokenLoss) -> TokenLoss:
        if name in _TOKEN_LOSSES:
            raise ValueError(f"policy loss '{name}' is already registered")
        _TOKEN_LOSSES[name] = fn
        return fn

    return decorator


def loss_names() -> list[str]:
    return sorted(_TOKEN_LOSSES)


def token_loss_of(name: str, target: str | None = None) -> TokenLoss:
    """The per-token loss `loss._target_` names (a dotted path), else the registered `loss.name`."""
    if target is not None:
        return import_object(target, "loss._target_")
    if name not in _TOKEN_LOSSES:
        raise ConfigError(
            f"unknown policy loss '{name}' (loss.name); choose one of: {', '.join(loss_names())} "
            "(or loss._target_=<module.function> for your own)"
        )
    return _TOKEN_LOSSES[name]

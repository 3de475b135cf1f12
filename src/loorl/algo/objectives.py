"""The policy objective: the registered losses reinforce, auto and gpg, their aggregation, and the
loss of one micro-batch with its statistics. The registry of losses is `loorl.algo.loss_registry` (its
names are importable from here), PPO's clipped surrogate (`clipped`) and the field's newer losses are
`loorl.algo.policy_losses`, and the KL term's estimators live in `loorl.algo.kl`.

Shapes: N sequences, T completion positions (right-padded), V vocabulary entries.
`mask` [N, T] is 1 on real completion tokens; positions outside it may hold anything (even NaN)
and never reach a loss, because they are dropped with `torch.where`, not multiplied by 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from loorl.algo.entropy import top_entropy_mask
from loorl.algo.kl import kl_per_token
from loorl.algo.loss_registry import (  # noqa: F401  (the registry's names, re-exported)
    AGGREGATIONS,
    IS_MODES,
    RATIO_LEVELS,
    Aggregation,
    ISMode,
    LossParams,
    RatioLevel,
    TokenLoss,
    loss_names,
    register_loss,
    token_advantages,
    token_loss_of,
)
from loorl.algo.masked import masked_mean
from loorl.algo.policy_losses import (  # noqa: F401  (and registers the clipped and newer losses)
    clipped_loss,
    clipped_surrogate_token_loss,
)
from loorl.algo.zero_variance import zvp_token_advantages
from loorl.errors import ConfigError
from loorl.parallel.distributed import all_reduce
from loorl.types import RolloutBatch


# ---- policy losses -----------------------------------------------------------------------------
def reinforce_token_loss(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """-A * log pi per token [N, T]: the on-policy loss (one step per rollout, ratio exactly 1).

    Its gradient is the REINFORCE estimate; no old logprobs are needed.
    """
    adv = token_advantages(advantages, logprobs)  # [N, 1] (or [N, T] per token)
    return -adv * logprobs  # [N, T]


def sampler_ratio_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, mode: str, low: float, high: float
) -> torch.Tensor:
    """Which real tokens [N, T] keep their loss under masked importance sampling (`loss.is_mode`).

    `log_ratio` [N, T]: log pi_train - log pi_sampler per token (0 outside `mask`). token_mask: a token
    whose ratio lies outside [low, high] is dropped (IcePop). sequence_mask: a whole sequence is
    dropped when the geometric mean of its token ratios, exp(mean_t log_ratio), lies outside (TRL's
    `vllm_importance_sampling_mode=sequence_mask`). Compared in log space: a ratio of 1e30 must not
    overflow into inf before the comparison."""
    valid = mask.bool()  # [N, T]
    lo = math.log(low) if low > 0 else -math.inf
    hi = math.log(high)
    if mode == "token_mask":
        level = log_ratio  # [N, T]
    elif mode == "sequence_mask":
        level = masked_mean(log_ratio, valid, -1, keepdim=True).expand_as(log_ratio)  # [N, T]
    else:
        raise ConfigError(f"loss.is_mode={mode!r} is not a mask; choose one of: {', '.join(IS_MODES[1:])}")
    return valid & (level >= lo) & (level <= hi)  # [N, T]


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    threshold: float,
) -> torch.Tensor:
    """Which sequences [N, 1] keep their policy loss under DeepSeek-V3.2's off-policy sequence mask
    (arXiv 2512.02556, eq. 9; `loss.off_policy_mask_threshold`, TRL's `off_policy_mask_threshold`).

    A sequence is dropped when its advantage is negative and the mean over its tokens of
    log pi_sampler - log pi_train (a KL estimate of how far the trained policy has moved from the one
    that sampled) exceeds `threshold`: pushing down a sample the current policy would no longer draw
    mostly destabilises. Positive advantages are always kept. A token the sampler could not score
    (NaN) adds 0, as in TRL; no gradient."""
    valid = mask.bool()  # [N, T]
    drift = torch.nan_to_num(sampler_logprobs - logprobs.detach(), nan=0.0)  # [N, T]
    mean_drift = masked_mean(drift, valid, -1, keepdim=True)  # [N, 1]
    adv = token_advantages(advantages, mean_drift)  # [N, 1] (or [N, T]: a sequence's sign is its sum's)
    return (adv.sum(-1, keepdim=True) >= 0) | (mean_drift <= threshold)  # [N, 1]


@register_loss("gpg")  # GPG's loss (Chu et al. 2025) is REINFORCE's: no ratio, no clip (verl's `gpg`)
@register_loss("reinforce")
def reinforce_loss(logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams) -> torch.Tensor:
    """-A * log pi [n, C], whatever the old log-probs: the on-policy REINFORCE loss."""
    return reinforce_token_loss(logprobs, batch.advantages)


@register_loss("auto")
def auto_loss(logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams):
    """REINFORCE at one optimizer step per rollout (no old log-probs: the ratio is exactly 1, and
    -A log pi has the same gradient without computing it), the clipped surrogate otherwise."""
    if batch.old_logprobs is None:
        return reinforce_loss(logprobs, batch, settings)
    return clipped_loss(logprobs, batch, settings)


# ---- aggregation -------------------------------------------------------------------------------
def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    num_tokens: float | None = None,
    num_seqs: int | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [N, T] to a scalar.

    Every mode is a sum over sequences divided by a normaliser; the normalisers default to this
    tensor's counts, but passing the whole optimisation batch's counts makes the sum of
    micro-batch losses equal the full-batch loss, so accumulation does not depend on micro-batch size.
      token-mean:               sum(loss) / num_tokens  (long answers weigh more per sequence)
      seq-mean-token-sum:       sum(loss) / num_seqs    (the unbiased policy gradient)
      seq-mean-token-mean:      sum_i mean_t(loss_i) / num_seqs  (GRPO's original length bias)
      seq-mean-token-sum-norm:  sum(loss) / (num_seqs * max_len), max_len a constant (Dr. GRPO)
    """
    valid = mask.bool()  # [N, T]
    masked = torch.where(valid, token_loss, 0.0)  # [N, T]
    n_seqs = token_loss.shape[0] if num_seqs is None else num_seqs
    n_seqs = max(n_seqs, 1)
    if mode == "token-mean":
        n_tokens = max(float(valid.sum()), 1.0) if num_tokens is None else num_tokens
        return masked.sum() / n_tokens
    if mode == "seq-mean-token-sum":
        return masked.sum() / n_seqs
    if mode == "seq-mean-token-mean":
        lengths = valid.sum(dim=-1).clamp(min=1).to(masked.dtype)  # [N]
        return (masked.sum(dim=-1) / lengths).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        length = token_loss.shape[1] if max_len is None else max_len
        return masked.sum() / (n_seqs * max(length, 1))
    raise ConfigError(f"loss.agg={mode!r} is not one of: {', '.join(AGGREGATIONS)}")


# ---- the policy loss of one micro-batch --------------------------------------------------------
@dataclass
class LossStats:
    """Sums over tokens (and optimizer steps) that add across micro-batches and mini-batches;
    `as_metrics` turns them into the logged per-token and per-step means."""

    loss: float = 0.0  # sum of the normalised losses (per mini-batch they add up to its loss)
    steps: int = 0  # optimizer steps
    tokens: float = 0.0  # real completion tokens
    entropy: float = 0.0
    clipped: float = 0.0  # tokens whose clipped branch was active
    log_ratio: float = 0.0  # log pi_train - log pi_sampler (the sampler/trainer mismatch)
    log_ratio_max: float = 0.0  # the largest |log ratio| (a maximum, not a sum)
    tis_weight: float | None = None  # with truncated importance sampling
    is_masked: float | None = None  # with masked importance sampling: real tokens whose loss was dropped
    off_policy_masked: float | None = None  # with the off-policy sequence mask: real tokens it dropped
    entropy_masked: float | None = None  # with top_entropy_quantile < 1: real tokens below the share
    zvp_tokens: float | None = None  # with RL-ZVP (zvp_alpha): real tokens of rows shaped by entropy
    zvp_advantage: float | None = None  # and the sum of their shaped advantages
    ratio: float | None = None  # off-policy: sum of pi_train / pi_old over tokens (old: the behaviour policy)
    ratio_sq: float | None = None  # and of its square (the ratio's spread)
    kl: float | None = None  # with a KL loss term
    grad_norm: float | None = None  # with gradient clipping: summed over steps

    def __add__(self, other: LossStats) -> LossStats:
        def add(a, b):
            return b if a is None else a if b is None else a + b

        values = {f.name: add(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)}
        values["log_ratio_max"] = max(self.log_ratio_max, other.log_ratio_max)
        return LossStats(**values)

    def across_ranks(self) -> LossStats:
        """The stats of the whole step over all data-parallel ranks: sums (each rank's loss is already
        normalised by the global counts, so the losses add up to the global loss), the maximum of
        `log_ratio_max`; `steps` and `grad_norm` are the same on every rank (the gradient is
        all-reduced before it is clipped) and stay as they are."""
        names = ("loss", "tokens", "entropy", "clipped", "log_ratio", "tis_weight", "is_masked",
                 "off_policy_masked", "entropy_masked", "zvp_tokens", "zvp_advantage", "ratio", "ratio_sq",
                 "kl")  # fmt: skip
        summed = [f for f in names if getattr(self, f) is not None]
        totals = all_reduce([getattr(self, f) for f in summed]).tolist()
        return replace(
            self,
            **dict(zip(summed, totals)),
            log_ratio_max=float(all_reduce(self.log_ratio_max, "max")),
        )

    def as_metrics(self) -> dict[str, float]:
        tokens, steps = max(self.tokens, 1.0), max(self.steps, 1)
        metrics = {
            "train/loss": self.loss / steps,
            "train/entropy": self.entropy / tokens,
            "train/clip_frac": self.clipped / tokens,
            "train/sampler_logratio_mean": self.log_ratio / tokens,
            "train/sampler_logratio_max": self.log_ratio_max,
        }
        if self.tis_weight is not None:
            metrics["train/tis_weight_mean"] = self.tis_weight / tokens
        if self.is_masked is not None:
            metrics["train/is_masked_frac"] = self.is_masked / tokens  # of the trained tokens
        if self.off_policy_masked is not None:
            metrics["train/off_policy_masked_frac"] = self.off_policy_masked / tokens
        if self.entropy_masked is not None:
            metrics["train/entropy_masked_frac"] = self.entropy_masked / tokens
        if self.zvp_tokens is not None:  # RL-ZVP: the share of tokens shaped, and their mean advantage
            metrics["train/zvp_token_frac"] = self.zvp_tokens / tokens
            metrics["train/zvp_advantage_mean"] = self.zvp_advantage / max(self.zvp_tokens, 1.0)
        if self.ratio is not None:  # off-policy: the importance ratio's mean and spread over tokens
            mean = self.ratio / tokens
            metrics["train/ratio_mean"] = mean
            metrics["train/ratio_std"] = max(self.ratio_sq / tokens - mean * mean, 0.0) ** 0.5
        if self.kl is not None:
            metrics["train/kl"] = self.kl / tokens
        if self.grad_norm is not None:
            metrics["train/grad_norm"] = self.grad_norm / steps
        return metrics


def policy_loss(
    logprobs: torch.Tensor,
    batch: RolloutBatch,
    *,
    settings: LossParams,
    num_tokens: float,
    num_seqs: int,
    kl_coef: float | None = None,
    kl_estimator: str = "k3",
    token_loss: TokenLoss | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """The policy-gradient loss of a micro-batch and its statistics.

    logprobs [n, C]: the trained policy's, with gradient, under the sampler's distribution. The per-token
    loss is `token_loss` (default: the one `settings.target` or `settings.name` names; `auto` is REINFORCE
    when `batch.old_logprobs` is None, the clipped surrogate otherwise); the sequences DeepSeek-V3.2's
    off-policy mask drops (`settings.off_policy_mask_threshold`) lose their policy term, not their KL
    term; tokens are weighted by the truncated importance weight min(pi_train / pi_sampler, tis_cap) when
    `settings.tis_cap` is set, a KL loss term `kl_coef * kl_t` is added when `kl_coef` is not None, tokens
    outside the sampler-ratio band carry no loss at all (policy and KL terms) under `settings.is_mode`
    token_mask or sequence_mask (`sampler_ratio_mask`; the counts stay the whole mini-batch's, as TRL's
    zero weights do, so the loss does not depend on the micro-batch), and the result is aggregated with
    the counts of the whole mini-batch (`num_tokens`, `num_seqs`), so that the micro-batch losses add up
    to the mini-batch loss.

    With `settings.zvp_alpha` (RL-ZVP, `loorl.algo.zero_variance`) the rows of groups without reward
    spread (`batch.zero_variance_sign` != 0) take token advantages shaped by their entropies [n, C]
    instead of the estimator's, before every step above.

    `entropy` [n, C] (with gradient where `entropy_coef` > 0): with `settings.top_entropy_quantile` < 1
    only the share of real tokens with the highest entropy keep their policy term (2506.01939); the
    bonus `-entropy_coef * sum(H) / num_tokens` over the tokens that keep it is added to the loss, a
    mean token entropy whatever `loss.agg` is (as TRL's), with the mini-batch's count so that micro-
    batches add up.
    """
    mask = batch.completion_mask  # [n, C]
    token_loss = token_loss or token_loss_of(settings.name, settings.target)
    zvp = None
    if (
        settings.zvp_alpha is not None and batch.zero_variance_sign is not None
    ):  # RL-ZVP: per-token advantages
        if entropy is None:
            raise ValueError("loss.zvp_alpha needs the tokens' entropies: pass entropy=")
        signs = batch.zero_variance_sign  # [n]
        token_adv = zvp_token_advantages(batch.advantages, signs, entropy, mask, alpha=settings.zvp_alpha)
        zvp = mask.bool() & (signs != 0).unsqueeze(-1)  # [n, C] the shaped rows' real tokens
        batch = replace(batch, advantages=token_adv)  # [n, C]
    out = token_loss(logprobs, batch, settings)
    tok_loss, clipped = out if isinstance(out, tuple) else (out, torch.zeros_like(mask, dtype=torch.bool))
    # Sampler/trainer mismatch: log pi_train - log pi_sampler per token, at the rollout's weights.
    behaviour = (logprobs if batch.old_logprobs is None else batch.old_logprobs).detach()  # [n, C]
    log_ratio = torch.where(mask.bool(), behaviour - batch.sampler_logprobs, 0.0)  # [n, C]
    stats = LossStats(
        tokens=float(mask.sum()),
        clipped=float((clipped.float() * mask).sum()),
        log_ratio=float(log_ratio.sum()),
        log_ratio_max=float(log_ratio.abs().max()) if mask.any() else 0.0,
    )
    if zvp is not None:
        stats.zvp_tokens = float(zvp.sum())
        stats.zvp_advantage = float(torch.where(zvp, batch.advantages, 0.0).sum())
    if batch.old_logprobs is not None:  # off-policy: pi_train / pi_old, the ratio the clipped loss uses
        ratio = torch.where(mask.bool(), torch.exp(logprobs.detach() - batch.old_logprobs), 0.0)  # [n, C]
        stats.ratio, stats.ratio_sq = float(ratio.sum()), float((ratio * ratio).sum())
    trained = mask.bool()  # [n, C] the tokens that keep their policy term (and get the entropy bonus)
    if settings.top_entropy_quantile < 1.0:  # the policy term only, as TRL's
        if entropy is None:
            raise ValueError("loss.top_entropy_quantile < 1 needs the tokens' entropies: pass entropy=")
        trained = top_entropy_mask(entropy, mask, settings.top_entropy_quantile)  # [n, C]
        tok_loss = torch.where(trained, tok_loss, 0.0)  # [n, C]
        stats.entropy_masked = float((mask.bool() & ~trained).sum())
    if settings.off_policy_mask_threshold is not None:  # before the KL term: it drops the policy term only
        keep = off_policy_sequence_mask(
            batch.advantages,
            logprobs,
            batch.sampler_logprobs,
            mask,
            threshold=settings.off_policy_mask_threshold,
        )  # [n, 1]
        tok_loss = torch.where(keep, tok_loss, 0.0)  # [n, C]
        stats.off_policy_masked = float((mask.bool() & ~keep).sum())
    if settings.tis_cap is not None:
        weight = torch.exp(log_ratio).clamp(max=settings.tis_cap)  # [n, C] truncated IS weight, no gradient
        tok_loss = tok_loss * weight  # [n, C]
        stats.tis_weight = float((weight * mask).sum())
    if kl_coef is not None:
        kl_tok = kl_per_token(logprobs, batch.ref_logprobs, estimator=kl_estimator)  # [n, C]
        tok_loss = tok_loss + kl_coef * kl_tok  # [n, C]
        stats.kl = float((kl_tok.detach() * mask).sum())
    if settings.is_mode != "truncate":
        band = {"low": settings.is_low, "high": settings.is_high}
        keep = sampler_ratio_mask(log_ratio, mask, mode=settings.is_mode, **band)  # [n, C]
        tok_loss = torch.where(keep, tok_loss, 0.0)  # [n, C] dropped, not multiplied: a dropped token's
        # loss (an inf ratio's) never reaches the sum, and its gradient is exactly 0
        stats.is_masked = float((mask.bool() & ~keep).sum())
    loss = aggregate(
        tok_loss, mask, mode=settings.agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=settings.max_len
    )
    if entropy_coef:
        if entropy is None or not entropy.requires_grad:
            raise ValueError("an entropy bonus needs the entropies with their gradient (entropy_grad=True)")
        bonus = torch.where(trained, entropy, 0.0).sum() / num_tokens  # [] the mean token entropy
        loss = loss - entropy_coef * bonus
    stats.loss = float(loss.detach())
    return loss, stats

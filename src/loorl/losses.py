"""Per-token policy-gradient losses, their aggregation, and KL penalties.

Shapes: N sequences, T completion positions (right-padded), V vocabulary entries.
`mask` [N, T] is 1 on real completion tokens; positions outside it may hold anything (even NaN)
and never reach a loss, because they are dropped with `torch.where`, not multiplied by 0.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from loorl.distributed import all_reduce
from loorl.errors import ConfigError
from loorl.masked import masked_mean
from loorl.rollout.batch import RolloutBatch
from loorl.settings import AGGREGATIONS, KL_ESTIMATORS, RATIO_LEVELS, LossSettings

# Where each estimator gives a KL gradient (exact expectations: tests/test_kl_gradients.py).
# Folded into the reward (a score-function term) only k1's gradient is that of KL(pi||ref);
# as a loss term k1's expected gradient is 0, k2's is that of KL(pi||ref), k3's that of the
# reverse KL(ref||pi) (what GRPO implementations use).
KL_ESTIMATORS_BY_PLACEMENT = {"reward": ("k1",), "loss": ("k2", "k3")}

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: beyond it a ratio is meaningless and exp() heads for inf


# ---- policy losses -----------------------------------------------------------------------------
def reinforce_token_loss(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """-A * log pi per token [N, T]: the on-policy loss (one step per rollout, ratio exactly 1).

    Its gradient is the REINFORCE estimate; no old logprobs are needed.
    """
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(-1)  # [N, 1]
    return -adv * logprobs  # [N, T]


def clipped_surrogate_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ratio_level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token: max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)).

    For several optimizer steps on one rollout, where the policy drifts from the sampler.
    ratio_level="token": ratio = pi/pi_old per token. "sequence" (GSPO): one ratio per sequence,
    exp of the masked mean token log-ratio, shared by its tokens (the length-normalised sequence
    likelihood ratio, which does not blow up with length). Returns the loss [N, T] and a bool
    [N, T] marking real tokens whose clipped branch was active (for the clip fraction).
    """
    valid = mask.bool()  # [N, T]
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), 0.0)  # [N, T]
    if ratio_level not in RATIO_LEVELS:  # a typo must not silently train with per-token ratios
        raise ConfigError(f"loss.ratio_level={ratio_level!r} is not one of: {', '.join(RATIO_LEVELS)}")
    if ratio_level == "sequence":
        seq_log_ratio = masked_mean(log_ratio, valid, -1, keepdim=True)  # [N, 1]
        log_ratio = seq_log_ratio.expand_as(logprobs)  # [N, T]
    ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()  # [N, T]
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(-1)  # [N, 1]
    unclipped = -adv * ratio  # [N, T]
    clipped_loss = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [N, T]
    loss = torch.maximum(unclipped, clipped_loss)  # [N, T]
    clipped = (clipped_loss > unclipped) & valid  # [N, T]
    return loss, clipped


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


# ---- KL to the reference policy ----------------------------------------------------------------
def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, estimator: str) -> torch.Tensor:
    """Per-token estimate [N, T] of KL(pi || ref) from the sampled tokens' logprobs (y ~ pi).

    With d = log pi - log ref: k1 = d (unbiased value, can be negative); k2 = d^2 / 2 (biased
    value, low variance); k3 = exp(-d) - 1 + d (Schulman's unbiased value, always >= 0).
    Their values all estimate KL(pi||ref), but their gradients differ, so each is accepted only
    where its expected gradient is a KL gradient (see check_kl_placement):
      in the reward (-coef * sum_t kl_t, a score-function term): k1 -> grad KL(pi||ref);
      as a loss term (coef * kl_t, differentiated through log pi): k2 -> grad KL(pi||ref),
      k3 -> grad of the reverse KL(ref||pi) (as GRPO implementations use). k1 as a loss term
      has expected gradient exactly 0; k2 or k3 in the reward give no KL's gradient.
    A loss term's KL is each token's given its sampled prefix: over several tokens it lacks the
    part of the sequence KL's gradient through which a token changes later tokens' KL, which the
    reward (k1) carries. scripts/kl_gradient_table.py prints all of them exactly.
    """
    if estimator not in KL_ESTIMATORS:
        raise ConfigError(f"kl.estimator={estimator!r} is not one of: {', '.join(KL_ESTIMATORS)}")
    d = logprobs - ref_logprobs  # [N, T]
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d  # [N, T]
    return torch.exp((-d).clamp(max=_MAX_LOG_RATIO)) - 1.0 + d  # [N, T] k3


def check_kl_placement(estimator: str, in_reward: bool) -> None:
    """Raise ConfigError unless `estimator` gives a KL gradient where the KL term is placed."""
    placement = "reward" if in_reward else "loss"
    if estimator in KL_ESTIMATORS_BY_PLACEMENT[placement]:
        return
    why = "has expected gradient 0" if estimator == "k1" else "does not give a KL gradient"
    raise ConfigError(
        f"kl.estimator={estimator} with kl.in_reward={str(in_reward).lower()} {why}: "
        "in the reward (kl.in_reward=true) use kl.estimator=k1; as a loss term (kl.in_reward=false) "
        "use kl.estimator=k2 (gradient of KL(pi||ref)) or kl.estimator=k3 "
        "(gradient of the reverse KL(ref||pi), as GRPO implementations do)"
    )


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): steer the measured KL towards `target`.

    error = clip(KL / target - 1, -0.2, 0.2); value *= 1 + error * n_steps / horizon.
    The clip bounds how fast one noisy KL measurement can move the coefficient.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if not target > 0:
            raise ConfigError(f"kl.target={target} must be a positive number")
        if not horizon > 0:
            raise ConfigError(f"kl.horizon={horizon} must be a positive number")
        self.value, self.target, self.horizon = float(init_coef), float(target), horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def sequence_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, *, estimator: str
) -> torch.Tensor:
    """Per-sequence KL estimate [N]: the per-token estimate summed over each completion's real tokens.

    Folded into the reward as `reward - coef * sequence_kl` (before the baseline, so it sees it too).
    """
    kl_tok = kl_per_token(logprobs, ref_logprobs, estimator=estimator)  # [N, T]
    return torch.where(mask.bool(), kl_tok, 0.0).sum(-1)  # [N]


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
        names = ("loss", "tokens", "entropy", "clipped", "log_ratio", "tis_weight", "kl")
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
        if self.kl is not None:
            metrics["train/kl"] = self.kl / tokens
        if self.grad_norm is not None:
            metrics["train/grad_norm"] = self.grad_norm / steps
        return metrics


def policy_loss(
    logprobs: torch.Tensor,
    batch: RolloutBatch,
    *,
    settings: LossSettings,
    num_tokens: float,
    num_seqs: int,
    kl_coef: float | None = None,
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, LossStats]:
    """The policy-gradient loss of a micro-batch and its statistics.

    logprobs [n, C]: the trained policy's, with gradient, under the sampler's distribution.
    The loss is REINFORCE (-A log pi) when `batch.old_logprobs` is None (one optimizer step per
    rollout: the ratio is exactly 1), the clipped surrogate otherwise; tokens are weighted by the
    truncated importance weight min(pi_train / pi_sampler, tis_cap) when `settings.tis_cap` is set,
    a KL loss term `kl_coef * kl_t` is added when `kl_coef` is not None, and the result is
    aggregated with the counts of the whole mini-batch (`num_tokens`, `num_seqs`), so that the
    micro-batch losses add up to the mini-batch loss.
    """
    mask = batch.completion_mask  # [n, C]
    if batch.old_logprobs is None:
        tok_loss = reinforce_token_loss(logprobs, batch.advantages)  # [n, C]
        clipped = torch.zeros_like(mask, dtype=torch.bool)  # [n, C]
    else:
        tok_loss, clipped = clipped_surrogate_token_loss(
            logprobs,
            batch.old_logprobs,
            batch.advantages,
            mask,
            clip_low=settings.clip_low,
            clip_high=settings.clip_high,
            ratio_level=settings.ratio_level,
        )  # [n, C], [n, C]
    # Sampler/trainer mismatch: log pi_train - log pi_sampler per token, at the rollout's weights.
    behaviour = (logprobs if batch.old_logprobs is None else batch.old_logprobs).detach()  # [n, C]
    log_ratio = torch.where(mask.bool(), behaviour - batch.sampler_logprobs, 0.0)  # [n, C]
    stats = LossStats(
        tokens=float(mask.sum()),
        clipped=float((clipped.float() * mask).sum()),
        log_ratio=float(log_ratio.sum()),
        log_ratio_max=float(log_ratio.abs().max()) if mask.any() else 0.0,
    )
    if settings.tis_cap is not None:
        weight = torch.exp(log_ratio).clamp(max=settings.tis_cap)  # [n, C] truncated IS weight, no gradient
        tok_loss = tok_loss * weight  # [n, C]
        stats.tis_weight = float((weight * mask).sum())
    if kl_coef is not None:
        kl_tok = kl_per_token(logprobs, batch.ref_logprobs, estimator=kl_estimator)  # [n, C]
        tok_loss = tok_loss + kl_coef * kl_tok  # [n, C]
        stats.kl = float((kl_tok.detach() * mask).sum())
    loss = aggregate(
        tok_loss, mask, mode=settings.agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=settings.max_len
    )
    stats.loss = float(loss.detach())
    return loss, stats

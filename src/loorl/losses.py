"""Per-token policy-gradient losses, their aggregation, and KL penalties.

Shapes: N sequences, T completion positions (right-padded), V vocabulary entries.
`mask` [N, T] is 1 on real completion tokens; positions outside it may hold anything (even NaN)
and never reach a loss, because they are dropped with `torch.where`, not multiplied by 0.
"""

from __future__ import annotations

import math

import torch

from loorl.errors import ConfigError
from loorl.estimators import masked_mean

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
RATIO_LEVELS = ("token", "sequence")

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: beyond it a ratio is meaningless and exp() heads for inf


# ---- log-probabilities -------------------------------------------------------------------------
def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ConfigError(f"temperature={temperature} must be a positive number")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16 logsumexp over a big vocabulary loses the logprob); float64 stays."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = 8
) -> torch.Tensor:
    """log pi(token) [N, T] under softmax(logits / temperature), in float32 (or float64).

    Computed as gather - logsumexp instead of a full log_softmax: the latter keeps another
    [N, T, V] tensor alive for backward, the memory peak with 150k-entry vocabularies.
    Rows are processed `chunk_size` sequences at a time to bound logsumexp's temporaries.
    The temperature must be the sampler's, or the logprobs are of a different policy.
    """
    _check_temperature(temperature)
    parts = []
    for start in range(0, logits.shape[0], max(1, chunk_size)):
        scaled = _upcast(logits[start : start + chunk_size])  # [n, T, V]
        if temperature != 1.0:
            scaled = scaled / temperature  # [n, T, V]
        ids = tokens[start : start + chunk_size].long().unsqueeze(-1)  # [n, T, 1]
        picked = scaled.gather(-1, ids).squeeze(-1)  # [n, T]
        parts.append(picked - torch.logsumexp(scaled, dim=-1))  # [n, T]
    if not parts:
        return logits.new_zeros(logits.shape[:2], dtype=torch.float32)  # [0, T]
    return torch.cat(parts, dim=0)  # [N, T]


def token_entropy(logits: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = 8) -> torch.Tensor:
    """Entropy [N, T] of softmax(logits / temperature), for monitoring: call it under no_grad.

    Masked-out vocabulary entries (-inf logits) contribute 0, not NaN.
    """
    _check_temperature(temperature)
    parts = []
    for start in range(0, logits.shape[0], max(1, chunk_size)):
        scaled = _upcast(logits[start : start + chunk_size]) / temperature  # [n, T, V]
        logp = torch.log_softmax(scaled, dim=-1)  # [n, T, V]
        plogp = torch.where(logp > -math.inf, logp.exp() * logp, 0.0)  # [n, T, V]
        parts.append(-plogp.sum(dim=-1))  # [n, T]
    if not parts:
        return logits.new_zeros(logits.shape[:2], dtype=torch.float32)  # [0, T]
    return torch.cat(parts, dim=0)  # [N, T]


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
    if ratio_level not in RATIO_LEVELS:
        raise ConfigError(f"loss.ratio_level={ratio_level!r} is not one of: {', '.join(RATIO_LEVELS)}")
    valid = mask.bool()  # [N, T]
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), 0.0)  # [N, T]
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
    if mode not in AGGREGATIONS:
        raise ConfigError(f"loss.agg={mode!r} is not one of: {', '.join(AGGREGATIONS)}")
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
    length = token_loss.shape[1] if max_len is None else max_len
    return masked.sum() / (n_seqs * max(length, 1))


# ---- KL to the reference policy ----------------------------------------------------------------
def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, estimator: str) -> torch.Tensor:
    """Per-token estimate [N, T] of KL(pi || ref) from the sampled tokens' logprobs.

    With d = log pi - log ref: k1 = d (unbiased, can be negative); k2 = d^2 / 2 (low variance,
    biased); k3 = exp(-d) - 1 + d (Schulman's unbiased, always >= 0); abs = |d|.
    """
    if estimator not in KL_ESTIMATORS:
        raise ConfigError(f"kl.estimator={estimator!r} is not one of: {', '.join(KL_ESTIMATORS)}")
    d = logprobs - ref_logprobs  # [N, T]
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d  # [N, T]
    if estimator == "k3":
        return torch.exp((-d).clamp(max=_MAX_LOG_RATIO)) - 1.0 + d  # [N, T]
    return d.abs()  # [N, T]


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

"""PPO's clipped surrogate per token (`loss.name=clipped` in `loorl.algo.objectives`, and Clip-Cov's
base) and the field's newer per-token policy losses, each registered under the name verl 0.9.1 gives
it (`verl/trainer/ppo/core_algos.py`; tests/test_peer_oracles.py feeds both the same inputs).

Every loss here has the registry's signature `fn(logprobs [n, C], batch, settings) -> (loss [n, C],
clipped [n, C])`: `clipped` marks the real tokens whose loss a clip, mask or penalty changed
(`train/clip_frac`). On-policy (`batch.old_logprobs` is None) pi_old is the current policy detached,
so every ratio is exactly 1 and each loss's gradient is REINFORCE's (SAPO's and GMPO's too).
Positions outside the completion mask may hold anything: every quantity is computed from masked
values (`torch.where`), so neither a loss nor a gradient there can be NaN.
"""

from __future__ import annotations

import torch

from loorl.algo.kl import MAX_LOG_RATIO
from loorl.algo.loss_registry import RATIO_LEVELS, LossParams, register_loss, token_advantages
from loorl.algo.masked import masked_mean
from loorl.errors import ConfigError
from loorl.types import RolloutBatch


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
    ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # [N, T]
    adv = token_advantages(advantages, logprobs)  # [N, 1] (or [N, T] per token)
    unclipped = -adv * ratio  # [N, T]
    clipped_loss = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [N, T]
    loss = torch.maximum(unclipped, clipped_loss)  # [N, T]
    clipped = (clipped_loss > unclipped) & valid  # [N, T]
    return loss, clipped


@register_loss("clipped")
def clipped_loss(
    logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (GSPO's with `loss.ratio_level=sequence`); on-policy the ratio is 1."""
    old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs  # [n, C]
    return clipped_surrogate_token_loss(
        logprobs,
        old,
        batch.advantages,
        batch.completion_mask,
        clip_low=settings.clip_low,
        clip_high=settings.clip_high,
        ratio_level=settings.ratio_level,
    )  # [n, C], [n, C]


def _token_terms(logprobs: torch.Tensor, batch: RolloutBatch):
    """The masked terms every loss here starts from: the real tokens [n, C], log pi [n, C] and log pi_old
    [n, C] (0 outside the mask), log pi - log pi_old [n, C], and the advantages [n, 1] without gradient."""
    valid = batch.completion_mask.bool()  # [n, C]
    old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs.detach()  # [n, C]
    logp = torch.where(valid, logprobs, 0.0)  # [n, C]
    old = torch.where(valid, old, 0.0)  # [n, C]
    adv = token_advantages(batch.advantages, logprobs)  # [n, 1] (or [n, C] per token: RL-ZVP)
    return valid, logp, old, logp - old, adv


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """pi / pi_old [n, C], its log clamped to +-20 first (verl's clamp: exp(20) ~ 5e8)."""
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # [n, C]


@register_loss("cispo")
def cispo_loss(logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams):
    """CISPO (MiniMax-M1, 2506.13585; ScaleRL's loss): -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) A log pi.

    The clip acts on a stop-gradient weight, not on the objective: a clipped token still carries its
    gradient (PPO's clip drops it), only with a bounded weight. The paper leaves the lower end open
    (clip_low >= 1) and tunes clip_high."""
    valid, logp, _, log_ratio, adv = _token_terms(logprobs, batch)
    ratio = _ratio(log_ratio.detach())  # [n, C] a weight: no gradient
    weight = ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)  # [n, C]
    loss = -weight * adv * logp  # [n, C]
    return loss, valid & (weight != ratio)


def _dppo(logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams, *, binary_kl: bool):
    """DPPO (2602.04879): -A * sg(min(ratio, cap)) * log pi, dropped where the token's probability moved
    too far in the direction its advantage pushes it. The trust region is a mask on the change of the
    sampled token's probability (total variation |p - p_old|, or the binary KL between Bernoulli(p_old)
    and Bernoulli(p)), with thresholds clip_high (A > 0) and clip_low (A <= 0), as verl reads them."""
    valid, logp, old, log_ratio, adv = _token_terms(logprobs, batch)
    weight = _ratio(log_ratio.detach()).clamp(max=settings.dppo_ratio_cap)  # [n, C] a weight: no gradient
    p, p_old = logp.detach().exp(), old.exp()  # [n, C]
    if binary_kl:  # KL(Bernoulli(p_old) || Bernoulli(p)); a move away from the pushed direction always passes
        tiny = 1e-8  # verl's guard of log(1 - p) at p = 1
        divergence = p_old * (old - logp.detach()) + (1 - p_old) * torch.log(
            (1 - p_old + tiny) / (1 - p + tiny)
        )
        up_ok = (divergence <= settings.clip_high) | (p <= p_old)  # [n, C]
        down_ok = (divergence <= settings.clip_low) | (p >= p_old)  # [n, C]
    else:
        up_ok = (p - p_old) <= settings.clip_high  # [n, C]
        down_ok = (p - p_old) >= -settings.clip_low  # [n, C]
    keep = valid & torch.where(adv > 0, up_ok, down_ok)  # [n, C]
    loss = torch.where(keep, -adv * weight * logp, 0.0)  # [n, C]
    return loss, valid & ~keep


@register_loss("dppo_tv")
def dppo_tv_loss(logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams):
    """DPPO with the total-variation trust region: |p - p_old| of the sampled token (prime-rl's default)."""
    return _dppo(logprobs, batch, settings, binary_kl=False)


@register_loss("dppo_kl")
def dppo_kl_loss(logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams):
    """DPPO with the binary-KL trust region: KL(Bernoulli(p_old) || Bernoulli(p)) of the sampled token."""
    return _dppo(logprobs, batch, settings, binary_kl=True)


@register_loss("sapo")
def sapo_loss(logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams):
    """SAPO (Qwen, 2511.20347): -A * (4 / tau) * sigmoid(tau * (ratio - 1)), tau = sapo_tau_pos where
    A > 0, sapo_tau_neg elsewhere.

    A soft trust region instead of a hard clip: the gate's slope is 1 at ratio 1 (REINFORCE's
    gradient on-policy) and decays smoothly as the ratio leaves 1, faster for negative advantages
    (tau_neg > tau_pos). Averaged per sequence (`loss.agg=seq-mean-token-mean`, which the config
    check requires), as the paper and verl do."""
    valid, _, _, log_ratio, adv = _token_terms(logprobs, batch)
    tau = torch.where(
        adv > 0, adv.new_tensor(settings.sapo_tau_pos), adv.new_tensor(settings.sapo_tau_neg)
    )  # [n, 1]
    gate = torch.sigmoid(tau * (_ratio(log_ratio) - 1.0)) * (4.0 / tau)  # [n, C]
    return -gate * adv, torch.zeros_like(valid)


@register_loss("geo_mean")
def geo_mean_loss(logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams):
    """GMPO (2507.20673): -A * exp(mean_t clip(log ratio_t)), the geometric mean of the token ratios.

    Each token's log-ratio is clipped to [-clip_low, clip_high] on the side its advantage pushes
    (PPO's pessimistic min, in log space), then averaged over the sequence; the geometric mean is
    less swayed by one outlier token than the arithmetic mean. One loss per sequence, put on each of
    its tokens, so `loss.agg=seq-mean-token-mean` (which the config check requires) averages the
    sequences' losses, as verl's mean over sequences does. verl suggests a wider band (e.g. 0.4)."""
    valid, _, _, log_ratio, adv = _token_terms(logprobs, batch)
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [n, C]
    sign = torch.sign(adv)  # [n, 1]
    banded = log_ratio.clamp(-settings.clip_low, settings.clip_high)  # [n, C]
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * banded)  # [n, C]
    seq_ratio = masked_mean(pessimistic, valid, -1, keepdim=True).exp()  # [n, 1]
    loss = (-adv * seq_ratio).expand_as(log_ratio)  # [n, C]
    return loss, valid & (log_ratio != banded) & (adv != 0)


def _covariance(logp: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each real token's term of the covariance of log pi and A over the micro-batch's tokens [n, C]
    (the quantity 2505.22617 shows drives entropy down); no gradient."""
    logp = logp.detach()  # [n, C]
    adv = adv.expand_as(logp)  # [n, C]
    return (adv - masked_mean(adv, valid)) * (logp - masked_mean(logp, valid))  # [n, C]


@register_loss("clip_cov")
def clip_cov_loss(logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams):
    """Clip-Cov (2505.22617): PPO's clipped surrogate, with the gradient of a few random tokens cut:
    cov_share of the micro-batch's tokens (at least one), drawn among the unclipped tokens whose
    covariance term lies in (clip_cov_low, clip_cov_high).

    The draw uses torch's global generator (seeded by the run's seed), in verl's order, so a seeded
    run repeats it."""
    valid, logp, _, _, adv = _token_terms(logprobs, batch)
    ppo, by_clip = clipped_loss(logprobs, batch, settings)  # [n, C] each; PPO's clip holds the by_clip ones
    cov = _covariance(logp, adv, valid)  # [n, C]
    candidates = valid & ~by_clip & (cov > settings.clip_cov_low) & (cov < settings.clip_cov_high)  # [n, C]
    where = candidates.nonzero()  # [m, 2] in row-major order, as verl draws from
    count = max(int(settings.cov_share * float(valid.sum())), 1)
    chosen = where[torch.randperm(len(where)).to(where.device)[:count]]  # [<=count, 2]
    cut = torch.zeros_like(valid)  # [n, C]
    cut[chosen[:, 0], chosen[:, 1]] = True
    loss = torch.where(cut, 0.0, ppo)  # [n, C]
    return loss, by_clip | cut


@register_loss("kl_cov")
def kl_cov_loss(logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams):
    """KL-Cov (2505.22617): -A * ratio, plus kl_cov_coef * |log pi/pi_old| on the cov_share of the
    micro-batch's tokens (at least one) with the largest covariance term. No clip."""
    valid, logp, _, log_ratio, adv = _token_terms(logprobs, batch)
    loss = -adv * _ratio(log_ratio)  # [n, C]
    real = valid.flatten().nonzero()[:, 0]  # [m] the real tokens' places in the flattened [n * C]
    cov = _covariance(logp, adv, valid)[valid]  # [m] in row-major order: ties (equal advantages) go as verl's
    penalised = torch.zeros_like(valid)  # [n, C]
    if len(real):
        top = cov.topk(max(int(len(real) * settings.cov_share), 1)).indices  # [k]
        penalised.view(-1)[real[top]] = True
    loss = torch.where(penalised, loss + settings.kl_cov_coef * log_ratio.abs(), loss)  # [n, C]
    return loss, penalised


@register_loss("dro")
def dro_loss(logprobs: torch.Tensor, batch: RolloutBatch, settings: LossParams):
    """DRO (Richemond et al. 2024): -(A * log pi - dro_beta / 2 * (log pi - log pi_old)^2).

    A REINFORCE loss with a quadratic penalty that keeps the policy near pi_old over the steps of a
    rollout, in place of a clip (its gradient grows with the drift instead of stopping)."""
    valid, logp, _, log_ratio, adv = _token_terms(logprobs, batch)
    loss = -(adv * logp - 0.5 * settings.dro_beta * log_ratio.square())  # [n, C]
    return loss, torch.zeros_like(valid)

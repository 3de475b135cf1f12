"""The field's newer per-token losses (loorl.algo.policy_losses): values by hand from each paper's
formula, the on-policy gradient (REINFORCE's for every loss), padding that holds NaN, empty masks,
and the config check's one-line errors. tests/test_peer_oracles.py compares them with verl's code."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from loorl.algo.objectives import loss_names, policy_loss, token_loss_of
from loorl.errors import ConfigError
from loorl.settings.training import LossSettings
from loorl.types import RolloutBatch

NEWER = ("cispo", "dppo_tv", "dppo_kl", "sapo", "geo_mean", "clip_cov", "kl_cov", "gpg", "dro")
PER_SEQUENCE = ("sapo", "geo_mean")
NAN_ = float("nan")


def settings(name: str, **kw) -> LossSettings:
    agg = "seq-mean-token-mean" if name in PER_SEQUENCE else "seq-mean-token-sum"
    return LossSettings(name=name, agg=kw.pop("agg", agg), **kw)


def batch_of(logp_old, adv, mask, *, on_policy=False) -> RolloutBatch:
    n, c = mask.shape
    return RolloutBatch(
        input_ids=torch.zeros(n, c, dtype=torch.long), attention_mask=torch.ones(n, c), completion_mask=mask,
        sampler_logprobs=logp_old, rewards=torch.zeros(n), samples_per_prompt=1, prompt_len=0,
        advantages=adv, old_logprobs=None if on_policy else logp_old,
    )  # fmt: skip


def token_loss(name, logp, old, adv, mask=None, **kw):
    mask = torch.ones_like(logp) if mask is None else mask
    out = token_loss_of(name)(logp, batch_of(old, adv, mask), settings(name, **kw))
    return out if isinstance(out, tuple) else (out, None)


def test_every_newer_loss_is_registered_under_verls_name():
    assert set(NEWER) <= set(loss_names())


# ---- values by hand ----------------------------------------------------------------------------
def test_cispo_weights_log_pi_by_the_clipped_ratio_without_its_gradient():
    # ratios e^0.5 = 1.649 (clipped to 1.28) and e^-0.1 = 0.905 (inside [0.8, 1.28]); A = 2
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.9]])
    loss, clipped = token_loss("cispo", logp, old, torch.tensor([2.0]), clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.28 * 2 * -1.0, -math.exp(-0.1) * 2 * -2.0]]))
    assert clipped.tolist() == [[True, False]]
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(
        grad, torch.tensor([[-1.28 * 2, -math.exp(-0.1) * 2]])
    )  # the clipped token keeps one


def test_dppo_masks_tokens_whose_probability_moved_too_far_the_pushed_way():
    # p_old = 0.5 -> p = 0.8 (+0.3) and p_old = 0.5 -> p = 0.2 (-0.3); threshold 0.2 each way
    logp = torch.log(torch.tensor([[0.8, 0.2], [0.8, 0.2]]))
    old = torch.log(torch.full((2, 2), 0.5))
    adv = torch.tensor([1.0, -1.0])  # row 0 pushes up, row 1 pushes down
    loss, dropped = token_loss("dppo_tv", logp, old, adv)
    # A > 0: the token that rose by 0.3 > 0.2 is dropped, the one that fell is kept (weight 0.4)
    # A < 0: the token that fell by 0.3 is dropped, the one that rose is kept (weight 1.6)
    assert dropped.tolist() == [[True, False], [False, True]]
    torch.testing.assert_close(loss, torch.tensor([[0.0, -0.4 * math.log(0.2)], [1.6 * math.log(0.8), 0.0]]))
    # the binary KL of Bernoulli(0.5) -> Bernoulli(0.8): 0.5 log(0.5/0.8) + 0.5 log(0.5/0.2) = 0.2231
    kl = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    _, dropped = token_loss("dppo_kl", logp, old, adv, clip_low=kl + 0.01, clip_high=kl - 0.01)
    assert dropped.tolist() == [[True, False], [False, False]]


def test_sapo_gate_by_hand_and_its_slope_is_one_at_ratio_one():
    # ratio e^0.2; A = 1 (tau_pos = 1): -(4 / 1) sigmoid(e^0.2 - 1); A = -1 (tau_neg = 1.05)
    logp = torch.tensor([[-1.0], [-1.0]], requires_grad=True)
    old = torch.tensor([[-1.2], [-1.2]])
    loss, _ = token_loss("sapo", logp, old, torch.tensor([1.0, -1.0]))
    r = math.exp(0.2)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    torch.testing.assert_close(loss, torch.tensor([[-4 * sig(r - 1)], [4 / 1.05 * sig(1.05 * (r - 1))]]))
    at_one = torch.tensor([[-1.0]], requires_grad=True)
    loss, _ = token_loss("sapo", at_one, at_one.detach(), torch.tensor([3.0]))
    (grad,) = torch.autograd.grad(loss.sum(), at_one)
    torch.testing.assert_close(grad, torch.tensor([[-3.0]]))  # sigmoid'(0) * tau * 4 / tau = 1


def test_geo_mean_is_the_geometric_mean_of_the_pessimistically_clipped_ratios():
    # log ratios 0.5 and -0.1; A = 1: the rise is clipped to 0.2 (clip_high), the fall is not
    logp = torch.tensor([[-1.0, -2.0, 0.0]])
    old = torch.tensor([[-1.5, -1.9, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, clipped = token_loss("geo_mean", logp, old, torch.tensor([1.0]), mask)
    seq = -math.exp((0.2 - 0.1) / 2)
    torch.testing.assert_close(loss, torch.full((1, 3), seq))
    assert clipped.tolist() == [[True, False, False]]
    # A = -1: the fall is clipped at -0.2 from below, not -0.1; the rise of 0.5 stays (the pessimistic side)
    loss, _ = token_loss("geo_mean", logp, old, torch.tensor([-1.0]), mask)
    torch.testing.assert_close(loss[0, 0], torch.tensor(math.exp((0.5 - 0.1) / 2)))


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    # two sequences of 2 tokens, A = +1 and -1: covariance terms (A - 0)(log pi - mean log pi)
    logp = torch.tensor([[-0.5, -2.0], [-0.5, -2.0]])  # mean -1.25: terms +0.75, -0.75 | -0.75, +0.75
    old = logp - torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    loss, penalised = token_loss(
        "kl_cov", logp, old, torch.tensor([1.0, -1.0]), cov_share=0.5, kl_cov_coef=2.0
    )
    assert penalised.tolist() == [[True, False], [False, True]]  # the two +0.75 terms
    ratio = torch.exp(logp - old)
    expected = -torch.tensor([[1.0], [-1.0]]) * ratio + 2.0 * torch.tensor([[0.1, 0.0], [0.0, 0.4]])
    torch.testing.assert_close(loss, expected)


def test_clip_cov_cuts_the_drawn_tokens_only_inside_the_band():
    logp = torch.tensor([[-0.5, -2.0], [-0.5, -2.0]], requires_grad=True)
    old = logp.detach().clone()  # ratio 1: PPO's clip holds nothing
    adv = torch.tensor([2.0, -2.0])  # terms +1.5, -1.5 | -1.5, +1.5 (mean log pi -1.25)
    loss, cut = token_loss("clip_cov", logp, old, adv, cov_share=1.0, clip_cov_low=1.0, clip_cov_high=5.0)
    assert cut.tolist() == [[True, False], [False, True]]  # both in (1, 5), share 1: both drawn
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -2.0], [2.0, 0.0]]))
    _, cut = token_loss("clip_cov", logp, old, adv, cov_share=1.0, clip_cov_low=2.0, clip_cov_high=5.0)
    assert not cut.any()  # no term in (2, 5)


def test_dro_is_reinforce_with_a_quadratic_drift_penalty():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0]])
    loss, _ = token_loss("dro", logp, old, torch.tensor([3.0]), dro_beta=0.4)
    torch.testing.assert_close(loss, torch.tensor([[3.0 + 0.2 * 0.25, 6.0]]))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[-3.0 + 0.4 * 0.5, -3.0]]))


# ---- every newer loss: on-policy, padding, empty masks -----------------------------------------
def _tokens(seed=0, n=4, c=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, c, generator=g, dtype=torch.float64) * 2 - 0.05  # [n, C]
    mask = (torch.arange(c)[None, :] < torch.tensor([5, 3, 1, 4])[:, None]).double()  # [n, C]
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)  # [n]
    return logp, mask, adv


@pytest.mark.parametrize("name", NEWER)
def test_on_policy_every_loss_has_the_reinforce_gradient(name):
    """At ratio 1 (one optimizer step per rollout) each loss's gradient is -A grad log pi, aggregated."""
    logp, mask, adv = _tokens()
    s = settings(name)
    grads = []
    for loss_name in (name, "reinforce"):
        leaf = logp.clone().requires_grad_(True)
        chosen = s if loss_name == name else LossSettings(name=loss_name, agg=s.agg)
        batch = batch_of(logp, adv, mask, on_policy=True)
        loss, _ = policy_loss(leaf, batch, settings=chosen, num_tokens=float(mask.sum()), num_seqs=4)
        grads.append(torch.autograd.grad(loss, leaf)[0])
    if name == "clip_cov":  # it cuts the drawn tokens' gradient (at least one): compare the others
        kept = grads[0] != 0
        torch.testing.assert_close(grads[0][kept], grads[1][kept])
        assert int((~kept & mask.bool()).sum()) <= 1  # 2e-4 of 13 tokens rounds up to one
    else:
        torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("name", NEWER)
def test_nan_padding_and_empty_masks_give_finite_losses_and_zero_gradients(name):
    logp, mask, adv = _tokens(1)
    old = logp + 0.3 * torch.randn(
        logp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    padded = torch.where(mask.bool(), logp, torch.nan).requires_grad_(True)  # NaN where there is no token
    old = torch.where(mask.bool(), old, torch.nan)
    loss, _ = policy_loss(
        padded, batch_of(old, adv, mask), settings=settings(name), num_tokens=13.0, num_seqs=4
    )
    (grad,) = torch.autograd.grad(loss, padded)
    assert math.isfinite(float(loss.detach())) and torch.isfinite(grad).all()
    assert (grad[~mask.bool()] == 0).all()
    empty = torch.zeros_like(mask)
    leaf = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(
        leaf, batch_of(logp, adv, empty), settings=settings(name), num_tokens=1.0, num_seqs=4
    )
    (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    assert float(loss) == 0.0 and (grad is None or (grad == 0).all()) and stats.clipped == 0


# ---- the config check --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"name": "sapo", "agg": "token-mean"},
            "loss.name=sapo with loss.agg=token-mean: sapo averages each",
        ),
        ({"name": "geo_mean"}, "loss.agg=seq-mean-token-mean"),
        ({"name": "cispo", "ratio_level": "sequence", "agg": "seq-mean-token-mean"}, "set loss.name=clipped"),
        (
            {"name": "clip_cov", "clip_cov_low": 5.0, "clip_cov_high": 1.0},
            "set clip_cov_low below clip_cov_high",
        ),
        ({"name": "kl_cov", "cov_share": 0.0}, "cov_share"),
        ({"name": "dro", "dro_beta": 0.0}, "dro_beta"),
    ],
)
def test_bad_combinations_are_one_line(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message) as err:
        LossSettings(**overrides)
    assert message in str(err.value) or "validation error" in str(err.value)


# ---- DeepSeek-V3.2's off-policy sequence mask --------------------------------------------------
def test_off_policy_mask_drops_negative_sequences_that_drifted_by_hand():
    # mean log pi_sampler - log pi: row 0 +0.6 (A < 0: dropped), row 1 +0.6 (A > 0: kept),
    # row 2 +0.1 (A < 0, under 0.5: kept); row 3's NaN token adds 0: (0.9 + 0) / 2 = 0.45, kept
    logp = torch.full((4, 2), -1.0, dtype=torch.float64)
    sampler = torch.tensor([[-0.4, -0.4], [-0.4, -0.4], [-0.9, -0.9], [-0.1, NAN_]], dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    batch = batch_of(sampler, adv, mask)
    s = settings("reinforce", off_policy_mask_threshold=0.5)
    leaf = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(leaf, batch, settings=s, num_tokens=8.0, num_seqs=4)
    (grad,) = torch.autograd.grad(loss, leaf)
    assert (grad[0] == 0).all() and (grad[1:] != 0).all()  # only row 0 lost its policy term
    assert stats.off_policy_masked == 2.0 and stats.as_metrics()["train/off_policy_masked_frac"] == 0.25
    off, _ = policy_loss(logp, batch, settings=settings("reinforce"), num_tokens=8.0, num_seqs=4)
    assert float(off) != float(loss.detach())  # and off by default


def test_off_policy_mask_keeps_the_kl_term_of_a_dropped_sequence():
    logp = torch.full((1, 2), -1.0, dtype=torch.float64, requires_grad=True)
    sampler = torch.full((1, 2), -0.2, dtype=torch.float64)  # drift 0.8
    batch = batch_of(
        sampler, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    )
    batch = replace(batch, ref_logprobs=torch.full((1, 2), -1.5, dtype=torch.float64))
    s = settings("reinforce", off_policy_mask_threshold=0.5)
    loss, _ = policy_loss(logp, batch, settings=s, num_tokens=2.0, num_seqs=1, kl_coef=0.1, kl_estimator="k2")
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(
        grad, torch.full((1, 2), 0.1 * 0.5, dtype=torch.float64)
    )  # k2's: coef * (log pi - ref)

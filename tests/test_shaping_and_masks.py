"""DAPO's soft overlong punishment (`reward.overlong`) and masked importance sampling
(`loss.is_mode`), against hand-computed values, gradients included."""

from __future__ import annotations

import math

import pytest
import torch

from loorl.algo.objectives import policy_loss, sampler_ratio_mask
from loorl.rewards.shaping import overlong_penalty
from loorl.settings import LossSettings
from loorl.types import RolloutBatch


# ---- overlong penalty ---------------------------------------------------------------------------
def test_overlong_penalty_by_hand():
    """Limit 20, buffer 8: free up to 12 tokens, then -1/8 per token over 12, -1 (times the penalty) at 20."""
    lengths = torch.tensor([[1, 12, 13, 16], [19, 20, 20, 0]])
    got = overlong_penalty(lengths, max_len=20, buffer=8, penalty=0.5)
    want = [[0, 0, -0.5 / 8, -0.5 * 4 / 8], [-0.5 * 7 / 8, -0.5, -0.5, 0]]
    assert torch.allclose(got, torch.tensor(want)) and got.dtype == torch.float32
    assert torch.equal(overlong_penalty(lengths, max_len=20, buffer=0, penalty=1.0), torch.zeros(2, 4))
    whole = overlong_penalty(torch.tensor([0, 10, 20]), max_len=20, buffer=20, penalty=1.0)
    assert whole.tolist() == [0.0, -0.5, -1.0]  # a buffer as long as the limit: the ramp starts at 0


def test_the_overlong_penalty_reaches_the_reward_the_estimator_sees(quick_config):
    """The DataModule adds it after grading: rewards = task reward + penalty, the mean logged."""
    from fixtures import tiny_parts
    from loorl.build import build_datamodule

    cfg = quick_config("reward.overlong.buffer=4", "reward.overlong.penalty=0.25", "rollout.max_new_tokens=6")
    _, task, path, tok, model = tiny_parts(cfg)
    dm, plain = (
        build_datamodule(cfg, task, tok, path),
        build_datamodule(quick_config("rollout.max_new_tokens=6"), task, tok, path),
    )
    for d in (dm, plain):
        d.engine.sync(model)
    shaped, unshaped = dm.rollout_for_step(step=0), plain.rollout_for_step(step=0)
    lengths = shaped.batch.attention_mask[:, shaped.batch.prompt_len :].sum(-1)  # [N] tokens incl. EOS
    penalty = overlong_penalty(lengths, max_len=6, buffer=4, penalty=0.25)
    assert torch.equal(shaped.batch.input_ids, unshaped.batch.input_ids)  # same samples
    assert torch.allclose(shaped.batch.rewards, unshaped.batch.rewards + penalty)
    assert shaped.stats["rollout/overlong_penalty"] == pytest.approx(float(penalty.mean()))
    assert (penalty < 0).any()  # the tiny model's answers reach the buffer
    assert "rollout/overlong_penalty" not in unshaped.stats


# ---- masked importance sampling ---------------------------------------------------------------------
def test_token_and_sequence_masks_by_hand():
    """Ratios exp(log_ratio): row 0 [1, 3, 0.4] (mean log ratio (log 3 + log 0.4)/3 = 0.06: ratio 1.06),
    row 1 [2.5, 2.5, pad]: geometric mean 2.5."""
    log_ratio = torch.log(torch.tensor([[1.0, 3.0, 0.4], [2.5, 2.5, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    log_ratio = torch.where(mask.bool(), log_ratio, 0.0)
    token = sampler_ratio_mask(log_ratio, mask, mode="token_mask", low=0.5, high=2.0)
    assert token.tolist() == [[True, False, False], [False, False, False]]
    seq = sampler_ratio_mask(log_ratio, mask, mode="sequence_mask", low=0.5, high=2.0)
    assert seq.tolist() == [[True, True, True], [False, False, False]]
    wide = sampler_ratio_mask(log_ratio, mask, mode="sequence_mask", low=0.0, high=3.0)
    assert wide.tolist() == [[True, True, True], [True, True, False]]  # padding never kept
    huge = sampler_ratio_mask(
        torch.tensor([[1e4, 0.0]]), torch.ones(1, 2), mode="token_mask", low=0.5, high=2
    )
    assert huge.tolist() == [[False, True]]  # compared in log space: no overflow


def _batch(sampler_logprobs: torch.Tensor, advantages: torch.Tensor) -> RolloutBatch:
    n, c = sampler_logprobs.shape
    return RolloutBatch(
        input_ids=torch.zeros(n, c + 1, dtype=torch.long),
        attention_mask=torch.ones(n, c + 1, dtype=torch.long),
        completion_mask=torch.ones(n, c),
        sampler_logprobs=sampler_logprobs,
        rewards=torch.zeros(n),
        samples_per_prompt=n,
        prompt_len=1,
        advantages=advantages,
    )


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_a_masked_token_has_exactly_zero_gradient_and_the_others_are_unchanged(mode):
    """Trainer log-probs log 0.5; the sampler's differ by a per-token offset. Masked tokens: gradient
    exactly 0; kept tokens: the gradient of the plain loss (truncate mode, no cap), bit for bit; the
    normaliser is unchanged (num_seqs)."""
    logp = torch.log(torch.full((2, 3), 0.5)).requires_grad_()
    offsets = torch.tensor([[0.0, math.log(3.0), 0.1], [math.log(2.5), math.log(2.5), math.log(2.5)]])
    batch = _batch(logp.detach() - offsets, torch.tensor([1.5, -2.0]))  # ratio = exp(offset)
    masked_loss, stats = policy_loss(
        logp, batch, settings=LossSettings(is_mode=mode), num_tokens=6, num_seqs=2
    )
    plain_loss, _ = policy_loss(logp, batch, settings=LossSettings(), num_tokens=6, num_seqs=2)
    (masked,) = torch.autograd.grad(masked_loss, logp)
    (plain,) = torch.autograd.grad(plain_loss, logp)
    keep = {"token_mask": [[True, False, True], [False] * 3], "sequence_mask": [[True] * 3, [False] * 3]}[
        mode
    ]
    keep = torch.tensor(keep)
    assert torch.equal(masked[~keep], torch.zeros(int((~keep).sum())))
    assert torch.equal(masked[keep], plain[keep])
    assert plain[keep].abs().min() > 0  # -A / num_seqs: 0.75 per kept token of row 0
    assert masked[0, 0] == pytest.approx(-0.75)
    assert stats.is_masked == float((~keep).sum())
    assert stats.as_metrics()["train/is_masked_frac"] == pytest.approx(float((~keep).sum()) / 6)
    assert float(masked_loss.detach()) == pytest.approx(-1.5 * int(keep[0].sum()) * math.log(0.5) / 2)


def test_a_mask_drops_the_kl_term_too():
    """A dropped token carries no loss at all: neither the policy term nor the KL loss term."""
    logp = torch.log(torch.full((1, 2), 0.5)).requires_grad_()
    batch = _batch(logp.detach() - torch.tensor([[0.0, 5.0]]), torch.tensor([1.0]))
    batch.ref_logprobs = torch.tensor([[math.log(0.5) - 0.1, math.log(0.5) - 3.0]])
    loss, stats = policy_loss(logp, batch, settings=LossSettings(is_mode="token_mask"), num_tokens=2,
                              num_seqs=1, kl_coef=0.5, kl_estimator="k2")  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 1] == 0.0 and grad[0, 0] == pytest.approx(-1.0 + 0.5 * 0.1)
    assert float(loss) == pytest.approx(-math.log(0.5) + 0.5 * 0.01 / 2)  # token 0: policy + KL terms
    assert stats.is_masked == 1.0


def test_the_default_truncate_mode_logs_no_mask():
    logp = torch.log(torch.full((1, 2), 0.5)).requires_grad_()
    _, stats = policy_loss(logp, _batch(logp.detach() - 3.0, torch.tensor([1.0])), settings=LossSettings(),
                           num_tokens=2, num_seqs=1)  # fmt: skip
    assert stats.is_masked is None and "train/is_masked_frac" not in stats.as_metrics()

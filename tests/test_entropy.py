"""Entropy as something to train: the bonus `loss.entropy_coef` (its gradient against autograd over
the whole logits), the adaptive coefficient `loss.entropy_target` (Skywork-OR1's rule, as TRL applies
it), `loss.top_entropy_quantile`, their one-line errors and a short run that logs and resumes the
coefficient. The chunked head's entropy gradient: tests/test_head_logprobs.py."""

from __future__ import annotations

import json

import pytest
import torch

from loorl.algo.entropy import EntropyCoefficient, top_entropy_mask
from loorl.algo.logprobs import token_entropy, token_logprobs
from loorl.algo.objectives import policy_loss
from loorl.cli.train import train
from loorl.config import check_config
from loorl.errors import ConfigError
from loorl.settings.training import LossSettings
from loorl.types import RolloutBatch


def batch_of(adv, mask) -> RolloutBatch:
    n, c = mask.shape
    return RolloutBatch(
        input_ids=torch.zeros(n, c, dtype=torch.long), attention_mask=torch.ones(n, c), completion_mask=mask,
        sampler_logprobs=torch.zeros(n, c, dtype=torch.float64), rewards=torch.zeros(n), samples_per_prompt=1,
        prompt_len=0, advantages=adv,
    )  # fmt: skip


def _logits(seed=0, n=3, c=4, v=6):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, c, v, generator=g, dtype=torch.float64) * 2).requires_grad_(True)  # [n, C, V]
    tokens = torch.randint(v, (n, c), generator=g)  # [n, C]
    mask = (torch.arange(c)[None, :] < torch.tensor([4, 2, 3])[:, None]).double()  # [n, C]
    return logits, tokens, mask


def test_the_entropy_bonus_is_minus_coef_times_the_mean_token_entropy_with_its_gradient():
    logits, tokens, mask = _logits()
    adv = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    logp, entropy = token_logprobs(logits, tokens), token_entropy(logits, tokens=tokens)  # [n, C] each
    s = LossSettings(name="reinforce", entropy_coef=0.3)
    loss, stats = policy_loss(
        logp, batch_of(adv, mask), settings=s, num_tokens=9.0, num_seqs=3, entropy=entropy, entropy_coef=0.3
    )
    (grad,) = torch.autograd.grad(loss, logits)
    # by hand: REINFORCE's seq-mean-token-sum loss, minus 0.3 * (sum of the real tokens' entropies) / 9
    real = mask.bool()
    logp2, h2 = token_logprobs(logits, tokens), token_entropy(logits, tokens=tokens)
    want = (torch.where(real, -adv[:, None] * logp2, 0.0)).sum() / 3 - 0.3 * torch.where(
        real, h2, 0.0
    ).sum() / 9
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert stats.loss == pytest.approx(float(want))
    # the bonus raises the entropy: a step along -grad of the bonus alone increases the mean entropy
    (bonus_grad,) = torch.autograd.grad(
        -torch.where(real, token_entropy(logits, tokens=tokens), 0.0).sum(), logits
    )
    after = token_entropy(logits.detach() - 0.1 * bonus_grad, tokens=tokens)
    assert float(torch.where(real, after, 0.0).sum()) > float(torch.where(real, h2, 0.0).sum())


def test_an_entropy_bonus_without_the_entropy_gradient_is_refused():
    logits, tokens, mask = _logits()
    logp = token_logprobs(logits, tokens)
    with torch.no_grad():
        entropy = token_entropy(logits, tokens=tokens)
    s = LossSettings(name="reinforce", entropy_coef=0.1)
    with pytest.raises(ValueError, match="entropy_grad=True"):
        policy_loss(logp, batch_of(torch.ones(3), mask), settings=s, num_tokens=9.0, num_seqs=3,
                    entropy=entropy, entropy_coef=0.1)  # fmt: skip


def test_top_entropy_quantile_trains_only_the_highest_entropy_tokens():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.7, 0.2, 9.0, 9.0]])  # the 9.0 are padding
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    # 6 real tokens; the 0.5 quantile of {0.1, 0.2, 0.3, 0.5, 0.7, 0.9} is 0.4 (linear): 0.5, 0.7, 0.9 kept
    assert top_entropy_mask(entropy, mask, 0.5).tolist() == [
        [False, True, True, False],
        [True, False, False, False],
    ]
    assert top_entropy_mask(entropy, mask, 1.0).tolist() == mask.bool().tolist()
    assert not top_entropy_mask(entropy, torch.zeros_like(mask), 0.2).any()
    logp = torch.full((2, 4), -1.0, requires_grad=True)
    s = LossSettings(name="reinforce", top_entropy_quantile=0.5)
    loss, stats = policy_loss(logp, batch_of(torch.ones(2), mask), settings=s, num_tokens=6.0, num_seqs=2,
                              entropy=entropy)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)
    assert (grad != 0).tolist() == [[False, True, True, False], [True, False, False, False]]
    assert stats.entropy_masked == 3.0 and stats.as_metrics()["train/entropy_masked_frac"] == 0.5


def test_the_adaptive_coefficient_follows_skywork_or1s_rule():
    """TRL's rule (`GRPOTrainer._compute_loss`, inline there): up by delta after a step at or below
    the target, down above it, within the bounds; applied only while the last step was at or below."""
    c = EntropyCoefficient(coef=0.01, target=0.5, delta=0.02, low=0.0, high=0.04)
    assert c.value == 0.0 and c.needs_gradient  # before any step: no entropy measured, no bonus (TRL: inf)
    seen = []
    for h in (0.4, 0.4, 0.3, 0.6, 0.6, 0.6, 0.5):
        c.update(h)
        seen.append((round(c.coef, 6), c.value))
    assert seen == [
        (0.03, 0.03),
        (0.04, 0.04),
        (0.04, 0.04),
        (0.02, 0.0),
        (0.0, 0.0),
        (0.0, 0.0),
        (0.02, 0.02),
    ]
    again = EntropyCoefficient(coef=0.01, target=0.5, delta=0.02, low=0.0, high=0.04)
    again.load_state_dict(json.loads(json.dumps(c.state_dict())))  # what a checkpoint keeps
    assert (again.coef, again.value) == (c.coef, c.value)
    fixed = EntropyCoefficient(coef=0.2)
    fixed.update(0.01)
    assert fixed.value == 0.2 and fixed.needs_gradient and not EntropyCoefficient().needs_gradient


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("loss.entropy_target=0.3 loss.entropy_coef_max=0", "no entropy gradient is ever trained"),
        ("loss.entropy_target=0.3 loss.entropy_coef=2.0", "start the adaptive coefficient within its bounds"),
        ("loss.top_entropy_quantile=0", "loss.top_entropy_quantile=0: input should be greater than 0"),
        (
            "loss.top_entropy_quantile=1.5",
            "loss.top_entropy_quantile=1.5: input should be less than or equal to 1",
        ),
    ],
)
def test_bad_entropy_settings_are_one_line_before_any_model_loads(quick_cfg, override, message):
    with pytest.raises(ConfigError, match=message):
        check_config(quick_cfg(*override.split()))


def test_a_run_with_an_entropy_target_logs_and_checkpoints_its_coefficient(quick_config, tmp_path):
    """Two RL steps with the entropy gradient on (the chunked head's) and a target above the tiny
    model's entropy: the coefficient rises by delta after each optimizer step and is in the checkpoint."""
    cfg = quick_config(
        "rl.steps=2", "val_every=2", "val_pass_k=0", "checkpoint_every=2", "export_policy=false",
        "loss.entropy_coef=0.01", "loss.entropy_target=50.0", "loss.entropy_coef_delta=0.02",
        output_dir=tmp_path / "run",
    )  # fmt: skip
    train(cfg)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    coefs = [value for _, value in metrics["history"]["train/entropy_coef"]]
    assert coefs == pytest.approx([0.03, 0.05])  # one optimizer step per RL step, each below the target
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["entropy_coef"]["coef"] == pytest.approx(0.05) and ckpt["entropy_coef"]["last_entropy"] < 50

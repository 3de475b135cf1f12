"""RL-ZVP (`loss.zvp_alpha`, `estimator=rl_zvp`, arXiv 2509.21880): which groups have no reward spread and
which way they point, the entropy-shaped token advantages by hand, their gradient through the loss
against autograd on a hand-written objective, the rows with spread left exactly as they were, per-token
advantages through the clipped surrogate against a loop, the backward skip keeping the shaped groups,
the config's one-line errors, and a short run that logs the shaping."""

from __future__ import annotations

import json
import math

import pytest
import torch

from loorl.algo.estimator_registry import AdvantageInput
from loorl.algo.estimators import compute_advantages
from loorl.algo.logprobs import token_entropy, token_logprobs
from loorl.algo.objectives import policy_loss
from loorl.algo.zero_variance import zero_variance_signs, zvp_token_advantages
from loorl.cli.train import train
from loorl.config import check_config
from loorl.errors import ConfigError
from loorl.settings.training import LossSettings
from loorl.types import RolloutBatch

NAN = math.nan


def test_signs_by_hand():
    rewards = torch.tensor(
        [[0.0, 1, 0, 1], [2, 2, 2, 2], [1, 1, 1, 1], [1, NAN, 1, 1], [0, 0, 0, 0], [0.5, NAN, NAN, NAN]]
    )
    verdicts = torch.tensor(
        [[0.0, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [1, NAN, 1, 1], [NAN] * 4, [1, NAN, NAN, NAN]]
    )
    assert zero_variance_signs(rewards, verdicts).tolist() == [
        [0, 0, 0, 0],  # spread: the estimator's advantages stand
        [1, 1, 1, 1],  # all right (an offset reward of 2)
        [-1, -1, -1, -1],  # all wrong, though rewarded 1 (the verdicts decide, not the reward's sign)
        [1, 0, 1, 1],  # the unscorable sample gets nothing; its siblings agree
        [-1, -1, -1, -1],  # no verdicts: a common reward of 0 is wrong
        [0, 0, 0, 0],  # one scorable sample: no group to speak of
    ]
    # without verdicts (a reward model): the common reward's sign
    assert zero_variance_signs(torch.tensor([[0.3, 0.3], [-1.0, -1.0], [0.0, 0.0]])).tolist() == [
        [1, 1],
        [-1, -1],
        [-1, -1],
    ]
    # mixed verdicts under one reward point nowhere; a missing sample (uneven groups) is left out
    assert zero_variance_signs(torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]])).tolist() == [[0, 0]]
    uneven = AdvantageInput(rewards=torch.tensor([[1.0, 1.0, 0.0]]), mask=torch.tensor([[True, True, False]]))
    assert zero_variance_signs(uneven).tolist() == [[1, 1, 0]]


def test_token_advantages_by_hand():
    """The paper's equation 5 on a NeMo-RL patch's example (alpha 0.1): all right alpha * H, all wrong
    -alpha * (max H - H); the padding's entropy (9.0) never reaches the maximum."""
    entropy = torch.tensor([[0.2, 0.8, 9.0], [0.5, 0.7, 9.0], [0.3, 0.6, 0.4], [0.1, 0.2, 9.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([0.0, 0.0, 0.0, -0.75])
    signs = torch.tensor([1.0, -1.0, -1.0, 0.0])
    got = zvp_token_advantages(advantages, signs, entropy, mask, alpha=0.1)
    want = torch.tensor([[0.02, 0.08, 0.0], [-0.02, 0.0, 0.0], [-0.03, 0.0, -0.02], [-0.75, -0.75, 0.0]])
    torch.testing.assert_close(got, want)


def _batch(rewards, mask, signs, *, advantages=None, old=None):
    n, c = mask.shape
    adv = compute_advantages("grpo", rewards.view(-1, 4)).reshape(-1) if advantages is None else advantages
    return RolloutBatch(
        input_ids=torch.zeros(n, c, dtype=torch.long), attention_mask=torch.ones(n, c), completion_mask=mask,
        sampler_logprobs=torch.zeros(n, c, dtype=torch.float64), rewards=rewards, samples_per_prompt=4,
        prompt_len=0, advantages=adv, old_logprobs=old, zero_variance_sign=signs,
    )  # fmt: skip


def _case(seed=0):
    """Three groups of 4: with spread, all right, all wrong; 5 positions, uneven lengths."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(12, 5, 7, generator=g, dtype=torch.float64) * 2).requires_grad_(True)  # [N, C, V]
    tokens = torch.randint(7, (12, 5), generator=g)  # [N, C]
    lengths = torch.randint(2, 6, (12,), generator=g)
    mask = (torch.arange(5)[None, :] < lengths[:, None]).double()  # [N, C]
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0])
    signs = zero_variance_signs(rewards.view(3, 4)).reshape(-1)  # [N]
    return logits, tokens, mask, rewards, signs


def test_the_gradient_is_that_of_the_shaped_objective():
    """REINFORCE with seq-mean-token-sum: the loss and its gradient equal, by autograd on a hand-written
    objective, -(1/N) sum_i sum_t A_it log pi_it with A_it GRPO's on the group with spread and the
    entropy-shaped one (the entropy held constant) on the others."""
    logits, tokens, mask, rewards, signs = _case()
    logp, entropy = token_logprobs(logits, tokens), token_entropy(logits, tokens=tokens)  # [N, C] each
    batch = _batch(rewards, mask, signs)
    s = LossSettings(name="reinforce", zvp_alpha=0.1)
    loss, stats = policy_loss(
        logp, batch, settings=s, num_tokens=float(mask.sum()), num_seqs=12, entropy=entropy
    )
    (grad,) = torch.autograd.grad(loss, logits)

    h = token_entropy(logits, tokens=tokens).detach()  # [N, C]
    adv = compute_advantages("grpo", rewards.view(3, 4)).reshape(-1)  # [N]
    want = torch.zeros((), dtype=torch.float64)
    logp2 = token_logprobs(logits, tokens)
    for i in range(12):
        real = mask[i].bool()
        h_max = h[i][real].max()
        for t in range(5):
            if not real[t]:
                continue
            a = adv[i] if i < 4 else 0.1 * h[i, t] if i < 8 else -0.1 * (h_max - h[i, t])
            want = want - a * logp2[i, t]
    want = want / 12
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, want_grad)
    # the rows with spread keep exactly the gradient they had without RL-ZVP; the others had none
    plain, _ = policy_loss(
        token_logprobs(logits, tokens), batch, settings=LossSettings(name="reinforce"),
        num_tokens=float(mask.sum()), num_seqs=12, entropy=entropy,
    )  # fmt: skip
    (plain_grad,) = torch.autograd.grad(plain, logits)
    torch.testing.assert_close(grad[:4], plain_grad[:4])
    assert plain_grad[4:].abs().max() == 0 and grad[4:8].abs().sum() > 0 and grad[8:].abs().sum() > 0
    real = mask.bool()
    assert stats.zvp_tokens == float(real[4:].sum())
    shaped = torch.where(real[4:8], 0.1 * h[4:8], 0.0).sum() + sum(
        (-0.1 * (h[i][real[i]].max() - h[i][real[i]])).sum() for i in range(8, 12)
    )
    assert stats.zvp_advantage == pytest.approx(float(shaped))
    metrics = stats.as_metrics()
    assert metrics["train/zvp_token_frac"] == pytest.approx(float(real[4:].sum() / real.sum()))


def test_per_token_advantages_through_the_clipped_surrogate_match_a_loop():
    """Off-policy (old log-probs set): max(-A_t r_t, -A_t clip(r_t)) per token, with A_t per token."""
    logits, tokens, mask, rewards, signs = _case(seed=3)
    logp, entropy = token_logprobs(logits, tokens), token_entropy(logits, tokens=tokens)
    g = torch.Generator().manual_seed(7)
    old = logp.detach() + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64)  # [N, C]
    batch = _batch(rewards, mask, signs, old=old)
    s = LossSettings(name="clipped", zvp_alpha=0.2)
    loss, _ = policy_loss(logp, batch, settings=s, num_tokens=float(mask.sum()), num_seqs=12, entropy=entropy)
    token_adv = zvp_token_advantages(batch.advantages, signs, entropy, mask, alpha=0.2)  # [N, C]
    want = 0.0
    for i in range(12):
        for t in range(5):
            if mask[i, t]:
                r = math.exp(float(logp[i, t].detach() - old[i, t]))
                a = float(token_adv[i, t])
                want += max(-a * r, -a * min(max(r, 0.8), 1.2))
    assert float(loss) == pytest.approx(want / 12)


def test_the_backward_skip_keeps_the_groups_rl_zvp_trains_on():
    _, _, mask, rewards, signs = _case()
    batch = _batch(rewards, mask, signs)
    assert batch.groups_with_signal() == [0, 1, 2]
    off = _batch(rewards, mask, None)
    assert off.groups_with_signal() == [0]  # GRPO's advantages are 0 on the groups without spread


def test_rl_zvp_composes_and_its_errors_are_one_line(default_cfg, quick_cfg):
    cfg = default_cfg("estimator=rl_zvp")
    assert cfg.estimator.name == "rl_zvp" and cfg.loss.zvp_alpha == 0.1
    assert check_config(cfg).loss.zvp_alpha == 0.1
    assert check_config(default_cfg("loss.zvp_alpha=0.05")).estimator.name == "rloo"  # any estimator
    with pytest.raises(ConfigError, match="estimator.name=rl_zvp with loss.zvp_alpha=null"):
        check_config(quick_cfg("estimator=rl_zvp", "loss.zvp_alpha=null"))
    with pytest.raises(ConfigError, match="dynamic sampling sets aside the groups"):
        check_config(quick_cfg("estimator=rl_zvp", "rl.dynamic_sampling.enabled=true"))
    with pytest.raises(ConfigError, match="loss.zvp_alpha=0: input should be greater than 0"):
        check_config(quick_cfg("loss.zvp_alpha=0"))


def test_a_run_with_rl_zvp_trains_the_groups_without_spread(quick_config, tmp_path):
    """Two RL steps of the tiny model under estimator=rl_zvp: some tokens are shaped at each step (its
    groups are all right or all wrong often), and the loss's counts log them."""
    cfg = quick_config(
        "estimator=rl_zvp", "rl.steps=2", "val_every=2", "val_pass_k=0", "checkpoint_every=0",
        "export_policy=false", output_dir=tmp_path / "run",
    )  # fmt: skip
    train(cfg)
    history = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"]
    zero_std = [v for _, v in history["rollout/zero_std_group_frac"]]
    shaped = [v for _, v in history["train/zvp_token_frac"]]
    assert len(shaped) == 2
    for groups, tokens in zip(zero_std, shaped):
        assert (tokens > 0) == (groups > 0)  # tokens are shaped exactly when some group had no spread
    assert any(v > 0 for v in shaped)

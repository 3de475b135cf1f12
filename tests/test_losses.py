"""Per-token losses, aggregation, KL estimators and controllers."""

from __future__ import annotations

import math

import pytest
import torch

from loorl.algo.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_per_token
from loorl.algo.logprobs import token_entropy, token_logprobs
from loorl.algo.objectives import AGGREGATIONS, aggregate, clipped_surrogate_token_loss, reinforce_token_loss

NAN = float("nan")


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- token_logprobs / token_entropy ------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk_size", [8, 2, 1])
def test_token_logprobs_match_log_softmax_gather(temperature, chunk_size):
    logits = torch.randn(5, 4, 11, generator=gen(0)) * 3  # [N, T, V]
    tokens = torch.randint(0, 11, (5, 4), generator=gen(1))  # [N, T]
    logp_all = torch.log_softmax(logits.double() / temperature, -1)  # [N, T, V]
    expected = logp_all.gather(-1, tokens[..., None])[..., 0]  # [N, T]
    got = token_logprobs(logits, tokens, temperature=temperature, chunk_size=chunk_size)  # [N, T]
    assert got.shape == (5, 4) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_token_logprobs_gradient_matches_log_softmax_and_bf16_is_upcast():
    logits = torch.randn(3, 4, 7, generator=gen(2), dtype=torch.float64, requires_grad=True)  # [N, T, V]
    tokens = torch.randint(0, 7, (3, 4), generator=gen(3))  # [N, T]
    w = torch.randn(3, 4, generator=gen(4), dtype=torch.float64)  # [N, T]
    (g1,) = torch.autograd.grad(
        (token_logprobs(logits, tokens, temperature=0.8, chunk_size=2) * w).sum(), logits
    )
    ref = torch.log_softmax(logits / 0.8, -1).gather(-1, tokens[..., None])[..., 0]  # [N, T]
    (g2,) = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(g1, g2)
    out = token_logprobs(logits.detach().bfloat16(), tokens)  # [N, T]
    assert out.dtype == torch.float32 and (out <= 0).all()


def test_token_logprobs_rejects_bad_temperature():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), temperature=0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_token_entropy_matches_formula(temperature):
    logits = torch.randn(5, 3, 9, generator=gen(5)) * 2  # [N, T, V]
    p = torch.softmax(logits.double() / temperature, -1)  # [N, T, V]
    expected = -(p * p.log()).sum(-1)  # [N, T]
    with torch.no_grad():
        got = token_entropy(logits, temperature=temperature, chunk_size=2)  # [N, T]
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_token_entropy_uniform_and_masked_vocab():
    logits = torch.zeros(2, 3, 8)  # [N, T, V]
    torch.testing.assert_close(token_entropy(logits), torch.full((2, 3), math.log(8)))
    logits[..., 4:] = -math.inf  # half the vocabulary forbidden: uniform over 4
    torch.testing.assert_close(token_entropy(logits), torch.full((2, 3), math.log(4)))


# ---- aggregation -------------------------------------------------------------------------------
LOSS = torch.tensor([[1.0, 2.0, NAN], [4.0, 5.0, 6.0]])  # [2, 3]; NaN on padding must not leak
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # [2, 3]


def test_aggregation_by_hand():
    # masked row sums 3 and 4, 3 tokens, 2 sequences, T = 3
    torch.testing.assert_close(aggregate(LOSS, MASK, mode="token-mean"), torch.tensor(7 / 3))
    torch.testing.assert_close(aggregate(LOSS, MASK, mode="seq-mean-token-sum"), torch.tensor(3.5))
    torch.testing.assert_close(
        aggregate(LOSS, MASK, mode="seq-mean-token-mean"), torch.tensor((3 / 2 + 4 / 1) / 2)
    )
    torch.testing.assert_close(aggregate(LOSS, MASK, mode="seq-mean-token-sum-norm"), torch.tensor(7 / 6))
    torch.testing.assert_close(
        aggregate(LOSS, MASK, mode="seq-mean-token-sum-norm", max_len=4), torch.tensor(7 / 8)
    )
    torch.testing.assert_close(aggregate(LOSS, MASK, mode="token-mean", num_tokens=10), torch.tensor(0.7))
    torch.testing.assert_close(
        aggregate(LOSS, MASK, mode="seq-mean-token-sum", num_seqs=7), torch.tensor(1.0)
    )


def test_aggregation_empty_sequence_and_unknown_mode():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # [2, 3]
    torch.testing.assert_close(aggregate(LOSS, mask, mode="seq-mean-token-mean"), torch.tensor(1.5 / 2))
    assert aggregate(LOSS, torch.zeros(2, 3), mode="token-mean") == 0
    with pytest.raises(ValueError, match=r"loss\.agg.*token-mean, seq-mean-token-sum"):
        aggregate(LOSS, MASK, mode="sum")


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_microbatch_sum_equals_full_batch(mode):
    N, T = 7, 6
    loss = torch.randn(N, T, generator=gen(6))  # [N, T]
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 4])  # [N]
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # [N, T]
    full = aggregate(loss, mask, mode=mode, max_len=8)
    counts = dict(num_tokens=float(mask.sum()), num_seqs=N, max_len=8)
    splits = [(0, 2), (2, 5), (5, 7)]
    parts = [aggregate(loss[a:b], mask[a:b], mode=mode, **counts) for a, b in splits]
    torch.testing.assert_close(sum(parts), full)
    # the local normalisers would not add up (so the global ones are what makes it work)
    local = sum(aggregate(loss[a:b], mask[a:b], mode=mode, max_len=8) for a, b in splits)
    assert not torch.allclose(local, full)


# ---- policy losses -----------------------------------------------------------------------------
def test_reinforce_token_loss_values_and_detached_advantages():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)  # [N, T]
    adv = torch.tensor([2.0, -1.0], requires_grad=True)  # [N]
    loss = reinforce_token_loss(logp, adv)  # [N, T]
    torch.testing.assert_close(loss, torch.tensor([[2.0, 4.0], [-0.5, -0.1]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -2.0], [1.0, 1.0]]))
    assert adv.grad is None  # the advantage is a constant of the loss


def test_clipped_surrogate_by_hand():
    # ratios 1.5 (above 1.2) and 0.5 (below 0.8), each with A = +1 and A = -1
    logp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]])).requires_grad_()  # [4, 1]
    old = torch.zeros(4, 1)  # [4, 1]
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])  # [4]
    mask = torch.ones(4, 1)  # [4, 1]
    loss, clipped = clipped_surrogate_token_loss(logp, old, adv, mask)
    # A>0, r=1.5: max(-1.5, -1.2) = -1.2 clipped; A<0, r=1.5: max(1.5, 1.2) = 1.5
    # A>0, r=0.5: max(-0.5, -0.8) = -0.5;        A<0, r=0.5: max(0.5, 0.8) = 0.8 clipped
    torch.testing.assert_close(loss, torch.tensor([[-1.2], [1.5], [-0.5], [0.8]]))
    assert clipped[:, 0].tolist() == [True, False, False, True]
    loss.sum().backward()
    # d(-A r)/dlogp = -A r on unclipped tokens, 0 on clipped ones
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0], [1.5], [-0.5], [0.0]]))
    # asymmetric (DAPO clip-higher) bounds
    loss, _ = clipped_surrogate_token_loss(logp.detach(), old, adv, mask, clip_low=0.1, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.28], [1.5], [-0.5], [0.9]]))


def test_clipped_surrogate_mask_and_unknown_ratio_level():
    logp = torch.log(torch.tensor([[1.5, 1.5]]))  # [1, 2]
    _, clipped = clipped_surrogate_token_loss(
        logp, torch.zeros(1, 2), torch.ones(1), torch.tensor([[1.0, 0.0]])
    )
    assert clipped.tolist() == [[True, False]]  # padding is never counted as clipped
    with pytest.raises(ValueError, match=r"loss\.ratio_level"):
        clipped_surrogate_token_loss(logp, logp, torch.ones(1), torch.ones(1, 2), ratio_level="seq")


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_ratio_one_has_the_reinforce_gradient(ratio_level):
    logits = torch.randn(4, 5, 6, generator=gen(7), requires_grad=True)  # [N, T, V]
    tokens = torch.randint(0, 6, (4, 5), generator=gen(8))  # [N, T]
    mask = torch.ones(4, 5)  # [N, T]
    mask[1, 3:] = 0
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0])  # [N]
    grads = []
    for surrogate in (False, True):
        logp = token_logprobs(logits, tokens)  # [N, T]
        if surrogate:
            tok, clipped = clipped_surrogate_token_loss(
                logp, logp.detach(), adv, mask, ratio_level=ratio_level
            )
            assert not clipped.any()
        else:
            tok = reinforce_token_loss(logp, adv)  # [N, T]
        (g,) = torch.autograd.grad(aggregate(tok, mask, mode="seq-mean-token-sum"), logits)
        grads.append(g)
    # sequence level: L_i tokens share -A * ratio, and d ratio / d logp_it = 1 / L_i, so the same gradient
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0].abs().sum() > 0


def test_sequence_level_ratio_by_hand():
    old = torch.zeros(2, 3)  # [N, T]
    logp = torch.tensor([[0.2, 0.4, 5.0], [-0.1, -0.1, -0.1]], requires_grad=True)  # [N, T]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # [N, T]
    adv = torch.ones(2)  # [N]
    loss, clipped = clipped_surrogate_token_loss(logp, old, adv, mask, ratio_level="sequence")
    # seq 0: mean log-ratio over real tokens (0.2 + 0.4) / 2 = 0.3, ratio e^0.3 = 1.35 > 1.2: clipped to -1.2
    # seq 1: ratio e^-0.1 = 0.905, inside the clip range: -0.905 on every token
    torch.testing.assert_close(loss[0, :2], torch.tensor([-1.2, -1.2]))
    torch.testing.assert_close(loss[1], torch.full((3,), -math.exp(-0.1)))
    assert clipped.tolist() == [[True, True, False], [False, False, False]]
    (loss * mask).sum().backward()
    # seq 1: three tokens each d(-ratio)/dlogp_s = -ratio / 3, summed over the three tokens
    torch.testing.assert_close(logp.grad[1], torch.full((3,), -math.exp(-0.1)))
    torch.testing.assert_close(logp.grad[0], torch.zeros(3))


def test_extreme_log_ratio_stays_finite():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)  # [1, 2]
    old = torch.tensor([[-500.0, 0.0]])  # [1, 2]
    loss, _ = clipped_surrogate_token_loss(logp, old, -torch.ones(1), torch.ones(1, 2))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()


# ---- gradient of the full pipeline against a hand-built policy-gradient estimate ---------------
class ToyLM(torch.nn.Module):
    """Embedding -> tanh -> Linear: logits for the next token from the current one."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(ids)))  # [N, T, V]


@pytest.mark.parametrize(("mode", "temperature"), [("seq-mean-token-sum", 1.0), ("token-mean", 0.7)])
def test_loss_gradient_equals_policy_gradient_estimate(mode, temperature):
    torch.manual_seed(0)
    V, N, T = 13, 5, 6
    model = ToyLM(V, 8).double()
    params = list(model.parameters())
    seqs = torch.randint(0, V, (N, T + 1), generator=gen(9))  # [N, T+1] prompt token + completion
    inputs, targets = seqs[:, :-1], seqs[:, 1:]  # [N, T], [N, T]
    lengths = torch.tensor([6, 2, 4, 1, 5])  # [N]
    mask = (torch.arange(T)[None] < lengths[:, None]).double()  # [N, T]
    adv = torch.tensor([1.5, -0.5, 0.0, 2.0, -1.0], dtype=torch.float64)  # [N]

    logp = token_logprobs(model(inputs), targets, temperature=temperature, chunk_size=2)  # [N, T]
    loss = aggregate(reinforce_token_loss(logp, adv), mask, mode=mode)
    auto = torch.autograd.grad(loss, params)

    # hand-built: -1/norm * sum_i A_i * grad log pi(y_i | x), one sequence at a time,
    # with log pi computed independently (log_softmax of that sequence alone)
    norm = N if mode == "seq-mean-token-sum" else float(lengths.sum())
    manual = [torch.zeros_like(p) for p in params]
    for i in range(N):
        logits_i = model(inputs[i : i + 1]) / temperature  # [1, T, V]
        tok_logp = torch.log_softmax(logits_i, -1)[0, torch.arange(T), targets[i]]  # [T]
        seq_logp = (tok_logp * mask[i]).sum()
        grads_i = torch.autograd.grad(seq_logp, params)
        for m, g in zip(manual, grads_i, strict=True):
            m -= adv[i] * g / norm
    for a, m in zip(auto, manual, strict=True):
        assert torch.allclose(a, m, rtol=1e-10, atol=1e-12)
    assert any(m.abs().sum() > 0 for m in manual)


# ---- KL ----------------------------------------------------------------------------------------
def test_kl_estimators_match_definitions():
    logp = torch.randn(4, 5, generator=gen(10)) - 2  # [N, T]
    ref = torch.randn(4, 5, generator=gen(11)) - 2  # [N, T]
    d = logp - ref  # [N, T]
    torch.testing.assert_close(kl_per_token(logp, ref, estimator="k1"), d)
    torch.testing.assert_close(kl_per_token(logp, ref, estimator="k2"), 0.5 * d**2)
    torch.testing.assert_close(
        kl_per_token(logp, ref, estimator="k3"), torch.exp(ref - logp) - 1 - (ref - logp)
    )
    assert (kl_per_token(logp, ref, estimator="k3") >= 0).all()
    assert (kl_per_token(logp, logp, estimator="k3") == 0).all()
    assert KL_ESTIMATORS == ("k1", "k2", "k3")
    for bad in ("k4", "abs"):
        with pytest.raises(ValueError, match=r"kl\.estimator"):
            kl_per_token(logp, ref, estimator=bad)


def test_k1_and_k3_are_unbiased_for_samples_from_pi():
    g = gen(12)
    pi = torch.log_softmax(torch.randn(6, generator=g), -1)  # [V]
    ref = torch.log_softmax(torch.randn(6, generator=g), -1)  # [V]
    exact = float((pi.exp() * (pi - ref)).sum())
    x = torch.multinomial(pi.exp(), 200_000, replacement=True, generator=g)  # [S]
    for est in ("k1", "k3"):
        estimate = float(kl_per_token(pi[x], ref[x], estimator=est).mean())
        assert abs(estimate - exact) < 0.02 + 0.05 * exact, (est, estimate, exact)


# ---- KL controllers ----------------------------------------------------------------------------
def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, n_steps=1000)
    assert ctl.value == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_moves_towards_target_with_clipped_error():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100)
    ctl.update(6.6, n_steps=10)  # error +0.1
    assert ctl.value == pytest.approx(0.1 * 1.01)
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100)
    ctl.update(60.0, n_steps=10)  # error 9 clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * 1.02)
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100)
    ctl.update(4.5, n_steps=10)  # error -0.25 clipped to -0.2
    assert ctl.value == pytest.approx(0.1 * 0.98)
    ctl.update(6.0, n_steps=10)  # on target: unchanged
    assert ctl.value == pytest.approx(0.1 * 0.98)


def test_adaptive_controller_state_round_trip_and_validation():
    ctl = AdaptiveKLController(0.2, target=1.0, horizon=50)
    for kl in (3.0, 0.1, 2.0):
        ctl.update(kl, n_steps=5)
    resumed = AdaptiveKLController(0.2, target=1.0, horizon=50)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == ctl.value != 0.2
    ctl.update(1.5, n_steps=5)
    resumed.update(1.5, n_steps=5)
    assert resumed.value == ctl.value
    with pytest.raises(ValueError, match=r"kl\.target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match=r"kl\.horizon"):
        AdaptiveKLController(0.1, target=1.0, horizon=0)


# ---- the pure policy loss and its statistics ---------------------------------------------------
def _micro_batch(advantages, mask, *, sampler_offset=0.0, old=None):
    from loorl.types import RolloutBatch

    n, c = mask.shape
    logp = torch.log(torch.full((n, c), 0.5))  # [n, C]
    batch = RolloutBatch(
        input_ids=torch.zeros(n, c + 1, dtype=torch.long),
        attention_mask=torch.ones(n, c + 1, dtype=torch.long),
        completion_mask=mask,
        sampler_logprobs=logp - sampler_offset,
        rewards=torch.zeros(n),
        samples_per_prompt=n,
        prompt_len=1,
        advantages=advantages,
        old_logprobs=old,
    )
    return logp.requires_grad_(), batch


def test_policy_loss_equals_hand_computed_reinforce_and_its_stats():
    from loorl.algo.objectives import policy_loss
    from loorl.settings import LossSettings

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # 3 real tokens
    logp, batch = _micro_batch(torch.tensor([2.0, -1.0]), mask, sampler_offset=0.25)
    loss, stats = policy_loss(logp, batch, settings=LossSettings(tis_cap=None), num_tokens=3, num_seqs=2)
    # seq-mean-token-sum: -(2 * 2 log .5 - 1 * log .5) / 2 = -1.5 log .5
    assert float(loss.detach()) == pytest.approx(-1.5 * math.log(0.5))
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.tolist() == [[-1.0, -1.0, 0.0], [0.5, 0.0, 0.0]]  # -A_i / num_seqs on real tokens
    assert (stats.tokens, stats.clipped, stats.tis_weight, stats.kl) == (3.0, 0.0, None, None)
    assert stats.log_ratio == pytest.approx(0.75) and stats.log_ratio_max == pytest.approx(0.25)
    assert stats.loss == pytest.approx(float(loss.detach()))


def test_policy_loss_tis_weight_and_kl_term():
    from loorl.algo.objectives import policy_loss
    from loorl.settings import LossSettings

    mask = torch.ones(1, 2)
    logp, batch = _micro_batch(torch.tensor([1.0]), mask, sampler_offset=math.log(3.0))
    batch.ref_logprobs = logp.detach() - 0.1  # d = 0.1 per token
    loss, stats = policy_loss(
        logp,
        batch,
        settings=LossSettings(tis_cap=2.0),
        num_tokens=2,
        num_seqs=1,
        kl_coef=0.5,
        kl_estimator="k2",
    )
    # weight min(3, 2) = 2 per token: -(2 * 2 log .5) + 0.5 * 2 * (0.1^2 / 2)
    assert float(loss.detach()) == pytest.approx(-4 * math.log(0.5) + 0.5 * 0.01)
    assert stats.tis_weight == pytest.approx(4.0) and stats.kl == pytest.approx(0.01)


def test_loss_stats_add_and_become_per_token_metrics():
    from loorl.algo.objectives import LossStats

    a = LossStats(loss=1.0, steps=1, tokens=4, entropy=2.0, log_ratio=0.4, log_ratio_max=0.3, grad_norm=2.0)
    b = LossStats(
        loss=3.0, steps=1, tokens=6, entropy=8.0, log_ratio=0.6, log_ratio_max=0.1, kl=1.2, grad_norm=4.0
    )
    total = a + b
    assert (total.tokens, total.entropy, total.log_ratio_max, total.kl) == (10, 10.0, 0.3, 1.2)
    m = total.as_metrics()
    assert m["train/loss"] == 2.0 and m["train/entropy"] == 1.0 and m["train/grad_norm"] == 3.0
    assert m["train/sampler_logratio_mean"] == pytest.approx(0.1) and m["train/kl"] == pytest.approx(0.12)
    assert "train/tis_weight_mean" not in m  # never set: not logged
    assert (LossStats() + LossStats()).as_metrics()["train/entropy"] == 0.0  # no tokens: no division by 0

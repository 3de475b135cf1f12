"""A KL term must have a KL gradient: exact expectations over every sequence, no sampling.

The enumeration (a tiny autoregressive policy with free logits, a fixed reference) lives in
scripts/research/kl_gradient_table.py, which prints the same comparison as a table.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fixtures import load_script
from loorl.algo.kl import KL_ESTIMATORS, KL_ESTIMATORS_BY_PLACEMENT, check_kl_placement, kl_per_token
from loorl.errors import ConfigError

table = load_script("research/kl_gradient_table.py")

ACCEPTED = {("k1", True), ("k2", False), ("k3", False)}
REJECTED = {(e, r) for e in ("k1", "k2", "k3") for r in (True, False)} - ACCEPTED
# (vocabulary, positions, reference seed, reference scale): near and far from the policy
NEAR, FAR = (4, 2, 1, 0.3), (4, 2, 2, 3.0)


def setting(vocab: int, length: int, ref_seed: int, ref_scale: float):
    params = [p.requires_grad_() for p in table.random_logits(0, vocab, length)]
    return params, table.perturbed(params, ref_seed, ref_scale)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", [NEAR, FAR, (4, 1, 2, 3.0), (3, 3, 5, 2.0)], ids=str)
def test_k1_in_the_reward_is_the_gradient_of_kl_pi_ref(case):
    params, ref = setting(*case)
    grad = table.penalty_gradient(params, ref, "k1", in_reward=True)
    close(grad, table.kl_gradients(params, ref)["KL(pi||ref)"])


@pytest.mark.parametrize("case", [NEAR, FAR], ids=str)
def test_k1_as_a_loss_term_has_expected_gradient_zero(case):
    params, ref = setting(*case)
    grad = table.penalty_gradient(params, ref, "k1", in_reward=False)
    torch.testing.assert_close(grad, torch.zeros_like(grad), rtol=0, atol=1e-12)


@pytest.mark.parametrize("ref_scale", [0.3, 3.0])
def test_loss_term_k2_and_k3_for_one_token(ref_scale):
    """One token given the prompt: k2 -> grad KL(pi||ref), k3 -> grad of the reverse KL(ref||pi)."""
    params, ref = setting(4, 1, 2, ref_scale)
    kls = table.kl_gradients(params, ref)
    close(table.penalty_gradient(params, ref, "k2", in_reward=False), kls["KL(pi||ref)"])
    close(table.penalty_gradient(params, ref, "k3", in_reward=False), kls["KL(ref||pi)"])


@pytest.mark.parametrize("case", [NEAR, FAR, (3, 3, 5, 2.0)], ids=str)
def test_loss_term_k2_and_k3_over_a_sequence(case):
    """Over several tokens each token's KL given its prefix: the per-token KL's gradient.

    The sequence KL's gradient has one more part, through which a token changes the later tokens'
    KL (a score-function term only a reward can carry); for KL(pi||ref) it is exactly that.
    """
    params, ref = setting(*case)
    kls = table.kl_gradients(params, ref)
    k2 = table.penalty_gradient(params, ref, "k2", in_reward=False)
    close(k2, kls["per-token KL(pi||ref)"])
    close(table.penalty_gradient(params, ref, "k3", in_reward=False), kls["per-token KL(ref||pi)"])

    seqs = table.all_sequences(params[0].shape[0], len(params))
    logp = table.token_logprobs(params, seqs)  # [N, T]
    d = (logp - table.token_logprobs(ref, seqs)).detach()  # [N, T]
    later = d.flip(-1).cumsum(-1).flip(-1) - d  # [N, T] sum_{s > t} d_s
    weight = logp.sum(-1).exp().detach()  # [N]
    future = table.flat_grad((weight * (later * logp).sum(-1)).sum(), params)
    close(k2 + future, kls["KL(pi||ref)"])


def test_refused_combinations_are_not_the_gradient_of_kl_pi_ref():
    params, ref = setting(*FAR)
    target = table.kl_gradients(params, ref)["KL(pi||ref)"]
    for estimator, in_reward in sorted(REJECTED):
        grad = table.penalty_gradient(params, ref, estimator, in_reward)
        assert table.cosine(grad, target) < 0.99, (estimator, in_reward)
        assert table.rel_error(grad, target) > 0.3, (estimator, in_reward)


def test_check_kl_placement_accepts_exactly_the_kl_gradients():
    assert KL_ESTIMATORS_BY_PLACEMENT == {"reward": ("k1",), "loss": ("k2", "k3")}
    for estimator, in_reward in itertools.product(KL_ESTIMATORS, (True, False)):
        if (estimator, in_reward) in ACCEPTED:
            check_kl_placement(estimator, in_reward)
            continue
        with pytest.raises(ConfigError) as err:
            check_kl_placement(estimator, in_reward)
        msg = str(err.value)
        assert "\n" not in msg
        assert f"kl.estimator={estimator}" in msg and f"kl.in_reward={str(in_reward).lower()}" in msg
        for alternative in ("kl.estimator=k1", "kl.estimator=k2", "kl.estimator=k3", "KL(ref||pi)"):
            assert alternative in msg


def test_table_marks_the_accepted_combinations():
    rows = table.table_rows(settings=(("far", *FAR),))
    assert {(r["estimator"], r["placement"] == "reward") for r in rows if r["accepted"]} == ACCEPTED
    for r in rows:
        if r["accepted"]:
            assert r["err_tok"] < 1e-10 if r["placement"] == "loss" else r["err_seq"] < 1e-10


def test_abs_is_refused():
    assert "abs" not in KL_ESTIMATORS
    logp = torch.zeros(2, 3)
    with pytest.raises(ConfigError, match=r"kl\.estimator='abs'.*k1, k2, k3"):
        kl_per_token(logp, logp, estimator="abs")
    for in_reward in (True, False):
        with pytest.raises(ConfigError, match=r"kl\.estimator"):
            check_kl_placement("abs", in_reward)

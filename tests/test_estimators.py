"""Advantage estimators: hand-computed values, NaN handling, and a slow loop reference. Every input
carries what any estimator may read (lengths for OPO, a greedy baseline per group for ReMax, two reward
parts for GDPO), so each parametrized test runs every registered estimator."""

from __future__ import annotations

import math

import pytest
import torch

from loorl.algo import estimator_registry, estimators
from loorl.algo.estimators import AdvantageInput, compute_advantages
from loorl.algo.masked import masked_mean, masked_std
from loorl.errors import ConfigError

NAN = float("nan")
ALL = [
    "dr_grpo",
    "gdpo",
    "gpg",
    "grpo",
    "grpo_passk",
    "opo",
    "reinforce",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rl_zvp",
    "rloo",
    "w_reinforce",
]
SEED = torch.tensor([[10.0, 5.0, 8.0, 2.0]])  # [1, 4]


def lengths_like(rewards: torch.Tensor) -> torch.Tensor:
    """Completion lengths [B, K] for OPO's weights: 1..7 tokens, fixed by the rewards' shape."""
    return (torch.arange(rewards.numel()).view(rewards.shape) * 3) % 7 + 1


def baselines_like(rewards: torch.Tensor) -> torch.Tensor:
    """A greedy completion's reward per group [B] for ReMax: 0, 1, 0.5, NaN (unscorable), repeating."""
    return torch.tensor([0.0, 1.0, 0.5, NAN])[torch.arange(rewards.shape[0]) % 4].to(rewards.dtype)


PART_WEIGHTS = torch.tensor([1.0, 0.5])  # GDPO's: the rewards, and a format reward at half weight


def parts_like(rewards: torch.Tensor) -> torch.Tensor:
    """GDPO's two reward parts [B, K, 2]: the rewards themselves and a 0/1 format reward from the
    lengths' parity (its NaN where the reward's is: one unscorable part makes the sample unscorable)."""
    fmt = (lengths_like(rewards) % 2).to(rewards.dtype)  # [B, K]
    return torch.stack([rewards, torch.where(rewards.isnan(), NAN, fmt)], dim=-1)


def with_lengths(rewards: torch.Tensor) -> AdvantageInput:
    """`rewards` with every field an estimator may read: lengths, greedy baselines, reward parts."""
    return AdvantageInput(rewards, lengths=lengths_like(rewards), baselines=baselines_like(rewards),
                          parts=parts_like(rewards), part_weights=PART_WEIGHTS)  # fmt: skip


def adv(name, rows, **kw):
    return compute_advantages(name, with_lengths(torch.tensor(rows, dtype=torch.float32)), **kw)


# ---- hand-computed values ----------------------------------------------------------------------
def test_rloo_seed_example():
    # A_1 = 10 - (5+8+2)/3 = 5; A_2 = 5 - 20/3; A_3 = 8 - 17/3; A_4 = 2 - 23/3
    a = compute_advantages("rloo", SEED)  # [1, 4]
    torch.testing.assert_close(a, torch.tensor([[5.0, -5 / 3, 7 / 3, -17 / 3]]))


def test_rloo_is_rescaled_mean_baseline_without_nan():
    r = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))  # [5, 7]
    expected = 7 / 6 * (r - r.mean(dim=1, keepdim=True))  # [5, 7]
    torch.testing.assert_close(compute_advantages("rloo", r), expected)


def test_grpo_seed_example():
    # mean 6.25, deviations [3.75, -1.25, 1.75, -4.25]; squares sum to 36.75;
    # unbiased var = 36.75 / 3 = 12.25, std = 3.5.
    a = compute_advantages("grpo", SEED, eps=0.0)  # [1, 4]
    torch.testing.assert_close(a, torch.tensor([[3.75, -1.25, 1.75, -4.25]]) / 3.5)
    torch.testing.assert_close(a[0, 2], torch.tensor(0.5))
    # eps enters the denominator
    torch.testing.assert_close(
        compute_advantages("grpo", SEED, eps=0.5), torch.tensor([[3.75, -1.25, 1.75, -4.25]]) / 4.0
    )


def test_dr_grpo_and_reinforce_seed_example():
    torch.testing.assert_close(
        compute_advantages("dr_grpo", SEED), torch.tensor([[3.75, -1.25, 1.75, -4.25]])
    )
    torch.testing.assert_close(compute_advantages("reinforce", SEED), SEED)


def test_reinforce_pp_whitens_over_whole_batch():
    # scorable {1, 2, 3}: mean 2, unbiased std 1
    torch.testing.assert_close(
        adv("reinforce_pp", [[1, 2], [3, NAN]], eps=0.0), torch.tensor([[-1.0, 0.0], [1.0, 0.0]])
    )


def test_reinforce_pp_baseline_centres_groups_then_whitens_batch():
    # group means 2 and 5 -> centred {-1, 1, 0}; the second group's lone sample has no baseline and
    # stays out of the whitening: {-1, 1} has mean 0, unbiased std sqrt(2)
    a = adv("reinforce_pp_baseline", [[1, 3], [5, NAN]], eps=0.0)
    r = 1 / math.sqrt(2)
    torch.testing.assert_close(a, torch.tensor([[-r, r], [0.0, 0.0]]))
    # two full groups: centred {-1, 1, -2, 2}, mean 0, unbiased std sqrt(10/3)
    a = adv("reinforce_pp_baseline", [[1, 3], [3, 7]], eps=0.0)
    s = math.sqrt(10 / 3)
    torch.testing.assert_close(a, torch.tensor([[-1 / s, 1 / s], [-2 / s, 2 / s]]))


def test_nan_cases_by_hand():
    row = [[1, NAN, 0, 1]]
    # rloo: 1 - (0+1)/2 = 0.5; 0 - (1+1)/2 = -1
    torch.testing.assert_close(adv("rloo", row), torch.tensor([[0.5, 0.0, -1.0, 0.5]]))
    # mean 2/3, deviations [1/3, -2/3, 1/3], unbiased var (6/9)/2 = 1/3
    std = math.sqrt(1 / 3)
    torch.testing.assert_close(
        adv("grpo", row, eps=0.0), torch.tensor([[1 / 3 / std, 0.0, -2 / 3 / std, 1 / 3 / std]])
    )
    torch.testing.assert_close(adv("dr_grpo", row), torch.tensor([[1 / 3, 0.0, -2 / 3, 1 / 3]]))
    torch.testing.assert_close(adv("reinforce", row), torch.tensor([[1.0, 0.0, 0.0, 1.0]]))


def test_opo_gpg_and_passk_by_hand():
    # OPO: lengths [1, 3, 2, 6] weight SEED [10, 5, 8, 2]: baseline (10 + 15 + 16 + 12) / 12 = 53/12
    a = compute_advantages("opo", AdvantageInput(SEED, lengths=torch.tensor([[1, 3, 2, 6]])))
    torch.testing.assert_close(a, SEED - 53 / 12)
    # equal lengths: the plain group mean, Dr. GRPO's advantage
    a = compute_advantages("opo", AdvantageInput(SEED, lengths=torch.full((1, 4), 5)))
    torch.testing.assert_close(a, compute_advantages("dr_grpo", SEED))
    # an unscorable sample's length does not weigh: [1, NaN, 0, 1] with lengths [2, 9, 1, 1]: 3/4
    a = compute_advantages(
        "opo", AdvantageInput(torch.tensor([[1.0, NAN, 0.0, 1.0]]), lengths=torch.tensor([[2, 9, 1, 1]]))
    )
    torch.testing.assert_close(a, torch.tensor([[0.25, 0.0, -0.75, 0.25]]))
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages("opo", SEED)
    # GPG: rows [1, 0, 0, 0] and [0, 0, 0, 0]: 8 scorable samples, 1 non-zero, alpha 8; group means 1/4, 0
    a = adv("gpg", [[1, 0, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(a, torch.tensor([[6.0, -2.0, -2.0, -2.0], [0.0, 0.0, 0.0, 0.0]]))
    # an unscorable sample counts in neither: 3 scorable, 2 non-zero, alpha 3/2, mean 2/3
    torch.testing.assert_close(
        adv("gpg", [[1, NAN, 0, 1]]), 1.5 * torch.tensor([[1 / 3, 0.0, -2 / 3, 1 / 3]])
    )
    # pass@k: best 10, second 8, std 3.5 (test_grpo_seed_example): (10 - 8) / 3.5 on the best only
    a = compute_advantages("grpo_passk", SEED, eps=0.0)
    torch.testing.assert_close(a, torch.tensor([[2 / 3.5, 0.0, 0.0, 0.0]]))
    # a tie at the top gives 0; an unscorable sample never ranks (NaN is not the best)
    assert (adv("grpo_passk", [[1, 1, 0, 0]]) == 0).all()
    torch.testing.assert_close(
        adv("grpo_passk", [[NAN, 1, 0, 0]], eps=0.0), torch.tensor([[0.0, 1 / math.sqrt(1 / 3), 0.0, 0.0]])
    )


def test_w_reinforce_by_hand():
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, NAN, 0.0]])  # [3, 4]
    a = compute_advantages("w_reinforce", r)  # [3, 4]
    # right +0.1, wrong -1; an all-right or all-wrong group still has advantages; unscorable 0
    expected = torch.tensor([[0.1, -1.0, 0.1, -1.0], [0.1] * 4, [-1.0, -1.0, 0.0, -1.0]])
    torch.testing.assert_close(a, expected)
    # a reward of 0.5 (a partial or format reward) lies on the same line: 0.05 - 0.5
    torch.testing.assert_close(
        compute_advantages("w_reinforce", torch.tensor([[0.5]])), torch.tensor([[-0.45]])
    )
    # positive_weight is the paper's lambda: bound through estimator.options
    bound = estimators.with_options(estimators.get("w_reinforce"), {"positive_weight": 0.5})
    torch.testing.assert_close(bound(AdvantageInput(r[:1])), torch.tensor([[0.5, -1.0, 0.5, -1.0]]))
    assert (bound.min_group_size, bound.needs) == (1, ())


def test_estimator_options_are_checked():
    assert estimators.with_options(estimators.rloo, {}) is estimators.rloo
    with pytest.raises(ConfigError) as err:
        estimators.with_options(estimators.get("w_reinforce"), {"positive_wieght": 0.5})
    assert str(err.value) == (
        "estimator.options.positive_wieght: estimator 'w_reinforce' has no such option; "
        "it takes positive_weight"
    )
    with pytest.raises(ConfigError, match="estimator 'rloo' has no such option; it takes none"):
        estimators.with_options(estimators.rloo, {"positive_weight": 0.5})


def test_remax_and_gdpo_by_hand():
    # ReMax: greedy rewards 4 and 1: A = r - r_greedy, whatever the group's spread (a uniform group too)
    rewards = torch.tensor([[10.0, 5.0], [1.0, 1.0]])  # [2, 2]
    a = compute_advantages("remax", AdvantageInput(rewards, baselines=torch.tensor([4.0, 1.0])))
    torch.testing.assert_close(a, torch.tensor([[6.0, 1.0], [0.0, 0.0]]))
    # K=1 has a baseline; an unscorable greedy completion leaves its group without one; NaN samples 0
    a = compute_advantages("remax", AdvantageInput(torch.tensor([[3.0], [2.0], [NAN]]),
                                                   baselines=torch.tensor([1.0, NAN, 0.0])))  # fmt: skip
    torch.testing.assert_close(a, torch.tensor([[2.0], [0.0], [0.0]]))
    with pytest.raises(ValueError, match="greedy completion"):
        compute_advantages("remax", SEED)
    # GDPO: correctness [1, 0, 1] and format [1, 1, 0] in group 1, [0, 0, 0] and [1, 0, 1] in group 2.
    # Each part's GRPO z-scores, mean 2/3 and std sqrt(1/3): 1/sqrt(3) for a 1, -2/sqrt(3) for the 0; a
    # uniform part gives 0. Weighted (1, 0.5): group 1 [1.5, -1.5, 0]/sqrt(3), group 2 [0.5, -1, 0.5]/sqrt(3)
    correct = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    fmt = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    parts = torch.stack([correct, fmt], dim=-1)  # [2, 3, 2]
    inp = AdvantageInput(correct + 0.5 * fmt, parts=parts, part_weights=torch.tensor([1.0, 0.5]))
    total = torch.tensor([[1.5, -1.5, 0.0], [0.5, -1.0, 0.5]])  # times 1/sqrt(3), which whitening drops
    expected = (total - total.mean()) / total.std()
    a = compute_advantages("gdpo", inp, eps=0.0)
    torch.testing.assert_close(a, expected)
    # GRPO on the sum rescales group 2's half-weight format reward alone ([0.5, 0, 0.5]: z up to 2/sqrt(3))
    # above group 1's correctness ([1.5, 0.5, 1]: z up to 1); GDPO keeps the format reward at its weight
    summed = compute_advantages("grpo", inp.rewards, eps=0.0).abs().amax(-1)  # [2]
    assert summed[1] > summed[0] and a[1].abs().max() < a[0].abs().max()
    # an unscorable part makes the sample unscorable in every part's statistics
    holed = parts.clone()
    holed[0, 2, 1] = NAN
    a = compute_advantages("gdpo", AdvantageInput(inp.rewards, parts=holed), eps=0.0)
    assert a[0, 2] == 0 and a[0, 0] > 0 > a[0, 1]  # group 1 is now [1, 0] and [1, 1]: the format gives 0
    with pytest.raises(ValueError, match="AdvantageInput.parts"):
        compute_advantages("gdpo", SEED)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("whiten", [False, True])
def test_unscorable_groups_get_zeros(name, whiten):
    rows = [[NAN, NAN, NAN], [NAN, 3.0, NAN], [1.0, 2.0, 4.0]]
    a = adv(name, rows, whiten=whiten)  # [3, 3]
    assert torch.isfinite(a).all()
    assert (a[0] == 0).all()  # all-NaN group
    assert (a[1, [0, 2]] == 0).all()  # unscorable samples are exactly 0
    if name not in ("reinforce", "reinforce_pp", "remax", "w_reinforce"):  # those have no group baseline
        assert a[1, 1] == 0  # a group with one scorable sample has no baseline
    assert (a[2] != 0).any()


@pytest.mark.parametrize("name", ALL)
def test_all_nan_batch_and_inf_rewards(name):
    assert (adv(name, [[NAN, NAN], [NAN, NAN]], whiten=True) == 0).all()
    a = adv(name, [[math.inf, 1.0, 0.0], [-math.inf, 2.0, 2.0]])
    assert torch.isfinite(a).all()
    assert a[0, 0] == 0 and a[1, 0] == 0  # non-finite rewards count as unscorable


@pytest.mark.parametrize("name", ALL)
def test_output_dtype_shape_and_input_untouched(name):
    r = torch.tensor([[1.0, NAN, 3.0]], dtype=torch.float64)  # [1, 3]
    before = r.clone()
    a = compute_advantages(name, with_lengths(r))
    assert a.dtype == torch.float32 and a.shape == r.shape
    torch.testing.assert_close(r, before, equal_nan=True)


def test_rejects_non_2d_rewards():
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        compute_advantages("rloo", torch.ones(4))


@pytest.mark.parametrize("name", ["rloo", "dr_grpo", "reinforce_pp_baseline"])
def test_whitening_leaves_out_groups_without_a_baseline(name):
    """A group with one scorable sample holds a 0 that must not shrink the batch std (was 1.049)."""
    rows = [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0], [1.0, NAN, NAN, NAN]]
    a = adv(name, rows, whiten=name != "reinforce_pp_baseline")  # [3, 4]
    with_baseline = a[:2].flatten()  # the 8 samples that have a group baseline
    assert float(with_baseline.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(with_baseline.std()) == pytest.approx(1.0, abs=1e-5)
    assert (a[2] == 0).all()


def test_whiten_gives_zero_mean_unit_std_over_scorable():
    r = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))  # [4, 6]
    r[0, 1] = r[2, 5] = NAN
    a = compute_advantages("rloo", r, whiten=True)  # [4, 6]
    ok = ~r.isnan()
    assert abs(float(a[ok].mean())) < 1e-6
    assert abs(float(a[ok].std()) - 1.0) < 1e-4
    assert a[0, 1] == 0 and a[2, 5] == 0


# ---- slow loop reference -----------------------------------------------------------------------
def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _whiten(values, eps):
    """Whiten the non-None entries of a list of lists, in place."""
    flat = [v for row in values for v in row if v is not None]
    if not flat:
        return
    m, s = _mean(flat), _std(flat)
    for row in values:
        for k, v in enumerate(row):
            if v is not None:
                row[k] = (v - m) / (s + eps)


def reference(name, rewards, *, whiten, eps):
    """Plain-loop advantages; None marks an unscorable sample until the end (then 0)."""
    rows, lengths = rewards.tolist(), lengths_like(rewards).tolist()
    greedy, parts = baselines_like(rewards).tolist(), parts_like(rewards).tolist()  # [B], [B][K][2]
    out = [[None] * len(row) for row in rows]
    too_small = [[False] * len(row) for row in rows]
    scorable_all = [v for row in rows for v in row if not math.isnan(v)]
    alpha = len(scorable_all) / max(sum(v != 0 for v in scorable_all), 1)  # GPG's
    for b, row in enumerate(rows):
        scorable = [k for k, v in enumerate(row) if not math.isnan(v)]
        vals = [row[k] for k in scorable]
        if len(vals) >= 2:
            top = sorted(vals, reverse=True)
            best = max(scorable, key=lambda k: row[k])  # pass@k credits the best sample only
        for k in scorable:
            if name in ("reinforce", "reinforce_pp"):
                out[b][k] = row[k]
            elif name == "w_reinforce":  # +0.1 for reward 1, -1 for reward 0, on that line elsewhere
                out[b][k] = 0.1 * row[k] - (1 - row[k])
            elif name == "rloo":
                others = [row[j] for j in scorable if j != k]
                out[b][k] = row[k] - _mean(others) if others else 0.0
                too_small[b][k] = not others
            elif name in ("grpo", "rl_zvp"):  # RL-ZVP's groups without spread are the loss's (0 here)
                out[b][k] = (row[k] - _mean(vals)) / (_std(vals) + eps) if len(vals) >= 2 else 0.0
                too_small[b][k] = len(vals) < 2
            elif name in ("dr_grpo", "reinforce_pp_baseline"):
                out[b][k] = row[k] - _mean(vals)
                too_small[b][k] = len(vals) < 2
            elif name == "gpg":
                out[b][k] = alpha * (row[k] - _mean(vals))
                too_small[b][k] = len(vals) < 2
            elif name == "opo":
                weight = sum(lengths[b][j] for j in scorable)
                out[b][k] = row[k] - sum(lengths[b][j] * row[j] for j in scorable) / weight
                too_small[b][k] = len(vals) < 2
            elif name == "remax":
                too_small[b][k] = math.isnan(greedy[b])
                out[b][k] = 0.0 if too_small[b][k] else row[k] - greedy[b]
            elif name == "gdpo":  # each part's GRPO over the group's scorable samples, then the weights
                too_small[b][k] = len(vals) < 2
                out[b][k] = 0.0
                for d, weight in enumerate(PART_WEIGHTS.tolist()):
                    column = [parts[b][j][d] for j in scorable]
                    if not too_small[b][k]:
                        z = (parts[b][k][d] - _mean(column)) / (_std(column) + eps)
                        out[b][k] += weight * z
            elif name == "grpo_passk":
                too_small[b][k] = len(vals) < 2
                out[b][k] = (
                    (top[0] - top[1]) / (_std(vals) + eps) if not too_small[b][k] and k == best else 0.0
                )
    # samples without a group baseline (a lone scorable sample) stay out of every whitening
    out = [[None if small else v for v, small in zip(row, smalls)] for row, smalls in zip(out, too_small)]
    if name in ("reinforce_pp", "reinforce_pp_baseline", "gdpo"):
        _whiten(out, eps)
    if whiten:
        _whiten(out, eps)
    return torch.tensor(
        [
            [0.0 if v is None or small else v for v, small in zip(row, smalls, strict=True)]
            for row, smalls in zip(out, too_small, strict=True)
        ],
        dtype=torch.float64,
    )


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("whiten", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_matches_loop_reference(name, whiten, seed):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 7, (), generator=g))
    K = int(torch.randint(2, 9, (), generator=g))
    if seed % 2:
        r = torch.randint(0, 2, (B, K), generator=g).float()  # [B, K] binary, like a verifier
    else:
        r = torch.randn(B, K, generator=g) * 3 + 1  # [B, K]
    r[torch.rand(B, K, generator=g) < 0.2] = NAN
    a = compute_advantages(name, with_lengths(r), whiten=whiten)  # [B, K]
    assert not a.isnan().any() and torch.isfinite(a).all()
    assert (a[r.isnan()] == 0).all()
    torch.testing.assert_close(a.double(), reference(name, r, whiten=whiten, eps=1e-6), rtol=1e-4, atol=1e-5)


# ---- masked statistics -------------------------------------------------------------------------
def test_masked_mean_and_std_match_torch_on_the_kept_entries():
    x = torch.tensor([[1.0, NAN, 3.0, 6.0], [NAN, NAN, 2.0, NAN], [NAN] * 4])  # [3, 4]
    mask = ~x.isnan()  # [3, 4]
    torch.testing.assert_close(masked_mean(x, mask, -1), torch.tensor([10 / 3, 2.0, 0.0]))
    torch.testing.assert_close(masked_std(x, mask, -1), torch.tensor([x[0, mask[0]].std(), 0.0, 0.0]))
    torch.testing.assert_close(masked_mean(x, mask), x[mask].mean())
    torch.testing.assert_close(masked_std(x, mask), x[mask].std())
    torch.testing.assert_close(masked_std(x, mask, unbiased=False), x[mask].std(unbiased=False))
    assert masked_mean(x, mask, 1, keepdim=True).shape == (3, 1)
    assert masked_std(x, mask, keepdim=True).shape == (1, 1)


# ---- registry ----------------------------------------------------------------------------------
def test_registry_names_and_sizes():
    assert estimators.names() == ALL
    # K=1 would give all-zero advantages
    baselines = (
        "rloo",
        "grpo",
        "dr_grpo",
        "reinforce_pp_baseline",
        "opo",
        "gpg",
        "grpo_passk",
        "gdpo",
        "rl_zvp",
    )
    assert all(estimators.min_group_size(n) == 2 for n in baselines)
    assert all(estimators.min_group_size(n) == 1 for n in ALL if n not in baselines)
    assert estimators.get("rloo") is estimators.rloo
    # what each reads beyond the rewards and lengths, which the rollout then draws or keeps
    needs = {n: estimators.needs(estimators.get(n)) for n in ALL}
    assert needs == {n: {"remax": ("baselines",), "gdpo": ("parts",)}.get(n, ()) for n in ALL}
    assert estimators.needs(lambda inp, **kw: inp.rewards) == ()  # a plug-in that does not say
    with pytest.raises(ValueError, match="needs \\['teacher'\\]"):
        estimators.register("x", needs=("teacher",))


def test_unknown_estimator_message():
    with pytest.raises(KeyError) as err:
        estimators.get("x")
    assert err.value.args[0] == (
        "unknown estimator 'x'; choose one of: "
        "dr_grpo, gdpo, gpg, grpo, grpo_passk, opo, reinforce, reinforce_pp, reinforce_pp_baseline, "
        "remax, rl_zvp, rloo, w_reinforce"
    )
    with pytest.raises(KeyError, match="unknown estimator 'y'"):
        compute_advantages("y", SEED)
    with pytest.raises(KeyError):
        estimators.min_group_size("y")


def test_register_custom_and_duplicate(monkeypatch):
    monkeypatch.setattr(estimator_registry, "_REGISTRY", dict(estimator_registry._REGISTRY))

    @estimators.register("double", min_group_size=3)
    def double(inp, *, whiten=False, eps=1e-6):  # an estimator gets an AdvantageInput
        return 2 * inp.rewards

    assert "double" in estimators.names() and estimators.min_group_size("double") == 3
    torch.testing.assert_close(compute_advantages("double", SEED), 2 * SEED)
    with pytest.raises(ValueError, match="already registered"):
        estimators.register("rloo")(double)

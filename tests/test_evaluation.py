"""pass@k and maj@k: hand-computed values and slow references."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from loorl.algo.sample_metrics import maj_at_k, majority_vote, pass_at_k


def slow_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of all k-subsets of the n samples that hold a correct one (enumerated)."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # one of four
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 0, 3, 0.0),
        (5, 5, 1, 1.0),
        (5, 3, 3, 1.0),  # only two wrong: any three hold a correct one
        (10, 2, 5, 1 - math.comb(8, 5) / math.comb(10, 5)),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, torch.tensor([c]), k).item() == pytest.approx(expected, abs=1e-7)


def test_pass_at_k_matches_enumeration():
    rng = random.Random(0)
    cases = [(n, rng.randint(0, n), rng.randint(1, n)) for n in range(1, 9) for _ in range(4)]
    got = [pass_at_k(n, torch.tensor([c]), k).item() for n, c, k in cases]
    assert got == pytest.approx([slow_pass_at_k(*case) for case in cases], abs=1e-6)


def test_pass_at_k_is_per_prompt_and_exact_for_large_n():
    out = pass_at_k(200, torch.tensor([0, 1, 100, 200]), 100)
    assert out[0] == 0 and out[3] == 1
    assert out[1].item() == pytest.approx(0.5, abs=1e-6)  # one correct of 200: half the 100-subsets hold it
    assert 0.99999 < out[2].item() <= 1.0


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, torch.tensor([1]), 5)


def test_majority_vote_ties_go_to_the_first_seen_and_none_never_wins():
    assert majority_vote(["4", "3", "3", "4"]) == 0  # a tie: "4" came first
    assert majority_vote([None, None, "7"]) == 2
    assert majority_vote([None, None]) is None
    assert majority_vote(["1", "2", "2"]) == 1


def test_maj_at_k_by_hand():
    answers = [["3", "3", "4", "4"], ["5", None, None, None], [None, None, None, None]]
    correct = torch.tensor([[1.0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert maj_at_k(answers, correct, 4).tolist() == [1.0, 0.0, 0.0]  # tie -> "3" (correct)
    assert maj_at_k(answers, correct, 2).tolist() == [0.5, 0.0, 0.0]  # chunks ("3","3") and ("4","4")
    assert maj_at_k(answers, correct, 1).tolist() == [0.5, 0.0, 0.0]  # pass@1 in expectation


def slow_maj_at_k(answers, correct, k):
    out = []
    for row, ok in zip(answers, correct.tolist()):
        scores = []
        for start in range(0, (len(row) // k) * k, k):
            chunk = row[start : start + k]
            counted = {a: chunk.count(a) for a in chunk if a is not None}
            if not counted:
                scores.append(0.0)
                continue
            best = max(counted.values())
            winner = next(a for a in chunk if counted.get(a) == best)
            scores.append(ok[start + chunk.index(winner)])
        out.append(sum(scores) / len(scores))
    return out


def test_maj_at_k_matches_a_slow_reference():
    rng = random.Random(1)
    answers = [[rng.choice(["1", "2", "3", None]) for _ in range(8)] for _ in range(20)]
    correct = torch.tensor([[float(a == "2") for a in row] for row in answers])
    for k in (1, 2, 3, 4, 8):
        assert maj_at_k(answers, correct, k).tolist() == pytest.approx(slow_maj_at_k(answers, correct, k))


def test_unscorable_samples_are_left_out_of_pass_at_k():
    """Prompt 0: 4 samples, 1 correct, 2 unscorable (NaN): pass@1 over the 2 scorable ones is 1/2, not
    the 1/4 that counting them as wrong would give. Prompt 1: fewer scorable samples than k: NaN."""
    correct = torch.tensor(
        [[1.0, float("nan"), 0.0, float("nan")], [1.0, float("nan"), float("nan"), float("nan")]]
    )
    scorable = ~correct.isnan()
    out = pass_at_k(scorable.sum(-1), correct.nansum(-1), 1)
    assert out[0].item() == pytest.approx(0.5) and out[1].item() == 1.0
    two = pass_at_k(scorable.sum(-1), correct.nansum(-1), 2)
    assert two[0].item() == 1.0 and two[1].isnan()  # 1 - C(1,2)/C(2,2); only one scorable sample
    assert pass_at_k(scorable.sum(-1), correct.nansum(-1), 1)[0] == pass_at_k(2, torch.tensor([1]), 1)[0]


def test_unscorable_samples_do_not_vote_in_maj_at_k():
    nan = float("nan")
    answers = [["9", "9", "9", "4"], ["1", "1", "2", "2"]]
    # prompt 0: the three "9"s are unscorable, so "4" (correct) wins; counted as wrong they would win
    # prompt 1: the first chunk of 2 is all unscorable (left out), the second votes "2" (wrong)
    correct = torch.tensor([[nan, nan, nan, 1.0], [nan, nan, 0.0, 0.0]])
    assert maj_at_k(answers, correct, 4).tolist() == [1.0, 0.0]
    assert maj_at_k(answers, correct, 2).tolist()[1] == 0.0
    assert maj_at_k([["1", "1"]], torch.tensor([[nan, nan]]), 2)[0].isnan()

"""The gradient-variance statistics: hand values, the Gram form against the direct one, the bootstrap."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loorl.algo import estimators
from loorl.research.grad_variance import (
    bootstrap_interval,
    gram_matrix,
    relative_variance,
    relative_variance_from_gram,
)


def test_relative_variance_by_hand():
    grads = torch.tensor([[1.0, 0.0], [3.0, 0.0]])  # mean (2, 0): ||mean||^2 = 4; tr Cov = (1 + 1) / 1
    assert relative_variance(grads) == pytest.approx(0.5)
    assert relative_variance_from_gram(gram_matrix(grads)) == pytest.approx(0.5)


def test_gram_form_matches_the_direct_one_also_on_resamples():
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(12, 500, generator=gen) + 0.3  # [R, D] a signal plus noise
    gram = gram_matrix(grads)
    assert relative_variance_from_gram(gram) == pytest.approx(relative_variance(grads), rel=1e-10)
    index = np.array([0, 0, 3, 5, 5, 5, 7, 11, 2, 9, 9, 1])  # a bootstrap draw, with repeats
    assert relative_variance_from_gram(gram, index) == pytest.approx(
        relative_variance(grads[index]), rel=1e-10
    )


def test_relative_variance_is_scale_free():
    grads = torch.randn(10, 50, generator=torch.Generator().manual_seed(1)) + 1.0
    assert relative_variance(grads * 7.5) == pytest.approx(relative_variance(grads), rel=1e-6)


def test_bootstrap_interval_brackets_the_estimate_and_narrows_with_more_repeats():
    gen = torch.Generator().manual_seed(2)
    few, many = torch.randn(10, 200, generator=gen) + 0.5, torch.randn(200, 200, generator=gen) + 0.5
    point = relative_variance(many)
    low, high = bootstrap_interval(gram_matrix(many), samples=500)
    assert low < point < high
    low_few, high_few = bootstrap_interval(gram_matrix(few), samples=500)
    assert high_few - low_few > high - low
    assert bootstrap_interval(gram_matrix(few), samples=200, seed=3) == bootstrap_interval(
        gram_matrix(few), samples=200, seed=3
    )


# ---- the probe on a real policy ------------------------------------------------------------------
# the registered estimators that read only the rewards and lengths (not ReMax's baselines, GDPO's parts)
READ_REWARDS_ONLY = {n for n in estimators.names() if not estimators.needs(estimators.get(n))}


def test_the_probe_hands_every_estimator_the_trainers_input_and_takes_a_plug_in():
    from loorl.algo.estimators import AdvantageInput, compute_advantages
    from loorl.research.probe import advantage_fns
    from loorl.settings import EstimatorSettings

    plug_in = EstimatorSettings(target="plugins.research.length_normalised_rloo")
    fns = advantage_fns(plug_in)
    assert set(fns) == {*READ_REWARDS_ONLY, "length_normalised_rloo", "batch_mean"}  # every registered one
    # whose inputs an RLOO run holds; a ReMax run draws greedy baselines, and ReMax is probed too
    assert "remax" in advantage_fns(EstimatorSettings(name="remax")) and "gdpo" not in fns
    rewards, lengths = (
        torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]),
        torch.tensor([2.0, 4.0, 1.0, 3.0, 5.0, 2.0]),
    )
    inp = AdvantageInput.of_samples(rewards, lengths, 3)  # [2, 3], as the trainer builds it
    # by hand: r / L = [0.5, 0, 1] and [1/3, 0, 0]; minus the mean of the two siblings
    expected = torch.tensor([[0.5 - 0.5, 0 - 0.75, 1 - 0.25], [1 / 3, -1 / 6, -1 / 6]])
    torch.testing.assert_close(fns["length_normalised_rloo"](inp), expected)
    torch.testing.assert_close(fns["rloo"](inp), compute_advantages("rloo", rewards.view(2, 3)))
    torch.testing.assert_close(fns["batch_mean"](inp), rewards.view(2, 3) - 0.5)
    shadowing = EstimatorSettings(target="loorl.algo.estimators.rloo")  # a plug-in named as a registered one
    assert "rloo (_target_)" in advantage_fns(shadowing)


def test_probe_shift_invariance_on_the_quick_model(model_cache, tmp_path):
    """Baselines that subtract a group or batch mean give the same gradients when every reward moves by
    a constant; REINFORCE without one does not. Measured on real rollouts of the quick tiny model, with a
    plug-in estimator (`estimator._target_`) probed beside the registered ones."""
    from loorl.research.probe import ProbeOptions, probe

    options = ProbeOptions(prompts=8, samples=4, repeats=4, bootstrap=50)
    overrides = ["debug=quick", f"model.cache_dir={model_cache}",
                 "estimator._target_=plugins.research.length_normalised_rloo"]  # fmt: skip
    results = probe(options, overrides, tmp_path, progress=False)
    assert json.loads((tmp_path / "results.json").read_text()) == results
    value = {(r["estimator"], r["shift"]): r["relative_variance"] for r in results["rows"]}
    names = {r["estimator"] for r in results["rows"]}
    assert names == {*READ_REWARDS_ONLY, "length_normalised_rloo", "batch_mean"}
    # (r + c) / L is not r / L + const; GPG's alpha counts the non-zero rewards, which a shift changes;
    # Weighted-REINFORCE's baseline is the fixed 1 / (1 + lambda), which a shift does not move
    for name in names - {"reinforce", "length_normalised_rloo", "gpg", "w_reinforce"}:
        assert value[(name, 1.0)] == pytest.approx(value[(name, 0.0)], rel=1e-3), name
    assert value[("reinforce", 1.0)] > 1.5 * value[("reinforce", 0.0)]  # the shift adds pure noise
    assert 0 < value[("length_normalised_rloo", 0.0)] < float("inf")
    for row in results["rows"]:
        low, high = row["ci95"]
        assert low <= row["relative_variance"] * 1.5 and high >= row["relative_variance"] / 1.5 and low < high
    assert "| rloo |" in (tmp_path / "table.md").read_text()


def test_the_probes_command_line_checks_its_options_in_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "research" / "grad_variance.py"
    done = subprocess.run([sys.executable, str(script), "--samples", "1"], capture_output=True, text=True)
    assert done.returncode == 2 and "--samples must be at least 2" in done.stderr.splitlines()[-1]

"""The estimator study's statistics (loorl.research.stats, study_pairing, study_report's headlines) and
what the runs log for it, by hand and against scipy. The study tool itself, its configs and a real
study are tests/test_study.py's."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loorl.research.jobs import Job
from loorl.research.stats import holm, paired_difference
from loorl.research.study import load_study
from loorl.research.study_pairing import check_pairing
from loorl.research.study_report import made_on, merge_headlines


# ---- statistics, by hand -------------------------------------------------------------------------------
def test_the_paired_interval_and_p_by_hand():
    # d = a - b = [0.1, 0.0, 0.2]: mean 0.1, sd 0.1, se 0.1/sqrt(3) = 0.057735; t(0.975, 2) = 4.302653
    # (tables): half-width 0.248414. t = 1.732051 on 2 df: the t(2) cdf is 1/2 + t / (2 sqrt(2 + t^2)),
    # so p = 1 - 1.732051 / sqrt(5) = 0.225403
    d = paired_difference([0.5, 0.6, 0.7], [0.4, 0.6, 0.5])
    assert d.n == 3 and d.mean == pytest.approx(0.1)
    assert (d.low, d.high) == (
        pytest.approx(0.1 - 0.248414, abs=1e-6),
        pytest.approx(0.1 + 0.248414, abs=1e-6),
    )
    assert d.p == pytest.approx(1 - 1.732051 / math.sqrt(5), abs=1e-6)
    assert (d.wins, d.ties, d.losses) == (2, 1, 0)


def test_the_paired_test_agrees_with_scipys_and_pairs_are_what_is_compared():
    from scipy import stats

    rng = np.random.default_rng(0)
    seed_effect = rng.normal(0, 0.2, 5)  # what a seed's warm start and prompts add to both settings
    a, b = 0.5 + seed_effect + rng.normal(0.03, 0.01, 5), 0.5 + seed_effect
    d = paired_difference(a, b)
    assert d.p == pytest.approx(stats.ttest_rel(a, b).pvalue, rel=1e-9)
    assert d.p < 0.01  # paired: the seed effect cancels
    assert stats.ttest_ind(a, b).pvalue > 0.5  # unpaired, the same numbers show nothing


def test_a_missing_seed_is_left_out_and_degenerate_cases():
    d = paired_difference([0.5, math.nan, 0.7], [0.4, 0.6, 0.6])
    assert d.n == 2 and d.mean == pytest.approx(0.1)
    one = paired_difference([0.5], [0.4])
    assert one.n == 1 and math.isnan(one.low) and math.isnan(one.p)
    same = paired_difference([0.5, 0.6], [0.4, 0.5])  # every seed +0.1: no spread
    assert (same.low, same.high, same.p) == (pytest.approx(0.1), pytest.approx(0.1), 0.0)
    with pytest.raises(ValueError, match="one per seed"):
        paired_difference([0.1, 0.2], [0.1])


def test_holm_by_hand():
    # sorted 0.01, 0.03, 0.04 (m = 3): 3 x 0.01 = 0.03, 2 x 0.03 = 0.06, max(0.06, 1 x 0.04) = 0.06
    adjusted = holm([0.01, 0.04, 0.03, math.nan])
    assert adjusted[:3] == [pytest.approx(0.03), pytest.approx(0.06), pytest.approx(0.06)]
    assert math.isnan(adjusted[3])
    assert holm([0.6, 0.7]) == [1.0, 1.0]


# ---- paired seeds, checked on the runs' histories ----------------------------------------------------
def test_the_pairing_check_on_histories():
    def history(*digests):
        return {"rollout/prompt_digest": [[i, d] for i, d in enumerate(digests)]}

    runs = {"a": {0: history(1, 2), 1: history(5, 6)}, "b": {0: history(1, 2), 1: history(5, 6)}}
    lines = check_pairing(runs, {"a": 8, "b": 8})
    assert "seeds [0, 1], every run drew the same prompts" in lines[0]
    runs["b"][1] = history(5, 7)
    with pytest.raises(ValueError, match="seed 1: 'b' drew other prompts than 'a' at step 1"):
        check_pairing(runs, {"a": 8, "b": 8})
    assert check_pairing(runs, {"a": 8, "b": 4})  # other batch sizes draw other prompts by design
    with pytest.raises(ValueError, match="seeds 0 and 1 drew the same prompts"):
        check_pairing({"a": {0: history(1, 2), 1: history(1, 2)}}, {"a": 8})
    with pytest.raises(ValueError, match="no rollout/prompt_digest"):
        check_pairing({"a": {0: {}}}, {"a": 8})


def test_pairing_by_seed_lets_settings_draw_other_prompts_but_not_seeds_the_same():
    def history(*digests):
        return {"rollout/prompt_digest": [[i, d] for i, d in enumerate(digests)]}

    runs = {"level0": {0: history(1, 2), 1: history(5, 6)}, "level1": {0: history(3, 4), 1: history(7, 8)}}
    with pytest.raises(ValueError, match="not paired"):  # paired by prompts, as every study before it
        check_pairing(runs, {"level0": 8, "level1": 8})
    assert (
        "the settings train on other problems by design"
        in check_pairing(runs, {"level0": 8, "level1": 8}, pairing="seeds")[0]
    )
    runs["level1"][1] = history(3, 9)  # seed 1 drew seed 0's first prompts: the seed did not reach it
    with pytest.raises(ValueError, match="'level1': seeds 0 and 1 drew the same prompts"):
        check_pairing(runs, {"level0": 8, "level1": 8}, pairing="seeds")


# ---- the statistics the runs log for the study ------------------------------------------------------------
def test_length_of_correct_and_wrong_samples_by_hand():
    import torch

    from loorl.rollout.step_stats import length_by_verdict

    correct = torch.tensor([[1.0, 0.0], [math.nan, 1.0]])  # [B, K]; NaN: unscorable, in neither
    lengths = torch.tensor([[4, 6], [10, 8]])
    assert length_by_verdict(correct, lengths) == {
        "rollout/completion_len_correct": 6.0,  # (4 + 8) / 2
        "rollout/completion_len_wrong": 6.0,
    }
    assert length_by_verdict(torch.ones(2, 2), lengths) == {"rollout/completion_len_correct": 7.0}


def test_the_prompt_digest_tells_prompts_and_their_order_apart():
    from loorl.rollout.step_stats import prompt_digest
    from loorl.types import Prompt

    a, b = Prompt("1 + 2 =", "3"), Prompt("2 + 2 =", "4")
    assert prompt_digest([a, b]) == prompt_digest([Prompt("1 + 2 =", "x"), b])  # the texts, not answers
    assert prompt_digest([a, b]) != prompt_digest([b, a])
    assert prompt_digest([a]) != prompt_digest([Prompt("1 + 2 = ", "3")])
    digest = prompt_digest([a, b])
    assert digest == int(digest) < 2**24 and float(np.float32(digest)) == digest  # exact through float32


def test_a_report_of_some_parts_keeps_the_other_parts_headlines_in_place():
    existing = "- **A**, by AUC: x 1.\n  No paired difference.\n- **B**, by AUC: y 2.\n  Paired: b - a.\n"
    merged = merge_headlines(existing, {"B": ["- **B**, by AUC: y 3.", "  No paired difference."]})
    assert merged == existing.replace("y 2.\n  Paired: b - a.", "y 3.\n  No paired difference.")
    assert merge_headlines("", {"C": ["- **C**: z."]}) == "- **C**: z.\n"
    assert merge_headlines(existing, {"C": ["- **C**: z."]}) == existing + "- **C**: z.\n"


def test_headlines_follow_the_study_files_order_whichever_part_is_reported():
    existing = "- **A**: x.\n- **B**: y.\n  Paired: b - a.\n- **Gone**: w.\n"
    new = merge_headlines(existing, {"C": ["- **C**: z."]}, order=("A", "C", "B"))
    assert new == "- **A**: x.\n- **C**: z.\n- **B**: y.\n  Paired: b - a.\n- **Gone**: w.\n"
    study = load_study("which_estimator", only=["estimators_3"])  # one part reported, every title known
    assert [p.name for p in study.parts] == ["estimators_3"]
    full = load_study("which_estimator")
    assert study.part_titles == tuple(p.title for p in full.parts) and len(study.part_titles) > 1


def test_the_report_names_the_machines_the_runs_were_made_on_not_the_one_writing_it():
    def run(machine):
        return Job(None, [], 0, {}, {}, {}, {} if machine is None else {"machine": machine})

    writer = "the writer's machine"
    assert made_on([run("A"), run("A")], writer) == ("made on A", "")
    made, warning = made_on([run("A"), run("B"), run("B"), run(None)], writer)
    assert made == "made on B (2 runs); A (1 run); 1 run from before runs kept their machine"
    assert warning.startswith("**The runs were made on 2 machines:**")
    made, warning = made_on([run("A"), run(None)], writer)  # one known machine: nothing to warn of
    assert made == "made on A (1 run); 1 run from before runs kept their machine" and warning == ""
    made, warning = made_on([run(None)], writer)
    assert made == "the runs did not keep their machine; the report was written on the writer's machine"

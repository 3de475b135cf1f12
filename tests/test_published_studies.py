"""The study files loorl ships (conf/study/*.yaml) and the reports published from them
(docs/research/*/): each setting differs only where its study says, paired seeds draw the same
prompts, and a published report is written again from its kept records alone. The tooling itself is
tests/test_study.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loorl.research.study import load_study
from loorl.research.study_configs import check_part
from loorl.research.study_report import part_jobs, probe_table
from loorl.research.study_runs import kept_probes, run_probe
from loorl.research.study_tables import comparison_table, summary_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def which_estimator():
    """The real study, every part composed and checked (its settings' digests set)."""
    pytest.importorskip("reasoning_gym")
    study = load_study("which_estimator")
    lines = []
    for part in study.parts:
        check_part(part, echo=lines.append)
    return study, lines


def test_the_real_study_differs_only_where_it_says(which_estimator):
    study, lines = which_estimator
    text = "\n".join(lines)
    assert (
        "dr_grpo: estimator.name: rloo -> dr_grpo; loss.agg: seq-mean-token-sum -> seq-mean-token-sum-norm"
        in text
    )
    assert "grpo: estimator.name: rloo -> grpo\n" in text  # and nothing else
    parts = {p.name: p for p in study.parts}
    assert len(parts["estimators"].seeds) == 5 and len(parts["smollm2"].seeds) == 3
    # K = 4 in the K part is the estimators part's RLOO: the same resolved config, the same runs
    digest = {(p.name, s.label): s.digest for p in study.parts for s in p.settings}
    assert digest[("k", "rloo_K4")] == digest[("estimators", "rloo")]
    assert digest[("k", "grpo_K4")] == digest[("estimators", "grpo")]
    assert len({digest[("estimators", s.label)] for s in parts["estimators"].settings}) == 8
    # the three-dataset part: the same eight settings and comparisons on study_tiny3
    three, old = parts["estimators_3"], parts["estimators"]
    assert [(s.label, s.overrides[1:]) for s in three.settings] == [
        (s.label, s.overrides[1:]) for s in old.settings
    ]
    assert three.may_differ == old.may_differ
    assert three.comparisons == parts["estimators"].comparisons and three.settings[0].steps == 200
    assert not {s.digest for s in three.settings} & {s.digest for s in parts["estimators"].settings}


def test_run_i_of_every_setting_draws_the_same_prompts_in_the_same_order(which_estimator):
    """Paired seeds, from the prompts themselves: each setting's task built from its own resolved config
    draws, for a seed, the same prompts at every step; another seed draws others. A task's prompts for
    (step, B, seed) are a function of its config, so the settings whose resolved `task` and B are the same
    share one built task (the estimators part's eight settings are one)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from loorl.config import compose_config

    study, _ = which_estimator
    part = next(p for p in study.parts if p.name == "estimators")
    tasks, streams = {}, {}
    for setting in part.settings:
        for seed in (0, 1):
            cfg = compose_config(*setting.overrides, f"seed={seed}", "output_dir=/tmp/unused")
            b = cfg.rl.prompts_per_step
            key = (OmegaConf.to_yaml(cfg.task, resolve=True), b)
            if key not in tasks:
                tasks[key] = instantiate(cfg.task)
            task = tasks[key]
            streams[setting.label, seed] = [
                [(p.text, p.answer) for p in task.prompts_for_step(step, b, seed=seed)] for step in range(3)
            ]
    for seed in (0, 1):
        first = streams[part.settings[0].label, seed]
        assert len(first[0]) == 96 and len({t for t, _ in first[0]}) > 50
        for setting in part.settings[1:]:
            assert streams[setting.label, seed] == first, setting.label
    assert streams["rloo", 0] != streams["rloo", 1]


def test_the_exploration_study_changes_one_tool_a_setting_on_the_recipe():
    """conf/study/exploration.yaml: every setting is experiment=smollm2_arithmetic with one of the field's
    tools against collapsing exploration; the same steps, prompts and samples a step (the same budget)."""
    study = load_study("exploration")
    lines = []
    (part,) = study.parts
    check_part(part, echo=lines.append)
    text = "\n".join(lines)
    assert (
        "temperature_1: rollout.temperature: 0.7 -> 1.0\n" in text
        and "no_grad_clip: loss.max_grad_norm" in text
    )
    assert "w_reinforce: estimator.name: rloo -> w_reinforce;" in text
    assert "rl_zvp: loss.zvp_alpha: None -> 0.1\n" in text  # RL-ZVP's shaping beside the recipe's RLOO
    assert not any(key in text for key in ("rl.steps", "rl.prompts_per_step", "rl.samples_per_prompt"))
    assert len(part.settings) == 14 and len(part.seeds) == 3 and part.pairing == "seeds"
    assert ("w_reinforce", "recipe") in part.comparisons  # every setting against the recipe


def test_the_curriculum_study_evaluates_the_same_held_out_sets_in_every_setting():
    """conf/study/curriculum.yaml: its settings differ only in how the training level moves; each
    setting's task, built from its resolved config, holds out the same problems at levels 0, 1 and 2,
    trains at the level its label says, and the tiny part's settings share one warm-started model."""
    pytest.importorskip("reasoning_gym")
    from hydra.utils import instantiate

    from loorl.config import compose_config
    from loorl.models.tiny import tiny_cache_key

    study = load_study("curriculum")
    assert study.title == "Curriculum against fixed difficulty"
    assert str(study.report_dir) == "docs/research/curriculum"
    for part, dataset, seeds in zip(study.parts, ("chain_sum", "spell_backward"), (3, 5)):
        lines = []
        check_part(part, echo=lines.append)
        assert len(part.seeds) == seeds
        assert [s.label for s in part.settings] == ["curriculum", "fixed_start", "fixed_reached"]
        assert lines[1] == "  fixed_start: task.curriculum.enabled: True -> False"
        assert f"task.curriculum.fixed_levels.{dataset}: <absent> -> 1" in lines[2]
        assert ("curriculum", "fixed_start") in part.comparisons
        assert ("curriculum", "fixed_reached") in part.comparisons
        held, keys = {}, set()
        for setting in part.settings:
            cfg = compose_config(*setting.overrides, "seed=0", "output_dir=/tmp/unused")
            task = instantiate(cfg.task)
            assert task.source_names == [dataset]
            assert task.eval_source_names == [dataset, f"{dataset}@L1", f"{dataset}@L2"]
            held[setting.label] = [(p.meta["source"], p.text) for p in task.eval_prompts()]
            level = {p.meta["level"] for p in task.prompts_for_step(0, 8, seed=0)}
            assert level == {1 if setting.label == "fixed_reached" else 0}, setting.label
            keys.add(tiny_cache_key(cfg.model.tiny, cfg.task))
        assert held["curriculum"] == held["fixed_start"] == held["fixed_reached"]
        assert len(keys) == 1  # (the smollm2 part has no tiny model: its key is unused)


def test_a_probe_part_is_read_back_from_its_report_and_not_run_again(which_estimator, tmp_path):
    study, _ = which_estimator
    part = next(p for p in study.parts if p.name == "variance")
    report = ROOT / study.report_dir
    learning = json.loads((report / "estimators.json").read_text())["settings"]
    lines, results = probe_table(tmp_path, part, learning, kept_probes(report, part))  # no probe folders
    assert sorted(results) == [0, 20, 40]
    page = (report / "variance.md").read_text().splitlines()
    assert lines == page[2:]  # the published table and its caption, below the command line
    assert run_probe(tmp_path, part, records=report, echo=lambda _: None) == []
    assert not list(tmp_path.iterdir())  # nothing trained, nothing probed


def test_the_three_dataset_part_is_written_again_from_its_published_records(which_estimator, tmp_path):
    """docs/research/which-estimator/runs/ holds a record of each of estimators_3's 24 runs: with no run
    folders (a fresh clone), the part's table and comparisons are the published ones, line for line."""
    study, _ = which_estimator
    part = next(p for p in study.parts if p.name == "estimators_3")
    report = ROOT / study.report_dir
    jobs = part_jobs(tmp_path / "no-runs", part, report)
    assert {label: sorted(runs) for label, runs in jobs.items()} == {
        s.label: list(part.seeds) for s in part.settings
    }
    summary, data = summary_table(part, jobs)
    comparisons, records = comparison_table(part, data)
    page = (report / "estimators_3.md").read_text()
    assert "\n".join(summary) in page and "\n".join(comparisons) in page
    published = json.loads((report / "estimators_3.json").read_text())
    assert json.loads(json.dumps(records)) == published["comparisons"]
    assert not (tmp_path / "no-runs").exists()

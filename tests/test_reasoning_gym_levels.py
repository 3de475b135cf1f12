"""`task=reasoning_gym`'s held-out sets at further levels (`task.eval_levels`) and fixed training levels
(`task.curriculum.fixed_levels`): the extra sets are at their level's difficulty, distinct, never trained
on at any level, logged under `<name>@L<level>` and left out of the overall `val/*` metrics; the
starting level's set is the one it was without them."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loorl.errors import ConfigError

pytest.importorskip("reasoning_gym")
from loorl.tasks.reasoning_gym import ReasoningGymTask  # noqa: E402

LEVELED = {"chain_sum": {"level": 0}, "spell_backward": {"level": 0}}


def make(datasets=None, **kwargs) -> ReasoningGymTask:
    return ReasoningGymTask(datasets=datasets or LEVELED, **{"eval_size": 40, **kwargs})


@pytest.fixture(scope="module")
def task() -> ReasoningGymTask:
    """chain_sum (levels 0-10), spell_backward (0-4), products without a level: held out at 0, 1, 2, 5."""
    return make({**LEVELED, "products": {"level": None}}, eval_levels=[2, 1, 5, 1, 0])


def by_source(prompts) -> dict[str, list]:
    out = {}
    for p in prompts:
        out.setdefault(p.meta["source"], []).append(p)
    return out


def test_each_leveled_dataset_is_held_out_at_each_level_it_has(task):
    """A level above a dataset's highest (spell_backward's is 4) and its starting level are not added
    again; a dataset without a level gets none. Each set holds eval_size distinct questions."""
    assert task.eval_levels == [0, 1, 2, 5]
    names = ["chain_sum@L1", "chain_sum@L2", "chain_sum@L5", "spell_backward@L1", "spell_backward@L2"]
    assert task.eval_source_names == ["chain_sum", "spell_backward", "products", *names]
    assert task.source_names == ["chain_sum", "spell_backward", "products"]  # training's: unchanged
    sets = by_source(task.eval_prompts())
    assert list(sets) == task.eval_source_names  # the starting levels' sets first
    for name, prompts in sets.items():
        assert len({p.meta["question"] for p in prompts}) == len(prompts) == 40, name
        dataset, _, level = name.partition("@L")
        assert {p.meta["dataset"] for p in prompts} == {dataset}
        assert {p.meta["level"] for p in prompts} == {
            int(level) if level else (None if dataset == "products" else 0)
        }
        assert all(p.meta.get("in_overall", True) is (not level) for p in prompts)
    assert "40 at level 1, 40 at level 2, 40 at level 5" in task.run_facts()["reasoning-gym"]


def test_a_further_levels_set_has_that_levels_difficulty(task):
    """reasoning-gym's own metadata: chain_sum's level L (inclusive ranges) has 2 to L+2 terms of 1 to
    L+1 digits, and the set reaches past the level below; spell_backward's words grow 3, 5, 7 letters."""
    sets = by_source(task.eval_prompts())
    for level, name in ((0, "chain_sum"), (1, "chain_sum@L1"), (2, "chain_sum@L2")):
        meta = [p.meta["entry"]["metadata"] for p in sets[name]]
        terms, digits = [m["num_terms"] for m in meta], [m["num_digits"] for m in meta]
        assert min(terms) == 2 and max(terms) == level + 2, name
        assert min(digits) == 1 and max(digits) == level + 1, name
    for level, name in ((0, "spell_backward"), (1, "spell_backward@L1"), (2, "spell_backward@L2")):
        assert max(len(p.answer) for p in sets[name]) == 3 + 2 * level, name
    # reasoning-gym scores them, as any problem of the dataset
    prompt = sets["chain_sum@L2"][0]
    assert task.grade(prompt, f"<answer>{prompt.answer}</answer>") == (1.0, True)


@pytest.mark.parametrize("seed", [0, 3])
def test_no_held_out_question_of_any_level_is_trained_on_at_any_level(seed):
    """Level 1's and 2's held-out sets (inclusive ranges) hold level-0-shaped problems (2 terms of one
    digit, of which level 0 has ~200): 2,000 draws at level 0 would hit some if they were not excluded.
    Training at levels 0, 1 and 2 (`fixed_levels`) draws none of any level's held-out questions."""
    kwargs = {"datasets": {"chain_sum": {"level": 0}}, "eval_levels": [1, 2], "eval_seed": 100 + seed}
    held = {p.meta["question"] for p in make(**kwargs).eval_prompts()}
    assert len(held) > 80  # three sets of 40 (one stream: levels share the problems their ranges share)
    shapes = [(p.meta["level"], p.meta["entry"]["metadata"]) for p in make(**kwargs).eval_prompts()]
    shaped = [m for level, m in shapes if level > 0 and m["num_terms"] == 2 and m["num_digits"] == 1]
    assert len(shaped) >= 3
    for level in (0, 1, 2):
        fixed = {"fixed_levels": {"chain_sum": level}} if level else {}
        task = make(**kwargs, curriculum=fixed)
        drawn = [p for step in range(25) for p in task.prompts_for_step(step, 80, seed=seed)]
        assert {p.meta["level"] for p in drawn} == {level}
        assert {p.meta["question"] for p in drawn}.isdisjoint(held), level
        shots = {q for qs in task._shots.values() for q, _ in qs}
        assert shots.isdisjoint(held)


def test_the_starting_levels_set_is_the_one_without_eval_levels():
    """The same prompts (text, answer, entry, source) with and without eval_levels, and the problems
    pinned: the eval stream's seed does not depend on the level, nor on eval_levels."""

    def starting(task):
        kept = [p for p in task.eval_prompts() if p.meta.get("in_overall", True)]
        return [(p.text, p.answer, p.meta["source"], p.meta["level"], p.meta["entry"]) for p in kept]

    datasets = {"chain_sum": {"level": 0}, "products": {"level": 0}, "spell_backward": {"level": 1}}
    without = starting(make(datasets))
    assert starting(make(datasets, eval_levels=[0, 1, 2, 3])) == without
    assert starting(make(datasets, eval_levels=[])) == without
    problems = json.dumps([(e["question"], a, s) for _, a, s, _, e in without], sort_keys=True)
    assert len(without) == 120
    # reasoning-gym==0.1.25 (pyproject's pin); the digest of these problems before eval_levels existed
    assert hashlib.sha256(problems.encode()).hexdigest()[:16] == PINNED


PINNED = "9e906a2429e4db5b"


def test_fixed_levels_trains_at_its_level_and_changes_nothing_held_out():
    """Curriculum off, chain_sum trained at level 1: the held-out sets, worked examples and the warm
    start's examples are those of level 0 throughout; the training draws are level 1's, logged."""
    base = make({"chain_sum": {"level": 0}}, eval_levels=[1, 2])
    fixed = make(
        {"chain_sum": {"level": 0}}, eval_levels=[1, 2], curriculum={"fixed_levels": {"chain_sum": 1}}
    )
    assert [p.text for p in fixed.eval_prompts()] == [p.text for p in base.eval_prompts()]
    assert fixed._shots == base._shots
    sft = lambda t: t.sft_examples(32, rng=np.random.default_rng(0))  # noqa: E731
    assert sft(fixed) == sft(base)
    assert fixed.level_of("chain_sum") == 1 and base.level_of("chain_sum") == 0
    assert fixed.observe(0, {"chain_sum": [1] * 64}) == {"curriculum/level/chain_sum": 1.0}
    drawn = fixed.prompts_for_step(0, 64, seed=0)
    assert {p.meta["level"] for p in drawn} == {1}
    assert max(p.meta["entry"]["metadata"]["num_terms"] for p in drawn) == 3
    assert "trained at level 1" in fixed.run_facts()["reasoning-gym"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eval_levels": 2}, r"task.eval_levels=2 is not a list of levels: give one such as \[1, 2\]"),
        ({"eval_levels": "1,2"}, "task.eval_levels='1,2' is not a list of levels"),
        ({"eval_levels": [1, -1]}, "task.eval_levels has -1: levels are whole numbers from 0"),
        ({"eval_levels": [1.5]}, "task.eval_levels has 1.5: levels are whole numbers from 0"),
        (
            {"datasets": {"chain_sum": {}}, "eval_levels": [1]},
            r"task.eval_levels adds held-out sets .* no dataset of task.datasets has a level",
        ),
        (
            {"curriculum": {"enabled": True, "fixed_levels": {"chain_sum": 1}}},
            "task.curriculum.fixed_levels holds training levels fixed, and the curriculum moves them",
        ),
        ({"curriculum": {"fixed_levels": {"products": 1}}}, r"fixed_levels.products: not a dataset"),
        ({"curriculum": {"fixed_levels": {"chain_sum": 11}}}, r"chain_sum=11: a level from 0 to .* 10"),
        ({"curriculum": {"fixed_levels": [1]}}, r"fixed_levels=\[1\] is not a mapping"),
    ],
)
def test_bad_levels_are_one_line_errors_naming_the_setting(kwargs, match):
    with pytest.raises(ConfigError, match=match) as err:
        make(**{"datasets": {"chain_sum": {"level": 0}}, **kwargs})
    assert "\n" not in str(err.value)


def test_the_config_composes_with_eval_levels_and_fixed_levels(default_cfg):
    from hydra.utils import instantiate

    levels = [
        "task.eval_levels=[1,2]",
        "task.curriculum.enabled=false",
        "task.curriculum.fixed_levels={chain_sum: 1}",
    ]
    cfg = default_cfg("experiment=tiny_reasoning_gym", *levels)
    task = instantiate(cfg.task)  # Hydra's ListConfig and DictConfig, as a run passes them
    assert task.eval_levels == [1, 2] and task.fixed_levels == {"chain_sum": 1}
    extra = [f"{name}@L{level}" for name in ("chain_sum", "letter_counting") for level in (1, 2)]
    assert task.eval_source_names == ["chain_sum", "letter_counting", *extra]
    assert instantiate(default_cfg("task=reasoning_gym").task).eval_source_names == [
        "chain_sum",
        "basic_arithmetic",
    ]


def test_the_overall_val_metrics_leave_the_further_levels_out():
    """`PolicyGradientModule.validation_step` on a batch whose last prompts are an eval_levels set:
    `val/accuracy` (and the other overall metrics) over the starting level's prompts only, the extra
    set under its own `val/accuracy/<name>@L<level>`; a batch of extra prompts only updates nothing
    overall."""
    from torchmetrics import MeanMetric, SumMetric

    from loorl.training.module import COUNTED_METRICS, VALIDATION_METRICS, PolicyGradientModule

    logged = {}
    module = SimpleNamespace(
        val_metrics=torch.nn.ModuleDict(
            {n: MeanMetric(nan_strategy="ignore") for n in VALIDATION_METRICS.values()}
        ),
        val_counts=torch.nn.ModuleDict({n: SumMetric() for n in COUNTED_METRICS.values()}),
        val_source_accuracy=torch.nn.ModuleDict(),
        device=torch.device("cpu"),
        log=lambda name, metric, **kwargs: logged.__setitem__(name, metric),
    )

    def results(sources, correct):
        n = len(sources)
        unmeasured = dict.fromkeys(("tool_used", "env_failures", "pass_k", "maj_k"))
        return unmeasured | {
            "correct": torch.tensor(correct),
            "reward": torch.tensor(correct),
            "unscorable": torch.zeros(n),
            "sources": sources,
            "source_names": ["chain_sum", "chain_sum@L1"],
            "in_overall": torch.tensor(["@L" not in s for s in sources]),
        }

    first = results(["chain_sum"] * 4 + ["chain_sum@L1"] * 2, [1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    PolicyGradientModule.validation_step(module, first, 0)
    PolicyGradientModule.validation_step(module, results(["chain_sum@L1"] * 2, [1.0, 0.0]), 1)
    assert float(logged["val/accuracy"].compute()) == 0.5  # 2 of the 4 at level 0
    assert float(logged["val/reward"].compute()) == 0.5
    assert float(logged["val/accuracy/chain_sum"].compute()) == 0.5
    assert float(logged["val/accuracy/chain_sum@L1"].compute()) == 0.25  # 1 of its 4
    assert int(module.val_metrics["accuracy"].weight) == 4


def test_the_curriculum_and_the_held_out_levels_are_part_of_the_runs_identity():
    """A resume with another curriculum rule, other fixed levels or other task.eval_levels is warned of
    (`run_identity`'s "run" part); unset, each entry is None, as in checkpoints written before them."""
    from loorl.config import compose_config, load_settings
    from loorl.training.run_identity import run_identity

    def identity(*overrides):
        settings = load_settings(compose_config("experiment=tiny_reasoning_gym", *overrides))
        run = run_identity(settings, model="m", strategy="auto")["run"]
        return {k: v for k, v in run.items() if k.startswith("task.")}

    plain = identity("task.curriculum.enabled=false")
    assert plain == {"task.curriculum": None, "task.curriculum.fixed_levels": None, "task.eval_levels": None}
    on = identity()
    assert (
        '"raise_above": 0.8' in on["task.curriculum"]
        and on["task.curriculum"] != identity("task.curriculum.raise_above=0.7")["task.curriculum"]
    )
    fixed = identity("task.curriculum.enabled=false", "task.curriculum.fixed_levels={chain_sum: 1}")
    assert fixed["task.curriculum"] is None and fixed["task.curriculum.fixed_levels"] == '{"chain_sum": 1}'
    assert identity("task.eval_levels=[1,2]")["task.eval_levels"] == [1, 2]

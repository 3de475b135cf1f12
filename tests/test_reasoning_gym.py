"""`task=reasoning_gym` (loorl.tasks.reasoning_gym): held-out problems disjoint from training ones by
construction, the same problems on every machine, reasoning-gym's own scores, the padding rule, the
curriculum's levels in the prompts drawn, one-line errors, and an optional extra nothing imports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fixtures import child_env, load_script
from loorl.errors import ConfigError

rg = pytest.importorskip("reasoning_gym")
from loorl.tasks.reasoning_gym import ReasoningGymTask  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"chain_sum": {"level": 0}, "products": {"level": 0}}  # level 0: ~200 distinct questions each


def make(datasets=None, **kwargs) -> ReasoningGymTask:
    return ReasoningGymTask(datasets=datasets or SMALL, **{"eval_size": 40, **kwargs})


@pytest.fixture(scope="module")
def task() -> ReasoningGymTask:
    return make(curriculum={"enabled": True, "window": 8, "raise_above": 0.5})


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_held_out_and_training_problems_are_disjoint_for_every_dataset_and_seed(seed):
    """Level 0 of chain_sum and products has few enough questions that a draw of 2,000 would hit the
    held-out 40 hundreds of times if they were not excluded; none is drawn."""
    task = make(eval_size=40, eval_seed=100 + seed)
    held = {(p.meta["source"], p.meta["question"]) for p in task.eval_prompts()}
    assert len(held) == 80  # 40 distinct per dataset
    drawn = [p for step in range(25) for p in task.prompts_for_step(step, 80, seed=seed)]
    assert {(p.meta["source"], p.meta["question"]) for p in drawn}.isdisjoint(held)
    # the pool is small: the same training questions come back (so disjointness was not luck)
    assert len({p.meta["question"] for p in drawn}) < len(drawn) / 4


def test_a_step_splits_its_prompts_by_weight_and_is_a_pure_function_of_seed_and_step():
    task = make(datasets={"chain_sum": {"level": 0, "weight": 3.0}, "products": {"level": 0, "weight": 1.0}})
    a, b = task.prompts_for_step(3, 16, seed=5), task.prompts_for_step(3, 16, seed=5)
    assert [p.text for p in a] == [p.text for p in b]
    assert sum(p.meta["source"] == "chain_sum" for p in a) == 12
    assert [p.text for p in task.prompts_for_step(4, 16, seed=5)] != [p.text for p in a]


PROBLEMS = """
import json
from loorl.tasks.reasoning_gym import ReasoningGymTask
task = ReasoningGymTask(datasets={"chain_sum": {"level": 1}, "letter_counting": {"level": 0},
                                  "spell_backward": {"level": 0}}, eval_size=5)
out = [p.text for p in task.eval_prompts()] + [p.text for p in task.prompts_for_step(2, 9, seed=3)]
print(json.dumps(out))
"""


def test_a_seed_gives_the_same_problems_in_every_process_whatever_its_hash_seed():
    """reasoning-gym draws from `random.Random(seed + idx)`; loorl's seeds come from crc32 and numpy,
    never Python's salted `hash`: two processes with different PYTHONHASHSEED agree."""
    outs = []
    for hash_seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", PROBLEMS], capture_output=True, text=True, timeout=120,
                              env=child_env(PYTHONHASHSEED=hash_seed), check=True)  # fmt: skip
        outs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1] and len(outs[0]) == 24


def test_rewards_are_reasoning_gyms_own_scores_and_exact_scoring_gives_padding_nothing(task):
    prompt = task.eval_prompts()[0]
    entry, answer = prompt.meta["entry"], prompt.answer
    own = rg.get_score_answer_fn("chain_sum")
    padded = f"<answer>{answer} 1 2 3</answer>"
    cases = {  # completion: reasoning-gym's score of its extracted answer
        f"<answer>{answer}</answer>": 1.0,
        f"I think <answer>0</answer>, no: <answer> {answer} </answer>": 1.0,  # the last tag, stripped
        padded: own(f"{answer} 1 2 3", entry),
        f"{answer}": 0.0,  # no tag: no answer
    }
    assert 0 < cases[padded] < 1  # reasoning-gym's containment credit
    library = make(scoring="library")
    for completion, score in cases.items():
        assert library.grade(prompt, completion) == (score, score == 1.0)
        assert task.grade(prompt, completion) == (float(score == 1.0), score == 1.0)  # exact: 0 or 1


def test_the_curriculum_level_sets_the_problems_drawn_and_is_logged():
    task = make(
        datasets={"chain_sum": {"level": 0}}, curriculum={"enabled": True, "window": 4, "raise_above": 0.5}
    )
    terms = lambda prompts: max(
        p.meta["question"].count(" + ") + p.meta["question"].count(" - ") for p in prompts
    )  # noqa: E731
    assert terms(task.prompts_for_step(0, 64, seed=0)) == 1  # level 0: two terms
    assert task.observe(0, {"chain_sum": [1, 1, 0, 0]}) == {"curriculum/level/chain_sum": 1.0}
    assert task.observe(1, {"chain_sum": [1, 1, 0, 0]})["curriculum/level/chain_sum"] == 2.0
    drawn = task.prompts_for_step(2, 64, seed=0)
    assert {p.meta["level"] for p in drawn} == {2} and terms(drawn) == 3  # inclusive: 2 to 4 terms
    assert terms(task.eval_prompts()) == 1  # held out at the starting level: before and after compare
    state = task.state_dict()
    fresh = make(
        datasets={"chain_sum": {"level": 0}}, curriculum={"enabled": True, "window": 4, "raise_above": 0.5}
    )
    fresh.load_state_dict(state)
    assert [p.text for p in fresh.prompts_for_step(2, 64, seed=0)] == [p.text for p in drawn]
    # pass-rate pools (rl.prompt_pools) keep one pass rate per dataset and level: the questions rarely repeat
    assert {task.pass_rate_key(p) for p in drawn} == {"chain_sum@L2"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"datasets": {"chain_summ": {}}},
            r"chain_summ is not a reasoning-gym dataset \(did you mean chain_sum",
        ),
        ({"datasets": {"chain_sum": {"config": {"max_termz": 3}}}}, "config.max_termz is not a setting of"),
        ({"datasets": {"chain_sum": {"config": {"seed": 3}}}}, "config.seed is not a setting"),
        (
            {"datasets": {"chain_sum": {"level": 0, "config": {"max_terms": 3}}}},
            "set by the curriculum level",
        ),
        ({"datasets": {"chain_sum": {"wieght": 2}}}, "chain_sum.wieght is not a dataset setting"),
        ({"datasets": {"chain_sum": {"weight": 0}}}, "weight=0.0 must be positive"),
        ({"datasets": {"chain_sum": None}}, "no dataset left"),
        (
            {"datasets": {"chain_sum": {}}, "curriculum": {"enabled": True}},
            "no dataset of task.datasets has one",
        ),
        ({"curriculum": {"windo": 3}}, "curriculum.windo is not a curriculum setting"),
        ({"curriculum": {"range_mode": "top"}}, "range_mode='top' is not one of"),
        ({"scoring": "partial"}, "task.scoring='partial' is not one of: exact, library"),
        ({"datasets": {"chain_sum": {"config": {"min_terms": 5, "max_terms": 2}}}}, "reasoning-gym refuses"),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_setting(kwargs, match):
    with pytest.raises(ConfigError, match=match) as err:
        make(**kwargs)
    assert "\n" not in str(err.value)


def test_prompts_with_characters_the_tokenizer_lacks_are_refused_before_training(tiny_tokenizer):
    task = make(datasets={"chain_sum": {"level": 0}}, system_prompt="Answer in <answer> tags \u2192")
    with pytest.raises(ConfigError, match="the tokenizer has no token for"):
        task.prepare(tiny_tokenizer, max_prompt_length=512)
    make(datasets={"chain_sum": {"level": 0}}, system_prompt=None).prepare(
        tiny_tokenizer, max_prompt_length=512
    )


BLOCKED = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "reasoning_gym":
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
"""


def test_without_the_extra_nothing_imports_it_and_asking_for_it_is_one_line(tmp_path):
    """A fresh interpreter where `import reasoning_gym` fails: loorl and its CLI's config checks import
    fine, and `task=reasoning_gym` fails in one line naming the install command, before any model."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKED)
    env = child_env(PYTHONPATH=f"{tmp_path}:{ROOT / 'src'}")
    probe = "import sys, loorl, loorl.build, loorl.cli.train; print('reasoning_gym' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
    cmd = [
        sys.executable,
        str(ROOT / "src" / "train.py"),
        "task=reasoning_gym",
        f"hydra.run.dir={tmp_path}/run",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert 'needs the reasoning-gym package: pip install -e ".[reasoning-gym]"' in done.stderr + done.stdout
    assert "Traceback" not in done.stderr and not (tmp_path / "model_cache").exists()


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from loorl.models.tiny import build_char_tokenizer

    return build_char_tokenizer()


def test_the_tiny_tokenizer_covers_the_tiny_experiments_prompts(tiny_tokenizer):
    task = make(datasets={"chain_sum": {"level": 0}, "products": {"level": 0}}, system_prompt=None, shots=0,
                chat_template=False)  # fmt: skip
    task.prepare(tiny_tokenizer, max_prompt_length=512)
    assert all(len(p.text) < 100 for p in task.eval_prompts())
    assert textwrap.shorten(task.sft_examples(1, rng=np.random.default_rng(0))[0][1], 40).startswith(
        "<answer>"
    )


@pytest.mark.parametrize(
    ("experiment", "sources"),
    [
        ("tiny_reasoning_gym", ["chain_sum", "letter_counting"]),
        ("smollm2_reasoning_gym", ["chain_sum", "basic_arithmetic", "products"]),
    ],
)
def test_the_experiments_compose_and_build_their_mixtures_with_the_curriculum_on(
    default_cfg, experiment, sources
):
    from hydra.utils import instantiate

    task = instantiate(default_cfg(f"experiment={experiment}").task)  # a null entry drops the base's dataset
    assert task.source_names == sources and task.curriculum is not None
    assert set(task.curriculum.levels) == set(sources)


def test_training_prompts_over_the_length_limit_are_drawn_again_and_counted_through_a_resume(tiny_tokenizer):
    """A curriculum's longer problems never stop a run: a draw over rollout.max_prompt_length is drawn
    again, counted, and the count is part of the checkpointed state."""
    curriculum = {"enabled": True, "window": 1, "raise_above": 1.0}
    kwargs = {"datasets": {"chain_sum": {"level": 0}}, "system_prompt": None, "shots": 0,
              "chat_template": False, "eval_size": 5, "curriculum": curriculum}  # fmt: skip
    task = make(**kwargs)
    task.prepare(tiny_tokenizer, max_prompt_length=80)  # level 0's prompts: 67 characters, one token each
    for step in range(4):  # up to level 4: 2 to 6 terms of 1 to 5 digits, many over 80 characters
        task.observe(step, {"chain_sum": [1]})
    drawn = task.prompts_for_step(4, 64, seed=0)
    assert {p.meta["level"] for p in drawn} == {4}
    assert max(len(p.text) for p in drawn) <= 80 and task.skipped_long > 10
    resumed = make(**kwargs)
    resumed.load_state_dict(task.state_dict())
    assert resumed.skipped_long == task.skipped_long and resumed.level_of("chain_sum") == 4
    assert task.observe(4, {})["rollout/skipped_long_prompts"] == float(task.skipped_long)


def test_the_answers_table_counts_each_answer_given_and_the_best_constant(tmp_path):
    """scripts/research/reasoning_gym_table.py --answers: per answer given, how often and how often right (the
    run's own grading), at the first and last validation, beside the best constant answer's accuracy;
    what showed letter_counting's, gcd's and count_bits' gains to be one answer given to every problem
    (docs/how-to/reasoning-gym.md)."""
    import csv

    from omegaconf import OmegaConf

    table = load_script("research/reasoning_gym_table.py")
    cfg = {"_target_": "loorl.tasks.reasoning_gym.ReasoningGymTask", "datasets": {"chain_sum": {"level": 0}},
           "eval_size": 4, "system_prompt": None, "shots": 0, "chat_template": False}  # fmt: skip
    OmegaConf.save({"task": cfg}, tmp_path / "config.yaml")
    held = [p for p in make(**{k: v for k, v in cfg.items() if k != "_target_"}).eval_prompts()]
    with (tmp_path / "samples.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "prompt", "completion", "reward", "correct"])
        for p in held:  # step 0: "1" to every problem; step 20: the right answer to the first two
            w.writerow([0, p.text, "<answer>1</answer>", float(p.answer == "1"), p.answer == "1"])
        for i, p in enumerate(held):
            given = p.answer if i < 2 else "x"
            w.writerow([20, p.text, f"<answer>{given}</answer>", float(i < 2), i < 2])
    run = {"datasets": {"chain_sum": {"first": 0.1, "last": 0.5, "level": 1.0},  # a further level's set:
                        "chain_sum@L1": {"first": 0.0, "last": 0.2, "level": float("nan")}},  # no level
           "first": 0.1, "last": 0.5, "wall": 60.0, "peak": 1.0, "train_peak": 1.0}  # fmt: skip
    head = table.markdown({"s0": run}).splitlines()[0]
    assert "| chain_sum first -> last (level) | chain_sum@L1 first -> last | all first -> last |" in head
    text = table.heldout_answers(tmp_path, "chain_sum")
    ones = sum(p.answer == "1" for p in held)
    assert f"| 0 | {100 * ones / 4:.0f}% | '1' 4: {ones} |" in text
    assert text.splitlines()[-1].startswith("| 20 | 50% | ") and "'x' 2: 0" in text
    most = max([p.answer for p in held].count(a) for a in {p.answer for p in held})
    assert f"is right on {100 * most / 4:.0f}%" in text.splitlines()[0]

"""`task.curriculum` of `task=arithmetic` and `task=chat_arithmetic`: off, the prompts are those of
before it existed; on, each level draws only pairs within its bound (never a held-out one), levels move
by the policy's outcomes and survive a checkpoint's plain values, bad settings are one-line errors, and
the configs compose. No model is trained here."""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict

import numpy as np
import pytest
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate

from loorl.build import instantiate_unwrapped
from loorl.errors import ConfigError
from loorl.models.tiny import tiny_cache_key
from loorl.tasks.arithmetic import ArithmeticTask, ChatArithmeticTask
from loorl.training.callbacks import RunSummary

ON = {"enabled": True, "max_operands": [9, 19, 29], "window": 8}


def digest(prompts) -> str:
    return hashlib.sha256("\n".join(p.text + "|" + p.answer for p in prompts).encode()).hexdigest()[:16]


def operands(prompts) -> list[tuple[int, int]]:
    return [(p.meta["a"], p.meta["b"]) for p in prompts]


def draw(task, n: int = 512, seed: int = 0):
    return task.train_prompts(n, rng=np.random.default_rng(seed))


# ---- off: the prompts of before ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "curriculum", [None, {}, {"enabled": False}, {"enabled": False, "max_operands": [9, 19, 29]}]
)
def test_off_the_prompts_are_byte_for_byte_those_drawn_before_the_curriculum_existed(curriculum):
    """The expected values were drawn by the task as it was before `curriculum` (git HEAD at the time)."""
    task = ArithmeticTask(curriculum=curriculum)
    first = ["25+15=", "19+3=", "15+10=", "8+2=", "9+7=", "1+6=", "2+7=", "0+14="]
    assert [p.text for p in task.train_prompts(8, rng=np.random.default_rng(0))] == first
    assert digest(task.train_prompts(256, rng=np.random.default_rng(7))) == "892c8dfda88db929"
    assert digest(task.prompts_for_step(3, 64, seed=11)) == "08be6b2d92f21d8c"
    warm = task.sft_examples(256, rng=np.random.default_rng(7))
    assert (
        hashlib.sha256("\n".join(f"{t}|{a}" for t, a in warm).encode()).hexdigest()[:16] == "892c8dfda88db929"
    )
    held_out = ArithmeticTask(exclude_eval_from_train=True, curriculum=curriculum)
    assert digest(held_out.train_prompts(256, rng=np.random.default_rng(7))) == "ab380a6db5edcd00"
    chat = ChatArithmeticTask(curriculum=None if curriculum is None else {**curriculum, "max_operands": None})
    assert digest(chat.train_prompts(256, rng=np.random.default_rng(7))) == "863cae4cbfbf87b8"
    assert task.observe(0, {"arithmetic": [1] * 64}) == {} and task.state_dict() == {}
    assert task.run_facts() == {} and task.curriculum is None


# ---- on: levels and their bounds --------------------------------------------------------------------
@pytest.mark.parametrize("cls", [ArithmeticTask, ChatArithmeticTask])
def test_levels_rise_on_a_full_window_of_successes_and_each_level_draws_within_its_bound(cls):
    tops = [9, 19, 29] if cls is ArithmeticTask else [9, 19, 49]
    task = cls(curriculum={**ON, "max_operands": tops})
    key = f"curriculum/level/{task.name}"
    previous = -1
    for level, top in enumerate(tops):
        assert task.level == level
        drawn = [x for pair in operands(draw(task, seed=level)) for x in pair]
        assert max(drawn) <= top  # within the level's bound...
        assert max(drawn) > previous  # ...and beyond the level below's: the new range is drawn
        previous = top
        assert task.observe(2 * level, {task.name: [1] * 4}) == {key: float(level)}  # window of 8 not full
        assert task.observe(2 * level + 1, {task.name: [1] * 4}) == {
            key: float(min(level + 1, len(tops) - 1))
        }
    assert task.level == len(tops) - 1  # the top level holds
    assert task.observe(99, {task.name: [1] * 8}) == {key: float(len(tops) - 1)}
    assert task.observe(100, {"other": [1] * 8}) == {key: float(len(tops) - 1)}  # not its name: ignored


def test_failures_hold_the_level_and_lower_below_lowers_it_never_under_level_0():
    task = ArithmeticTask(curriculum={**ON, "lower_below": 0.25})
    assert task.observe(0, {"arithmetic": [0, 1] * 4}) == {"curriculum/level/arithmetic": 0.0}  # 0.5: holds
    assert task.observe(1, {"arithmetic": [0] * 8})["curriculum/level/arithmetic"] == 0.0  # the floor
    task.observe(2, {"arithmetic": [1] * 8})
    assert task.level == 1
    assert task.observe(3, {"arithmetic": [0] * 8})["curriculum/level/arithmetic"] == 0.0


@pytest.mark.parametrize("cls", [ArithmeticTask, ChatArithmeticTask])
def test_held_out_pairs_are_never_drawn_at_any_level(cls):
    tops = [4, 9, 19, 29] if cls is ArithmeticTask else [4, 9, 19, 49]
    task = cls(exclude_eval_from_train=True, curriculum={**ON, "max_operands": tops, "window": 1})
    held = set(operands(task.eval_prompts()))
    assert len(held) == 200
    every = {(a, b) for a in range(tops[-1] + 1) for b in range(tops[-1] + 1)}
    for level, top in enumerate(tops):
        assert task.level == level
        expected = {(a, b) for a, b in every if max(a, b) <= top} - held  # the level's training pairs
        assert set(task._level_pairs[level]) == expected and len(task._level_pairs[level]) == len(expected)
        drawn = set(operands(draw(task, n=4 * len(expected) + 200, seed=level)))
        assert drawn <= expected and not drawn & held
        task.observe(level, {task.name: [1]})
    assert task._level_pairs[-1] == task._train_pairs  # the last level trains on every pair


# ---- state -------------------------------------------------------------------------------------------
def test_a_task_restored_from_the_state_moves_and_draws_as_the_uninterrupted_one():
    outcomes = [[1, 1, 1], [1, 0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1], [1] * 8, [1, 0] * 4]
    straight = ArithmeticTask(curriculum={**ON, "lower_below": 0.3})
    for step, o in enumerate(outcomes[:3]):
        straight.observe(step, {"arithmetic": o})
    state = json.loads(json.dumps(straight.state_dict()))  # plain values only
    assert state == straight.state_dict() and state["curriculum"]["levels"] == {"arithmetic": 1}
    resumed = ArithmeticTask(curriculum={**ON, "lower_below": 0.3})
    resumed.load_state_dict(state)
    assert digest(resumed.prompts_for_step(3, 64, seed=5)) == digest(straight.prompts_for_step(3, 64, seed=5))
    for step, o in enumerate(outcomes[3:], start=3):
        assert resumed.observe(step, {"arithmetic": o}) == straight.observe(step, {"arithmetic": o})
        assert digest(resumed.prompts_for_step(step + 1, 64, seed=5)) == digest(
            straight.prompts_for_step(step + 1, 64, seed=5)
        )
    assert resumed.state_dict() == straight.state_dict()


def test_an_empty_state_or_one_without_a_curriculum_starts_at_level_0():
    task = ArithmeticTask(curriculum=ON)
    task.load_state_dict({})
    task.load_state_dict(ArithmeticTask().state_dict())  # a checkpoint of a run without the curriculum
    assert task.level == 0
    ArithmeticTask().load_state_dict(ArithmeticTask(curriculum=ON).state_dict())  # off: ignored


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"levels": {"chat_arithmetic": 1}, "recent": {}, "last_step": 3}, "task.name=arithmetic"),
        ({"levels": {"arithmetic": 5}, "recent": {}, "last_step": 3}, r"task\.curriculum\.max_operands"),
    ],
)
def test_a_checkpoint_of_another_curriculum_is_refused(state, match):
    with pytest.raises(ConfigError, match=match):
        ArithmeticTask(curriculum=ON).load_state_dict({"curriculum": state})


def test_run_facts_state_the_levels_and_the_rule():
    facts = ArithmeticTask(curriculum={**ON, "lower_below": 0.2}).run_facts()
    assert facts == {
        "curriculum": "operands up to 9, 19, 29 by level; raise at >= 0.75 over 8 samples, lowered under 0.2"
    }


def test_the_curriculum_leaves_the_tiny_models_warm_start_alone(make_config):
    """The cache key ignores `task.curriculum` (a reward-only key), so the warm start must not depend on
    it: every training pair, at any level."""
    off = make_config("task=arithmetic")
    on = make_config("task=arithmetic", "task.curriculum.enabled=true", "task.curriculum.max_operands=[9,29]")
    assert tiny_cache_key(on.model.tiny, on.task) == tiny_cache_key(off.model.tiny, off.task)
    task = instantiate(on.task)
    task.observe(0, {"arithmetic": [1] * 64})
    assert task.level == 1
    examples = task.sft_examples(256, rng=np.random.default_rng(7))
    assert examples == instantiate(off.task).sft_examples(256, rng=np.random.default_rng(7))
    task.curriculum.levels["arithmetic"] = 0
    assert task.sft_examples(256, rng=np.random.default_rng(7)) == examples


# ---- bad settings ------------------------------------------------------------------------------------
def _held_out_zero_seed() -> int:
    """An eval_seed whose held-out set has 0+0, the only pair of a level bounded at 0."""
    return next(
        s for s in range(1000) if "0+0=" in {p.text for p in ArithmeticTask(eval_seed=s).eval_prompts()}
    )


@pytest.mark.parametrize(
    ("curriculum", "match"),
    [
        ({"enable": True}, r"^task\.curriculum\.enable is not a curriculum setting"),
        ({"enabled": "yes", "max_operands": [9, 29]}, r"^task\.curriculum\.enabled='yes'"),
        ({"enabled": True}, r"^task\.curriculum\.enabled=true needs task\.curriculum\.max_operands"),
        (
            {"enabled": True, "max_operands": 29},
            r"^task\.curriculum\.max_operands=29 must be a non-empty list",
        ),
        ({"enabled": True, "max_operands": []}, r"^task\.curriculum\.max_operands=\[\] must be a non-empty"),
        ({"enabled": True, "max_operands": [9, 9.5, 29]}, r"list of ints"),
        (
            {"enabled": True, "max_operands": [19, 9, 29]},
            r"max_operands=\[19, 9, 29\] must be strictly ascending",
        ),
        ({"enabled": True, "max_operands": [9, 19]}, r"must end at task\.max_operand=29"),
        ({"enabled": True, "max_operands": [9, 19, 39]}, r"must end at task\.max_operand=29"),
        ({"enabled": True, "max_operands": [2, 29]}, r"below task\.min_operand=3"),
        ({**ON, "window": 0}, r"^task\.curriculum\.window=0"),
        ({**ON, "raise_above": 0.0}, r"^task\.curriculum\.raise_above=0\.0"),
        ({**ON, "lower_below": 0.9}, r"^task\.curriculum\.lower_below=0\.9"),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_setting(curriculum, match):
    min_operand = 3 if "below task" in match else 0
    with pytest.raises(ConfigError, match=match) as err:
        ArithmeticTask(min_operand=min_operand, curriculum=curriculum)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("curriculum", "match"),
    [
        ({"window": 32}, r"^task\.curriculum\.enabled=true needs task\.curriculum\.max_operands"),
        ({"max_operands": [9, 29]}, r"must end at task\.max_operand=49,.*max_operands=\[24,49\]"),
        ({"max_operands": [9, 49], "extra": 1}, r"^task\.curriculum\.extra is not a curriculum setting"),
    ],
)
def test_the_chat_task_checks_its_settings_the_same_way(curriculum, match):
    with pytest.raises(ConfigError, match=match):
        ChatArithmeticTask(curriculum={"enabled": True, **curriculum})


def test_a_level_left_no_training_pair_is_an_error():
    seed = _held_out_zero_seed()
    cur = {"enabled": True, "max_operands": [0, 29]}
    with pytest.raises(
        ConfigError, match=r"task\.curriculum\.max_operands\[0\]=0 leaves level 0 no training"
    ):
        ArithmeticTask(eval_seed=seed, exclude_eval_from_train=True, curriculum=cur)
    assert ArithmeticTask(eval_seed=seed, curriculum=cur)._level_pairs[0] == [
        (0, 0)
    ]  # held out, not excluded


# ---- configs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "cls", "tops"),
    [
        (("task=arithmetic", "task.curriculum.max_operands=[9,19,29]"), ArithmeticTask, [9, 19, 29]),
        (("task=arithmetic_offset", "task.curriculum.max_operands=[9,29]"), ArithmeticTask, [9, 29]),
        (("task=chat_arithmetic", "task.curriculum.max_operands=[9,19,49]"), ChatArithmeticTask, [9, 19, 49]),
        (
            ("experiment=smollm2_arithmetic", "task.curriculum.max_operands=[9,19,49]"),
            ChatArithmeticTask,
            [9, 19, 49],
        ),
    ],
)
def test_the_configs_compose_with_the_curriculum_on_and_instantiate(make_config, overrides, cls, tops):
    cfg = make_config(*overrides, "task.curriculum.enabled=true", "task.curriculum.window=16")
    task = instantiate_unwrapped(cfg.task)
    assert type(task) is cls and task.max_operands == tops and task.curriculum.window == 16
    assert task.curriculum.raise_above == 0.75 and task.curriculum.lower_below is None
    assert max(x for pair in operands(draw(task)) for x in pair) <= tops[0]
    default = instantiate_unwrapped(make_config(overrides[0]).task)
    assert default.curriculum is None  # off by default


def test_enabled_without_max_operands_fails_when_the_task_is_built(make_config):
    cfg = make_config("task=arithmetic", "task.curriculum.enabled=true")
    with pytest.raises(ConfigError, match=r"task\.curriculum\.max_operands"):
        instantiate_unwrapped(cfg.task)


def test_the_long_sums_tasks_have_no_curriculum_and_refuse_one(make_config):
    for name in ("long_sums", "chat_long_sums"):
        with pytest.raises(ConfigCompositionException):
            make_config(f"task={name}", "task.curriculum.enabled=true")
        cfg = make_config(f"task={name}", "+task.curriculum.enabled=true")
        with pytest.raises(InstantiationException, match="curriculum"):
            instantiate_unwrapped(cfg.task)


# ---- the run summary ---------------------------------------------------------------------------------
def test_the_summary_shows_a_single_source_tasks_levels(tmp_path):
    """A task of one source logs no per-source held-out accuracy, so its levels get a row of their own."""
    summary = RunSummary(str(tmp_path))
    summary.history = {
        "val/accuracy": [(0, 0.2), (4, 0.5)],
        "curriculum/level/arithmetic": [(0, 0.0), (1, 1.0), (2, 1.0), (3, 2.0)],
    }
    text = summary.markdown(defaultdict(lambda: math.nan))
    assert "| arithmetic: curriculum level (first -> last steps) | 0 -> 2 |" in text
    summary.history["val/accuracy/arithmetic"] = [(0, 0.2), (4, 0.5)]  # a source with its own row
    text = summary.markdown(defaultdict(lambda: math.nan))
    assert "curriculum level (first" not in text and "reward (first -> last steps); level |" in text

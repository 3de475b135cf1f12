"""The curriculum rule (`loorl.tasks.curriculum`): hand-computed moves, its window, its floors, a
step seen twice, and its state through a checkpoint's plain values."""

from __future__ import annotations

import pytest

from loorl.errors import ConfigError
from loorl.tasks.curriculum import Curriculum


def make(**overrides) -> Curriculum:
    spec = {"levels": {"a": 0, "b": 2}, "max_levels": {"a": 3, "b": 4}, "window": 4, "raise_above": 0.75}
    return Curriculum(**{**spec, **overrides})


def test_a_level_rises_at_the_step_whose_window_reaches_the_threshold_and_the_window_empties():
    c = make()
    assert c.observe(0, {"a": [1, 1, 0]}) == {}  # 3 samples: the window of 4 is not full yet
    assert c.observe(1, {"a": [1]}) == {"a": 1}  # [1, 1, 0, 1]: 3/4 = 0.75 >= 0.75
    assert c.levels == {"a": 1, "b": 2} and c.recent["a"] == []
    assert c.observe(2, {"a": [1, 1, 1, 0, 0]}) == {}  # the last 4: [1, 1, 0, 0] = 0.5
    assert c.recent["a"] == [1, 1, 0, 0]
    assert c.observe(3, {"a": [1, 1]}) == {}  # the newest 4: [0, 0, 1, 1] = 0.5
    assert c.observe(4, {"a": [1]}) == {"a": 2}  # [0, 1, 1, 1] = 0.75


def test_the_window_holds_the_newest_samples_only():
    c = make()
    c.observe(0, {"a": [0, 0, 0, 0, 0, 0]})  # full, 0.0: no lowering without lower_below
    assert c.levels["a"] == 0 and c.recent["a"] == [0, 0, 0, 0]
    assert c.observe(1, {"a": [1, 1, 1]}) == {"a": 1}  # newest 4: [0, 1, 1, 1] = 0.75


def test_lowering_stops_at_the_starting_level_and_the_top_level_holds():
    c = make(lower_below=0.3)
    assert c.observe(0, {"b": [0, 0, 0, 1]}) == {}  # 0.25 < 0.3, but 2 is b's starting level: its floor
    c.levels["b"] = 4
    assert c.observe(1, {"b": [0, 0, 0, 0]}) == {"b": 3}
    assert c.observe(2, {"b": [1, 1, 1, 1]}) == {"b": 4}
    assert c.observe(3, {"b": [1, 1, 1, 1]}) == {}  # 4 is b's top level
    assert c.levels["b"] == 4


def test_a_step_observed_again_changes_nothing_and_unknown_sources_are_ignored():
    c = make()
    c.observe(5, {"a": [1, 1, 1, 1]})
    before = c.state_dict()
    assert c.observe(5, {"a": [0, 0, 0, 0]}) == {}  # a further dynamic-sampling round of step 5
    assert c.observe(4, {"a": [1, 1, 1, 1]}) == {}  # an older step
    assert c.observe(6, {"zzz": [1, 1, 1, 1]}) == {}  # a source without a level
    assert c.state_dict()["levels"] == before["levels"] and c.state_dict()["recent"] == before["recent"]


def test_the_state_round_trips_through_plain_values_and_resumes_the_same_moves():
    straight, resumed = make(lower_below=0.2), make(lower_below=0.2)
    outcomes = [{"a": [1, 0, 1]}, {"a": [1, 1], "b": [0, 0, 0, 0]}, {"a": [1, 1, 1, 0]}, {"a": [1, 1, 1, 1]}]
    for step, o in enumerate(outcomes[:2]):
        straight.observe(step, o)
    state = straight.state_dict()
    assert all(isinstance(v, (int, list, dict)) for v in state.values())
    resumed.load_state_dict(state)
    moves_straight = [straight.observe(s, o) for s, o in enumerate(outcomes) if s >= 2]
    moves_resumed = [resumed.observe(s, o) for s, o in enumerate(outcomes) if s >= 2]
    assert moves_straight == moves_resumed and straight.state_dict() == resumed.state_dict()


def test_a_checkpoint_with_a_source_the_task_lacks_is_refused():
    with pytest.raises(ConfigError, match="resume with the task it was trained with"):
        make().load_state_dict({"levels": {"zzz": 1}, "recent": {}, "last_step": 0})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [({"window": 0}, "window"), ({"raise_above": 0.0}, "raise_above"), ({"lower_below": 0.9}, "lower_below")],
)
def test_bad_settings_are_one_line_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        make(**overrides)

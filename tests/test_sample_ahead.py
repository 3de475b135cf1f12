"""Bounded staleness on the tiny model, without a trainer: what the task observes (`Task.observe`, a
curriculum's input) of the rollouts sampled ahead (`loorl.rollout.sample_ahead`): each rollout when its
step trains on it, never one dropped for staleness, and the same across a checkpoint."""

from __future__ import annotations

import pytest

from fixtures import tiny_parts
from loorl.build import build_datamodule


@pytest.fixture(scope="module")
def tiny(quick_config):
    return tiny_parts(quick_config())


def _recording_task(task):
    class RecordingTask(type(task)):
        """Keeps every (step, outcomes) it observes, in its state as a curriculum keeps its window."""

        seen: list

        def observe(self, step, outcomes):
            self.seen.append((step, outcomes))
            return {}

        def state_dict(self):
            return {"seen": [[s, o] for s, o in self.seen]}

        def load_state_dict(self, state):
            self.seen = [(s, o) for s, o in state.get("seen", [])]

    recording = RecordingTask(max_operand=29, eval_size=40)
    recording.seen = []
    return recording


def _datamodule(quick_config, tiny, max_staleness: int):
    _, task, path, tok, model = tiny
    recording = _recording_task(task)
    cfg = quick_config(f"rollout.max_staleness={max_staleness}", "rl.steps=8")
    dm = build_datamodule(cfg, recording, tok, path)
    dm.engine.sync(model)
    return dm, recording


def _outcomes(rollout) -> list[int]:
    correct = rollout.batch.correct  # [N]
    return [int(v) for v in correct[~correct.isnan()].tolist()]


def test_a_rollout_sampled_ahead_is_observed_when_its_step_trains_on_it(quick_config, tiny):
    """Steps 2 and 3 were asked for (max_staleness=2) and are in the checkpoint, unobserved; a resume
    at the same bound observes step 2's rollout, with its own outcomes, when step 2 takes it."""
    dm, task = _datamodule(quick_config, tiny, 2)
    trained = [dm.rollout_for_step(step) for step in (0, 1)]
    assert [s for s, _ in task.seen] == [0, 1]
    assert [o[task.name] for _, o in task.seen] == [_outcomes(r) for r in trained]
    state = dm.state_dict()
    assert sorted(state["pending_by_rank"][0]) == [2, 3]
    assert [s for s, _ in task.seen] == [0, 1]  # the checkpoint grades them and observes neither

    resumed, again = _datamodule(quick_config, tiny, 2)
    resumed.load_state_dict(state)
    rollout = resumed.rollout_for_step(2)
    assert rollout.policy_lag == 2 and rollout.stats["staleness/dropped_samples"] == 0
    assert [s for s, _ in again.seen] == [0, 1, 2] and again.seen[-1][1][task.name] == _outcomes(rollout)


def test_a_rollout_dropped_for_staleness_is_never_observed_and_its_replacement_is(quick_config, tiny):
    """Resumed at max_staleness=1, step 2's rollout sampled ahead two versions old is dropped: the task
    observes step 2 once, with the outcomes of the rollout sampled again with step 2's weights."""
    dm, _ = _datamodule(quick_config, tiny, 2)
    for step in (0, 1):
        dm.rollout_for_step(step)
    state = dm.state_dict()
    stale = state["pending_by_rank"][0][2]
    resumed, task = _datamodule(quick_config, tiny, 1)
    resumed.load_state_dict(state)
    rollout = resumed.rollout_for_step(2)
    assert stale["policy_version"] == 0 and rollout.policy_lag == 0  # sampled again, with step 2's weights
    assert rollout.stats["staleness/dropped_samples"] == stale["batch"]["rewards"].numel() > 0
    assert [s for s, _ in task.seen] == [0, 1, 2]  # steps 0 and 1 from the checkpoint, 2 once
    assert task.seen[-1][1][task.name] == _outcomes(rollout)  # the replacement's, not the dropped one's

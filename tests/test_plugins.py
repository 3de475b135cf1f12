"""Extending loorl from outside `src/`: a new estimator, a new policy loss and a new rollout engine,
each named by a `_target_` setting and defined in tests/plugins/ (nothing under src/ names them)."""

from __future__ import annotations

import csv
import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loorl.algo import estimators
from loorl.algo.estimators import AdvantageInput
from loorl.algo.objectives import loss_names, policy_loss, token_loss_of
from loorl.config import check_config
from loorl.errors import ConfigError
from loorl.types import RolloutBatch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def plugin_env(**extra: str) -> dict[str, str]:
    """The environment of a `python src/train.py` that can import tests/plugins (and nothing else new)."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def train_cli(tmp_path: Path, model_cache: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "src/train.py", "debug=quick", "rollout=hf", f"model.cache_dir={model_cache}",
               "rl.steps=2", "val_every=2", "val_pass_k=0", "checkpoint_every=0", "export_policy=false",
               f"hydra.run.dir={tmp_path / 'run'}", *overrides]  # fmt: skip
    return subprocess.run(
        command, cwd=ROOT, env=plugin_env(**env), capture_output=True, text=True, timeout=600
    )


def train_here(tmp_path: Path, quick_config, *overrides: str) -> dict[str, float]:
    """`train_cli`'s run in this process (tests/ is on its path, so `plugins.` imports as the CLI's
    PYTHONPATH makes it): the plug-in APIs are the same, without another interpreter's 10 s start."""
    from loorl.cli.train import train

    return train(quick_config("rl.steps=2", "val_every=2", "val_pass_k=0", "checkpoint_every=0",
                              "export_policy=false", *overrides, output_dir=tmp_path / "run"))  # fmt: skip


def test_estimator_and_loss_from_outside_src_train_two_steps(tmp_path, quick_config, monkeypatch):
    """`python src/train.py estimator._target_=plugins.research.length_normalised_rloo
    loss._target_=plugins.research.dual_clip_token_loss`: both run at every step, and the run finishes.
    Two optimizer steps per rollout, so the loss's ratio is a real one (old log-probs recomputed)."""
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("LOORL_PLUGIN_CALLS", str(calls))
    train_here(
        tmp_path, quick_config,
        "estimator._target_=plugins.research.length_normalised_rloo",
        "loss._target_=plugins.research.dual_clip_token_loss",
        "rl.epochs_per_rollout=2",
    )  # fmt: skip
    seen = calls.read_text().split()
    assert seen.count("estimator") == 2  # once per RL step
    assert seen.count("loss") >= 4  # at least once per optimizer step: 2 steps x 2 epochs
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [step for step, _ in metrics["history"]["train/loss"]] == [0, 1]
    assert "length_normalised_rloo on arithmetic" in (tmp_path / "run" / "summary.md").read_text()


def test_a_bad_target_is_one_line_before_any_model_loads(quick_cfg):
    for key, path in (("estimator", "plugins.research.no_such_fn"), ("loss", "nowhere.at_all.fn")):
        with pytest.raises(ConfigError) as err:
            check_config(quick_cfg(f"{key}._target_={path}"))
        message = str(err.value)
        assert message.startswith(f"{key}._target_={path} cannot be imported (") and "\n" not in message


def test_unknown_loss_name_lists_the_registered_ones(quick_cfg):
    with pytest.raises(
        ConfigError,
        match=r"unknown policy loss 'ppo' \(loss.name\); choose one of: auto, cispo, clip_cov, clipped,",
    ):
        check_config(quick_cfg("loss.name=ppo"))


def test_a_target_estimator_keeps_its_minimum_group_size(quick_cfg):
    """The plug-in declares min_group_size=2: K=1 is refused as for RLOO."""
    with pytest.raises(ConfigError, match="too small for estimator=length_normalised_rloo"):
        check_config(quick_cfg("estimator._target_=plugins.research.length_normalised_rloo",
                               "rl.samples_per_prompt=1"))  # fmt: skip


@pytest.mark.parametrize("name", estimators.names())
def test_a_missing_sample_counts_as_an_unscorable_one(name):
    """Uneven groups: `mask` False on a sample gives the same advantages as a NaN reward there."""
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(5, 4, generator=g)  # [B, K]
    mask = torch.ones(5, 4, dtype=torch.bool)
    mask[0, 3] = mask[2, 1] = mask[2, 2] = False  # groups of 3, 2 and 4 samples
    with_nan = torch.where(mask, rewards, torch.nan)
    lengths = torch.arange(20).view(5, 4) % 3 + 1  # [B, K] OPO weighs its baseline by length
    extra = {"baselines": torch.rand(5, generator=g),  # [B] ReMax's greedy rewards
             "parts": torch.stack([rewards, (lengths % 2).float()], dim=-1)}  # [B, K, 2] GDPO's  # fmt: skip
    nan_parts = torch.where(mask.unsqueeze(-1), extra["parts"], torch.nan)  # [B, K, 2]
    for whiten in (False, True):
        masked = estimators.get(name)(
            AdvantageInput(rewards, lengths=lengths, mask=mask, **extra), whiten=whiten
        )
        nan = estimators.get(name)(AdvantageInput(with_nan, lengths=lengths, **{**extra, "parts": nan_parts}),
                                   whiten=whiten)  # fmt: skip
        torch.testing.assert_close(masked, nan)
        assert (masked[~mask] == 0).all()


def _batch(n=4, c=3, old_shift=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, c, generator=g) - 0.1  # [n, C]
    return logp, RolloutBatch(
        input_ids=torch.zeros(n, c + 1, dtype=torch.long), attention_mask=torch.ones(n, c + 1),
        completion_mask=torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])[:n],
        sampler_logprobs=logp.clone(), rewards=torch.zeros(n), samples_per_prompt=2, prompt_len=1,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])[:n],
        old_logprobs=None if old_shift is None else logp + old_shift,
    )  # fmt: skip


@pytest.mark.parametrize("old_shift", [None, 0.3])
def test_the_auto_loss_is_reinforce_on_policy_and_clipped_off_policy(quick_cfg, old_shift):
    """`loss.name=auto` (the default) gives exactly the losses and gradients of the loss it stands for."""
    s = check_config(quick_cfg()).loss
    assert s.name == "auto" and {"auto", "clipped", "reinforce"} <= set(loss_names())
    expected = "reinforce" if old_shift is None else "clipped"
    results = []
    for loss_fn in (token_loss_of("auto"), token_loss_of(expected)):
        logp, batch = _batch(old_shift=old_shift)
        logp.requires_grad_(True)
        loss, _ = policy_loss(logp, batch, settings=s, num_tokens=9.0, num_seqs=4, token_loss=loss_fn)
        loss.backward()
        results.append((loss.detach(), logp.grad))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_clipped_on_policy_has_the_reinforce_gradient(quick_cfg):
    """At ratio 1 the clipped surrogate's gradient is REINFORCE's (its value is not: -A, not -A log pi)."""
    s = check_config(quick_cfg()).loss
    grads = []
    for name in ("reinforce", "clipped"):
        logp, batch = _batch()
        logp.requires_grad_(True)
        policy_loss(logp, batch, settings=s, num_tokens=9.0, num_seqs=4, token_loss=token_loss_of(name))[
            0
        ].backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0].abs().sum() > 0


def test_an_engine_from_outside_src_trains_two_steps(tmp_path, quick_config, monkeypatch, caplog):
    """`python src/train.py rollout._target_=plugins.engines.GenerateEngine`: a third engine that gets
    the weights only as streamed (name, tensor) pairs. Its log-probs match the trainer's at both steps,
    so the second step sampled from the updated weights (a stale copy would show a gap)."""
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("LOORL_PLUGIN_CALLS", str(calls))
    with caplog.at_level(logging.INFO, logger="loorl"):
        train_here(
            tmp_path, quick_config,
            "rollout._target_=plugins.engines.GenerateEngine", "+rollout.options.batch_size=4",
        )  # fmt: skip
    assert "rollout engine: generate (rollout._target_=plugins.engines.GenerateEngine)" in caplog.text
    seen = calls.read_text().split()
    assert seen.count("sync") >= 4 and seen.count("generate") >= 4  # 2 rollouts and 2 validations at least
    history = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"]
    gaps = [value for _, value in history["train/sampler_logratio_max"]]
    assert len(gaps) == 2 and max(gaps) < 1e-3, gaps
    assert [step for step, _ in history["val/accuracy"]] == [0, 2]


def test_an_engine_checks_its_own_options_before_any_model_loads(quick_cfg):
    with pytest.raises(ConfigError, match=r"rollout.options.beams is not an option of GenerateEngine"):
        check_config(quick_cfg("rollout._target_=plugins.engines.GenerateEngine", "+rollout.options.beams=2"))


def test_a_target_that_is_not_an_engine_is_refused(quick_cfg):
    with pytest.raises(ConfigError, match="is not a RolloutEngine subclass"):
        check_config(quick_cfg("rollout._target_=plugins.research.dual_clip_token_loss"))


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_built_in_engine_refuses_plug_in_options(quick_cfg, engine):
    """`rollout.options` belongs to a `_target_` engine: a built-in one says so instead of ignoring it."""
    with pytest.raises(ConfigError, match=rf"rollout.options.beams is set, but the {engine} engine takes no"):
        check_config(quick_cfg(f"rollout={engine}", "+rollout.options.beams=2"))


DOC_EXAMPLES = ROOT / "docs" / "examples"


def doc_example(name: str):
    """The module `docs/examples/<name>.py`, imported as the docs' `PYTHONPATH=docs/examples` does."""
    sys.path.insert(0, str(DOC_EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(DOC_EXAMPLES))


def test_the_docs_task_and_reward_examples_train_two_steps(tmp_path, model_cache):
    """docs/extending's worked task and reward (docs/examples/my_task.py, my_reward.py), as the pages
    run them: `PYTHONPATH=docs/examples python src/train.py task._target_=my_task.LastDigitSums
    '+reward.functions.digit=...'`. The task's rewards are its own (half credit for the last digit),
    and the reward function runs beside the verifier at both steps."""
    last_digit_credit = doc_example("my_reward").last_digit_credit
    LastDigitSums = doc_example("my_task").LastDigitSums
    task = LastDigitSums(eval_size=5)
    prompt = task._prompt(17, 25)
    assert (prompt.text, prompt.answer) == ("17+25=", "42")
    assert [task.grade(prompt, c) for c in ("42", " 32", "41")] == [(1.0, True), (0.5, False), (0.0, False)]
    assert last_digit_credit(["17+25="] * 3, ["42", "12", ""], a=[17] * 3, b=[25] * 3) == [1.0, 1.0, None]
    done = train_cli(
        tmp_path, model_cache,
        "task._target_=my_task.LastDigitSums",
        "+reward.functions.digit={fn: {_target_: my_reward.last_digit_credit, _partial_: true}, weight: 0.5}",
        PYTHONPATH=os.pathsep.join([str(DOC_EXAMPLES), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    history = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"]
    assert [step for step, _ in history["rollout/reward_digit"]] == [0, 1]
    with open(tmp_path / "run" / "samples.csv") as f:  # each sample's reward: the task's plus 0.5 x digit's
        rows = list(csv.DictReader(f))
    assert rows
    for row in rows:
        a, b = map(int, row["prompt"].rstrip("=").split("+"))
        credit = last_digit_credit([row["prompt"]], [row["completion"]], a=[a], b=[b])[0] or 0.0
        expected = task.reward(task._prompt(a, b), row["completion"]) + 0.5 * credit
        assert float(row["reward"]) == pytest.approx(expected), row


def test_the_docs_curriculum_task_moves_its_level_through_the_task_hooks(tmp_path, model_cache):
    """docs/extending/task.md's worked curriculum task (docs/examples/growing_sums.py), one source and no
    `source_names`: every step's outcomes reach its `observe`, so its level moves (a window of the
    step's 32 samples, raised by any correct one, two levels) and is in the checkpoint (`state_dict`);
    restored from it (`load_state_dict`, as a resume does), the task draws the new level's prompts.
    Before the hooks were declared on Task, a task without `source_names` was never observed and
    stayed at level 0."""
    done = train_cli(
        tmp_path, model_cache,
        "task._target_=growing_sums.GrowingSums", "+task.max_operands=[9,19]", "+task.window=32",
        "+task.raise_above=0.01", "checkpoint_every=2",
        PYTHONPATH=os.pathsep.join([str(DOC_EXAMPLES), os.environ.get("PYTHONPATH", "")]),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    history = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"]
    assert history["rollout/accuracy"][0][1] > 0  # the warm-started policy got some of level 0 right
    assert history["curriculum/level/arithmetic"] == [[0, 1.0], [1, 1.0]]  # (the config's task name)
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    task_state = [v["task"] for v in state.values() if isinstance(v, dict) and "task" in v]
    assert [t["levels"] for t in task_state] == [{"arithmetic": 1}]
    GrowingSums = doc_example("growing_sums").GrowingSums

    def operands(task) -> list[int]:
        prompts = task.prompts_for_step(2, 64, seed=0)
        return [int(x) for p in prompts for x in p.text.rstrip("=").split("+")]

    fresh, resumed = (
        GrowingSums(name="arithmetic", max_operands=(9, 19)),
        GrowingSums(name="arithmetic", max_operands=(9, 19)),
    )
    resumed.load_state_dict(task_state[0])  # as a resume does: the next prompts come from level 1
    assert max(operands(fresh)) <= 9 < max(operands(resumed)) <= 19

"""`experiment=tiny_reasoning_gym` end to end on the quick profile: every logged reward is
reasoning-gym's own score of the extracted answer, the curriculum moves at the steps its rule says,
and a run killed with SIGKILL resumes to the same run, curriculum levels included."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import ON_CPU, assert_same_run, child_env, start_and_signal

rg = pytest.importorskip("reasoning_gym")
from hydra.utils import instantiate  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("chain_sum", "letter_counting")
PER_STEP = 16  # a dataset's samples in a step: 8 prompts x K=4 over 2 datasets
RAISE = 0.05  # low: a level moves in the first steps, before the checkpoint the kill test resumes from
RUN = [
    "rl.steps=6",
    "checkpoint_every=2",
    "val_every=3",
    "sample_rows=-1",
    "task.scoring=library",
    "task.eval_size=12",
    f"task.curriculum.window={PER_STEP}",
    f"task.curriculum.raise_above={RAISE}",
    # the warm start on batches of 16, not 64: reasoning-gym's prompts run to ~120 tokens, so the quick
    # profile's 150 steps took 81 of the run's 98 s alone; on 16 the model still answers 29% of the held-out
    # problems at step 0 and the curriculum moves (a later level in 2 of 2 datasets by step 6)
    "model.tiny.warm_start.batch_size=16",
]


def command(run: Path, cache: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(ROOT / "src" / "train.py"), "debug=quick", "experiment=tiny_reasoning_gym",
            f"model.cache_dir={cache}", *ON_CPU, *RUN, f"hydra.run.dir={run}", *overrides]  # fmt: skip


def train(cmd: list[str]) -> None:
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, model_cache) -> Path:
    run = tmp_path_factory.mktemp("rg") / "run"
    train(command(run, model_cache))
    return run


def series(run: Path, key: str) -> list[float]:
    """A metric's values at every step, from the run's metrics.json."""
    return [float(v) for _, v in json.loads((run / "metrics.json").read_text())["history"][key]]


def test_every_logged_reward_is_reasoning_gyms_own_score_of_the_extracted_answer(straight):
    cfg = OmegaConf.load(straight / ".hydra" / "config.yaml").task
    task = instantiate(cfg)  # the run's own task: its held-out problems, by prompt text
    by_text = {p.text: p for p in task.eval_prompts()}
    rows = list(csv.DictReader((straight / "samples.csv").open()))
    assert len(rows) == 3 * len(by_text)  # steps 0, 3 and 6, every held-out problem
    for row in rows:
        prompt = by_text[row["prompt"]]
        name, entry = prompt.meta["source"], prompt.meta["entry"]
        answer = rg.utils.extract_answer(row["completion"], tag_name="answer")
        score = rg.create_dataset(name, **OmegaConf.to_container(cfg.datasets[name].config), seed=1, size=1)
        assert float(row["reward"]) == score.score_answer(answer, entry), row
        assert int(row["correct"]) == (score.score_answer(answer, entry) == 1.0)


def test_the_curriculum_raises_a_level_at_the_steps_its_rule_says(straight):
    """The window is one step's samples of a dataset, so a level rises after step s exactly when step
    s's rolling accuracy (all PER_STEP samples scorable) is at or above the threshold."""
    moves = 0
    for name in SOURCES:
        accuracy = series(straight, f"rollout/accuracy/{name}")
        levels = series(straight, f"curriculum/level/{name}")
        expected, level = [], 0
        for acc in accuracy:
            level += acc >= RAISE
            expected.append(float(level))
        assert levels == expected, (name, accuracy, levels)
        moves += int(levels[-1])
        row = f"| {name}: held-out accuracy; reward (first -> last steps); level |"
        assert row in (straight / "summary.md").read_text()
    assert moves > 0  # the rule was exercised, not only its absence


# slow: the default suite keeps a curriculum's levels in the checkpoint and restored from it
# (tests/test_plugins.py's docs curriculum task) and kill -9 resumes (tests/test_resume.py)
@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_run_curriculum_levels_included(straight, tmp_path, model_cache):
    run = tmp_path / "run"
    first = run / "checkpoints" / "epoch=3-step=4.ckpt"
    killed = start_and_signal(command(run, model_cache), first, signal.SIGKILL, env=child_env())
    assert killed.returncode == -signal.SIGKILL
    train(command(run, model_cache, "resume_from=auto"))
    # a level had moved by the checkpoint (steps 0 to 3): the resume restored it, not the start's
    assert any(series(straight, f"curriculum/level/{name}")[3] > 0 for name in SOURCES)
    assert_same_run(straight, run)

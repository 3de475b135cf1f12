"""Shared fixtures: Hydra composition and a small tiny-model config that builds in seconds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from loorl.config import CONF_DIR

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A quick version of the default run: a shorter warm start, fewer and smaller RL steps.
QUICK = [
    "model.tiny.warm_start.steps=150",
    "rl.steps=4",
    "rl.prompts_per_step=8",
    "rl.prompts_per_minibatch=8",
    "rl.prompts_per_microbatch=8",
    "rl.samples_per_prompt=4",
    "val_every=2",
    "task.eval_size=40",
    "checkpoint_every=2",
    "trainer.enable_progress_bar=false",
]


def compose_cfg(overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides or []))


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One cache for the session: the quick tiny model is built once and reused by every test."""
    return tmp_path_factory.mktemp("model_cache")


@pytest.fixture
def quick_cfg(model_cache, tmp_path):
    """Compose the quick config; extra overrides win."""

    def make(*extra: str):
        return compose_cfg(
            [*QUICK, f"model.cache_dir={model_cache}", f"output_dir={tmp_path / 'run'}", *extra]
        )

    return make

"""Which computations of a rollout run under the trainer's autocast (bf16-mixed).

Only an engine that samples with the live policy (`generates_in_trainer_precision`: the HF engine)
generates under it, as training_step computes; an engine with its own weights and dtype (vLLM) does
not, and neither does grading: a float32 reward model scores in float32.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from fixtures import tiny_parts, tiny_reward_model
from loorl.build import build_datamodule
from loorl.rewards import RewardComposer, WeightedReward
from loorl.rewards.model import RewardModel
from loorl.rollout.engines.base import RolloutEngine
from loorl.rollout.engines.hf_engine import HFEngine
from loorl.rollout.engines.vllm_engine import VLLMEngine
from loorl.types import Completion


@pytest.fixture(scope="module")
def tiny(quick_config):
    return tiny_parts(quick_config())


def _bf16_trainer() -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, precision="bf16-mixed", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def _autocast() -> torch.dtype | None:
    """The CPU autocast dtype in force here; None: no autocast."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _datamodule(tiny, engine=None):
    cfg, task, path, tok, _ = tiny
    dm = build_datamodule(cfg, task, tok, path)
    if engine is not None:
        dm.sampler.engine = engine
    dm.trainer = _bf16_trainer()
    dm.setup("fit")
    return dm


def test_a_float32_reward_model_scores_outside_the_autocast_the_hf_engine_samples_in(tiny, tmp_path):
    """Under bf16-mixed the HF engine's policy forwards run under bf16 autocast (as in training_step)
    and the reward model's forwards under none, for the rollout and for validation."""
    policy = tiny[4]
    rm = RewardModel(path=tiny_reward_model(tmp_path / "rm"), batch_size=8, dtype="float32")
    rm.load()
    seen: dict[str, list] = {"policy": [], "reward model": []}
    hooks = [
        policy.register_forward_pre_hook(lambda *_: seen["policy"].append(_autocast())),
        rm.model.register_forward_pre_hook(lambda *_: seen["reward model"].append(_autocast())),
    ]
    try:
        dm = _datamodule(tiny)
        assert dm.engine.name == "hf"
        dm.sampler.grader.rewards = RewardComposer([WeightedReward("rm", rm)], task=dm.task)
        dm.engine.sync(policy)
        rollout = next(iter(dm.train_dataloader()))
        assert not rollout.batch.rewards.isnan().any()  # every sample scored by the reward model
        next(iter(dm.val_dataloader()))
    finally:
        for hook in hooks:
            hook.remove()
    assert seen["policy"] and set(seen["policy"]) == {torch.bfloat16}
    assert seen["reward model"] and set(seen["reward model"]) == {None}


class RecordingEngine(RolloutEngine):
    """An engine with weights of its own (as vLLM): records the autocast each generate call runs under."""

    name = "recording"

    def __init__(self, eos: int) -> None:
        from loorl.types import SamplingConfig

        super().__init__(SamplingConfig(max_new_tokens=2), eos_token_ids=[eos], pad_token_id=0)
        self.seen: list[torch.dtype | None] = []

    def sync(self, weights, version=None, *, force=False) -> None:
        return None

    def generate(self, prompt_ids, *, n, greedy=False, seed=None):
        self.seen.append(_autocast())
        return [[Completion([self.eos_token_ids[0]], [0.0], True) for _ in range(n)] for _ in prompt_ids]


class InPrecisionEngine(RecordingEngine):
    """A plug-in engine that samples with the live policy would ask for the trainer's precision."""

    generates_in_trainer_precision = True


@pytest.mark.parametrize(
    ("engine_class", "expected"), [(RecordingEngine, None), (InPrecisionEngine, torch.bfloat16)]
)
def test_the_engine_class_decides_whether_it_generates_under_the_trainers_autocast(
    tiny, engine_class, expected
):
    engine = engine_class(eos=tiny[3].eos_token_id)
    dm = _datamodule(tiny, engine)
    next(iter(dm.train_dataloader()))
    next(iter(dm.val_dataloader()))  # greedy and sampled pass@k generation
    assert len(engine.seen) >= 2 and set(engine.seen) == {expected}


def test_only_the_hf_engine_asks_for_the_trainers_precision():
    assert RolloutEngine.generates_in_trainer_precision is False
    assert VLLMEngine.generates_in_trainer_precision is False
    assert HFEngine.generates_in_trainer_precision is True

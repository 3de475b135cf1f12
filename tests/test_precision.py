"""bf16 compute keeps float32 master weights: AdamW updates at lr 1e-6 are not rounded away."""

from __future__ import annotations

import logging

import pytest
import torch
from hydra.utils import instantiate
from safetensors.torch import load_file

from fixtures import ON_CPU
from loorl.cli.train import train
from loorl.cli.trainer_parts import trainer_precision
from loorl.errors import ConfigError
from loorl.models.tiny import ensure_tiny_model


def _policy_after_two_steps(quick_config, tmp_path, *overrides):
    """`python src/train.py model.dtype=bfloat16 optimizer.lr=1e-6 rl.steps=2 checkpoint_every=1`,
    quick-sized, on the CPU's bf16 autocast (the CUDA one: tests/test_gpu.py): the checkpoint's policy
    weights and the initial ones, by name."""
    cfg = quick_config(
        "model.dtype=bfloat16", "optimizer.lr=1e-6", "rl.steps=2", "checkpoint_every=1", *ON_CPU, *overrides,
        output_dir=tmp_path,
    )  # fmt: skip
    initial = load_file(ensure_tiny_model(cfg.model, cfg.task, instantiate(cfg.task)) / "model.safetensors")
    train(cfg)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    trained = {k.removeprefix("policy."): v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")}
    return trained, initial


def _changed_fraction(trained, initial) -> float:
    """Entries that differ from the initial weights as loaded (cast to the trained weights' dtype)."""
    changed = sum(int((trained[k] != v.to(trained[k].dtype)).sum()) for k, v in initial.items())
    return changed / sum(v.numel() for v in initial.values())


def test_bf16_compute_keeps_float32_weights_that_all_move(quick_config, tmp_path):
    trained, initial = _policy_after_two_steps(quick_config, tmp_path)
    assert {v.dtype for v in trained.values()} == {torch.float32}
    assert _changed_fraction(trained, initial) > 0.5  # measured: 99.99%


def test_pure_bf16_weights_are_an_explicit_choice_that_loses_updates(quick_config, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="loorl.training.module"):
        trained, initial = _policy_after_two_steps(quick_config, tmp_path, "model.master_dtype=bfloat16")
    assert {v.dtype for v in trained.values()} == {torch.bfloat16}
    assert any("model.master_dtype=bfloat16" in r.getMessage() for r in caplog.records)
    assert _changed_fraction(trained, initial) < 0.5  # what float32 master weights prevent


@pytest.mark.parametrize(
    ("dtype", "master", "precision"),
    [
        ("float32", "float32", "32-true"),
        ("bfloat16", "float32", "bf16-mixed"),
        ("float16", "float32", "16-mixed"),
        ("bfloat16", "bfloat16", "32-true"),  # weights already in the compute dtype: no cast
    ],
)
def test_trainer_precision_follows_compute_and_master_dtypes(quick_config, dtype, master, precision):
    cfg = quick_config(f"model.dtype={dtype}", f"model.master_dtype={master}")
    assert trainer_precision(cfg) == precision
    assert trainer_precision(quick_config("trainer.precision=bf16-true")) == "bf16-true"


@pytest.mark.parametrize("model", ["qwen05b", "qwen15b", "qwen7b", "llama8b"])
def test_gpu_model_configs_train_bf16_over_float32_weights(make_config, model):
    cfg = make_config(f"model={model}")
    assert (cfg.model.dtype, cfg.model.master_dtype) == ("bfloat16", "float32")
    assert trainer_precision(cfg) == "bf16-mixed"


def test_master_dtype_must_be_float32_or_the_compute_dtype(quick_config, tmp_path):
    cfg = quick_config("model.dtype=bfloat16", "model.master_dtype=float16", output_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"model.master_dtype=float16 .* model.master_dtype=float32"):
        train(cfg)

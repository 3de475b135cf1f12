"""Which saved policy a path holds, and whether it fits the run that loads it: an exported HF folder
(`<run>/policy`: loaded as the model) or a loorl checkpoint (`<run>/checkpoints/last.ckpt`: its weights
over the configured base model, whose identity and adapters the checkpoint must share). Read by the
evaluation (`src/eval.py policy=PATH`) and the gradient-variance probe (`--policy`)."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from loorl.errors import ConfigError
from loorl.models.sources import model_identity
from loorl.training.run_identity import IDENTITY_KEY, lora_identity


def policy_kind(policy: str) -> str:
    """`hf` (a folder with config.json) or `checkpoint` (a Lightning .ckpt file); ConfigError else."""
    path = Path(os.path.expanduser(policy))
    if not path.exists():
        raise ConfigError(f"policy={policy} does not exist: pass <run>/policy or <run>/checkpoints/last.ckpt")
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    if path.is_dir():
        raise ConfigError(
            f"policy={policy} is a folder without config.json: pass an exported policy (<run>/policy); "
            "a sharded (strategy=fsdp) checkpoint folder is not read here, its run exports <run>/policy"
        )
    return "checkpoint"


def check_checkpoint(path: Path, cfg: DictConfig, *, lora=None) -> None:
    """The checkpoint is a loorl one, one file, and was trained from the configured base model, with the
    configured adapters (`lora`: `model.lora`'s settings) if any."""
    from loorl.training.checkpoints import read_checkpoint  # (Lightning: only where a checkpoint is read)

    try:
        state = read_checkpoint(path)
    except ValueError as err:
        raise ConfigError(f"policy={path} is not a Lightning checkpoint ({err})") from None
    saved = (state.get(IDENTITY_KEY) or {}).get("load", {})
    here = model_identity(cfg.model, cfg.task)
    if saved.get("model") not in (None, here):
        raise ConfigError(
            f"policy={path} was trained from model {saved['model']!r}, this evaluation builds {here!r}: pass "
            "the model=/task= options of the run that wrote it"
        )
    if saved and saved.get("lora") != lora_identity(lora):  # (no identity: not checked, as above)
        raise ConfigError(
            f"policy={path} holds weights for model.lora {saved.get('lora')!r}, this evaluation has "
            f"{lora_identity(lora)!r}: pass the model.lora setting of the run that wrote it, or its exported "
            "<run>/policy"
        )

"""Builds the rollout engine named by `rollout.engine`."""

from __future__ import annotations

from omegaconf import DictConfig

from loorl.rollout.engine import RolloutEngine, SamplingConfig


def sampling_config(rollout_cfg: DictConfig) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=int(rollout_cfg.max_new_tokens),
        temperature=float(rollout_cfg.temperature),
        top_p=float(rollout_cfg.top_p),
        top_k=int(rollout_cfg.top_k),
    )


def build_engine(rollout_cfg: DictConfig, tokenizer) -> RolloutEngine:
    sampling = sampling_config(rollout_cfg)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if rollout_cfg.engine == "hf":
        from loorl.rollout.hf_engine import HFEngine

        return HFEngine(sampling, batch_size=int(rollout_cfg.batch_size), **ids)
    raise ValueError(f"rollout.engine={rollout_cfg.engine!r} has no engine")

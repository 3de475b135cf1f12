"""`train(cfg) -> metrics`: the whole run, separate from the `@hydra.main` wrapper so tests call it."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from loorl.callbacks import HFExport, RunSummary
from loorl.config import check_config
from loorl.errors import ConfigError
from loorl.models import load_tokenizer, resolve_model_path
from loorl.module import KLSettings, LossSettings, PolicyGradientModule
from loorl.rewards import build_composer
from loorl.rollout.datamodule import RolloutDataModule, RolloutSettings
from loorl.rollout.factory import build_engine, resolve_engine, sampling_config


def build_datamodule(cfg: DictConfig, task, tokenizer, model_path: str) -> RolloutDataModule:
    settings = RolloutSettings(
        prompts_per_step=cfg.rl.prompts_per_step,
        samples_per_prompt=cfg.rl.samples_per_prompt,
        prompts_per_minibatch=cfg.rl.prompts_per_minibatch,
        epochs_per_rollout=cfg.rl.epochs_per_rollout,
        estimator=cfg.estimator.name,
        whiten=cfg.estimator.whiten,
        truncated=cfg.rollout.truncated,
        max_prompt_length=cfg.rollout.max_prompt_length,
        eval_batch_size=cfg.rollout.eval_batch_size,
        pass_k=cfg.val_pass_k,
        seed=cfg.seed,
        groups_per_score_pass=cfg.rl.prompts_per_microbatch,
        sampler_logprobs_exact=resolve_engine(cfg.rollout.engine)[0] == "hf" and cfg.model.dtype == "float32",
    )
    engine = build_engine(
        cfg.rollout, tokenizer, model_path=model_path, model_dtype=cfg.model.dtype, seed=cfg.seed
    )
    rewards = build_composer(cfg.reward, task)
    return RolloutDataModule(
        task=task, tokenizer=tokenizer, engine=engine, settings=settings, rewards=rewards
    )


def build_module(cfg: DictConfig, model_path: str) -> PolicyGradientModule:
    return PolicyGradientModule(
        model_path=model_path,
        dtype=cfg.model.dtype,
        master_dtype=cfg.model.master_dtype,
        ref_dtype=cfg.model.ref_dtype,
        attn_implementation=cfg.model.attn_implementation,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        ref_offload=cfg.model.get("ref_offload", False),
        optimizer=instantiate(cfg.optimizer),
        sampling=sampling_config(cfg.rollout),
        loss=LossSettings(
            agg=cfg.loss.agg,
            clip_low=cfg.loss.clip_low,
            clip_high=cfg.loss.clip_high,
            ratio_level=cfg.loss.ratio_level,
            max_grad_norm=cfg.loss.max_grad_norm,
            tis_cap=cfg.loss.tis_cap,
            prompts_per_microbatch=cfg.rl.prompts_per_microbatch,
            max_len=cfg.rollout.max_new_tokens,
        ),
        kl=KLSettings(**OmegaConf.to_container(cfg.kl, resolve=True)),
    )


def trainer_precision(cfg: DictConfig) -> str:
    """Lightning's precision for `trainer.precision=auto`: from the compute and master dtypes.

    Compute below the master dtype runs under autocast (`bf16-mixed`, or `16-mixed` with a loss
    scaler); weights already in the compute dtype need no cast (`32-true` leaves them as loaded).
    """
    if cfg.trainer.precision != "auto":
        return str(cfg.trainer.precision)
    if cfg.model.dtype == cfg.model.master_dtype:
        return "32-true"
    return {"bfloat16": "bf16-mixed", "float16": "16-mixed"}[cfg.model.dtype]


def instantiate_unwrapped(node):
    """Hydra wraps exceptions raised in a target; a ConfigError must reach the user as itself."""
    from hydra.errors import InstantiationException

    try:
        return instantiate(node)
    except InstantiationException as err:
        cause = err.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise


def train(cfg: DictConfig) -> dict[str, float]:
    """Check the config, build everything, validate once (step 0), train, write the outputs."""
    check_config(cfg)
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, output_dir / "config.yaml", resolve=True)
    L.seed_everything(cfg.seed, workers=True)

    task = instantiate_unwrapped(cfg.task)
    model_path = resolve_model_path(cfg.model, cfg.task, task)
    tokenizer = load_tokenizer(model_path)
    datamodule = build_datamodule(cfg, task, tokenizer, model_path)
    module = build_module(cfg, model_path)

    summary = RunSummary(
        str(output_dir),
        title=f"{cfg.estimator.name} on {cfg.task.name} ({cfg.model.name})",
        pass_k=cfg.val_pass_k,
    )
    callbacks = [summary]
    if cfg.checkpoint_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=output_dir / "checkpoints", every_n_epochs=cfg.checkpoint_every, save_last=True
            )
        )
    if cfg.export_policy:
        callbacks.append(HFExport(str(output_dir / "policy"), tokenizer))
    loggers = [instantiate(c) for c in (cfg.logger or {}).values()]
    trainer = instantiate(
        cfg.trainer, logger=loggers or False, callbacks=callbacks, precision=trainer_precision(cfg)
    )

    trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.resume_from)
    return summary.summary(trainer)


def main(cfg: DictConfig) -> dict[str, float]:
    """The CLI: a bad setting prints one `error:` line and exits 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return train(cfg)
    except ConfigError as err:
        print(f"error: {err}")
        raise SystemExit(2) from None

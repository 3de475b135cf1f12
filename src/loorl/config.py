"""Checks on the composed config: every bad setting fails here, in one line, before any model loads."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from loorl import estimators
from loorl.errors import ConfigError
from loorl.losses import AGGREGATIONS, KL_ESTIMATORS, check_kl_placement
from loorl.models import DTYPES, check_model_reachable
from loorl.rollout.datamodule import TRUNCATED_MODES
from loorl.rollout.factory import ENGINES, VLLM_INSTALL_HINT, cuda_available, resolve_engine, vllm_installed

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
RATIO_LEVELS = ("token", "sequence")


def check_group_choices(overrides: list[str], conf_dir: Path = CONF_DIR) -> None:
    """`estimator=foo` on the command line: name the group's real options in one line.

    Hydra would report it too, but over several lines and after a stack of its own.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:
        return  # malformed syntax: Hydra reports it with the position of the error
    for ov in parsed:
        group = ov.key_or_group
        folder = conf_dir / group
        if not folder.is_dir() or ov.is_delete() or ov.value_type == ValueType.GLOB_CHOICE_SWEEP:
            continue
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else ov.value()
        values = values if isinstance(values, list) else [values]
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        for value in values:
            if str(value) not in options and value is not None:
                raise ConfigError(
                    f"unknown {group} '{value}' ({group}={value}); choose one of: {', '.join(options)}"
                )


def _number(cfg: DictConfig, key: str) -> float:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}={value!r} must be a number")
    return value


def _positive(cfg: DictConfig, *keys: str) -> None:
    for key in keys:
        if _number(cfg, key) <= 0:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be a positive number")


def _one_of(key: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(map(str, choices))}")


def check_config(cfg: DictConfig) -> None:
    """Raise ConfigError naming the setting and the fix for the first bad setting found."""
    if "data" in cfg and OmegaConf.is_missing(cfg.data, "path"):
        raise ConfigError(
            f"data.path is not set: point it at the {cfg.task.name} data (data.path=/path/to/file_or_dir)"
        )
    est = cfg.estimator.name
    if est not in estimators.names():
        raise ConfigError(
            f"unknown estimator '{est}' (estimator.name); choose one of: {', '.join(estimators.names())}"
        )
    _positive(cfg, "rl.steps", "rl.prompts_per_step", "rl.samples_per_prompt", "rl.prompts_per_minibatch")
    _positive(cfg, "rl.prompts_per_microbatch", "rl.epochs_per_rollout", "val_every")
    if _number(cfg, "val_pass_k") < 0:
        raise ConfigError(f"val_pass_k={cfg.val_pass_k} must be >= 0 (0 turns sampled pass@k off)")
    k, k_min = cfg.rl.samples_per_prompt, estimators.min_group_size(est)
    if k < k_min:
        raise ConfigError(
            f"rl.samples_per_prompt={k} is too small for estimator={est}: its baseline needs K >= {k_min} "
            f"samples per prompt; set rl.samples_per_prompt={k_min} or more"
        )
    if cfg.rl.prompts_per_step % cfg.rl.prompts_per_minibatch:
        raise ConfigError(
            f"rl.prompts_per_step={cfg.rl.prompts_per_step} is not divisible by rl.prompts_per_minibatch="
            f"{cfg.rl.prompts_per_minibatch}: mini-batches hold whole groups, pick a divisor"
        )
    r = cfg.rollout
    _one_of("rollout.engine", r.engine, ENGINES)
    _positive(cfg, "rollout.max_new_tokens", "rollout.temperature", "rollout.max_prompt_length")
    for key in ("rollout.top_p", "rollout.top_k", "loss.clip_low", "loss.clip_high", "kl.coef"):
        _number(cfg, key)
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if r.top_k < 0:
        raise ConfigError(f"rollout.top_k={r.top_k} must be >= 0 (0 turns it off)")
    _one_of("rollout.truncated", r.truncated, TRUNCATED_MODES)
    _one_of("loss.agg", cfg.loss.agg, AGGREGATIONS)
    _one_of("loss.ratio_level", cfg.loss.ratio_level, RATIO_LEVELS)
    if cfg.loss.ratio_level == "sequence" and cfg.loss.agg != "seq-mean-token-mean":
        raise ConfigError(
            f"loss.ratio_level=sequence (GSPO) with loss.agg={cfg.loss.agg}: GSPO's sequence ratio averages "
            "each sequence's tokens; set loss.agg=seq-mean-token-mean, or use experiment=gspo"
        )
    if cfg.loss.clip_low < 0 or cfg.loss.clip_high < 0:
        raise ConfigError("loss.clip_low and loss.clip_high must be >= 0")
    _one_of("kl.estimator", cfg.kl.estimator, KL_ESTIMATORS)
    if cfg.kl.coef > 0 or cfg.kl.adaptive:  # only an active KL term must have a KL gradient
        check_kl_placement(cfg.kl.estimator, bool(cfg.kl.in_reward))
    if cfg.kl.coef < 0:
        raise ConfigError(
            f"kl.coef={cfg.kl.coef} must be >= 0 (0 turns the KL term and the reference model off)"
        )
    if cfg.kl.adaptive and cfg.kl.coef <= 0:
        raise ConfigError("kl.adaptive=true needs kl.coef > 0: the controller scales it, and 0 stays 0")
    _one_of("model.dtype", cfg.model.dtype, tuple(DTYPES))
    _one_of("model.ref_dtype", cfg.model.ref_dtype, tuple(DTYPES))
    master = cfg.model.master_dtype
    if master not in ("float32", cfg.model.dtype):
        raise ConfigError(
            f"model.master_dtype={master} with model.dtype={cfg.model.dtype}: the trainable weights are "
            f"float32 (set model.master_dtype=float32) or, opting into pure low precision, model.dtype"
        )
    strategy = cfg.trainer.strategy
    if strategy != "auto":
        name = strategy.get("_target_", strategy) if isinstance(strategy, DictConfig) else strategy
        raise ConfigError(
            f"trainer.strategy={name} composes but multi-process training is not implemented yet "
            "(roadmap: scale-out); use strategy=auto"
        )
    if cfg.loss.tis_cap is not None and _number(cfg, "loss.tis_cap") <= 0:
        raise ConfigError(f"loss.tis_cap={cfg.loss.tis_cap} must be > 0, or null to turn the correction off")
    check_rewards(cfg)
    check_model_reachable(cfg.model)
    check_vllm_can_run(cfg)


def check_rewards(cfg: DictConfig) -> None:
    """Every reward function must be importable and every reward-model path set and present."""
    import importlib

    from loorl.models import looks_like_local_path

    functions = cfg.reward.functions
    if not functions:
        raise ConfigError("reward.functions is empty: name at least one reward function (see conf/reward/)")
    for name, spec in functions.items():
        key = f"reward.functions.{name}"
        if "weight" in spec:
            _number(cfg, f"{key}.weight")
        fn = spec.get("fn")
        if fn == "task":
            continue
        if not isinstance(fn, DictConfig) or "_target_" not in fn:
            raise ConfigError(f"{key}.fn must be `task` or a {{_target_: module.callable}} mapping")
        module, _, attr = str(fn._target_).rpartition(".")
        try:
            getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError):
            raise ConfigError(
                f"{key}.fn._target_={fn._target_} cannot be imported: check the module path"
            ) from None
        if "path" in fn.keys():  # `in fn` is False for a missing (???) value
            if OmegaConf.is_missing(fn, "path"):
                raise ConfigError(
                    f"{key}.fn.path is not set: point it at the reward model ({key}.fn.path=/path)"
                )
            path = str(fn.path)
            if looks_like_local_path(path) and not (Path(path).expanduser() / "config.json").exists():
                raise ConfigError(f"{key}.fn.path={path} is not a model directory (no config.json there)")
    clip = cfg.reward.get("clip")
    if clip is not None and (len(clip) != 2 or not clip[0] < clip[1]):
        raise ConfigError(f"reward.clip={list(clip)} must be [low, high] with low < high, or null")


def model_head_dim(model_cfg: DictConfig) -> int:
    if model_cfg.name_or_path is None:
        return model_cfg.tiny.hidden_size // model_cfg.tiny.num_heads
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_cfg.name_or_path)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_vllm_can_run(cfg: DictConfig) -> None:
    """vLLM requested: it must be installed, and on CPU its attention kernels must take the head size."""
    engine, _ = resolve_engine(cfg.rollout.engine)
    if engine != "vllm":
        return
    if not vllm_installed():
        raise ConfigError(f"rollout.engine={cfg.rollout.engine} needs the vllm package: {VLLM_INSTALL_HINT}")
    if cuda_available():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    head_dim = model_head_dim(cfg.model)
    if head_dim not in sizes:
        raise ConfigError(
            f"rollout.engine=vllm cannot run this model on CPU: head size {head_dim} is not one of vLLM's "
            f"CPU kernel sizes {sizes}; use rollout=hf, or a model whose hidden_size/num_heads is listed"
        )

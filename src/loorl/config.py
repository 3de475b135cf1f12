"""Checks on the composed config: every bad setting fails here, in one line, before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from loorl import resolvers
from loorl.algo import estimators
from loorl.errors import ConfigError
from loorl.estimator_inputs import check_estimator_inputs
from loorl.models.lora import check_lora
from loorl.models.sources import check_model_reachable, pretrained_path, tokenizer_at_hand
from loorl.parallel.distributed import check_world_divides
from loorl.rollout.engines.factory import EngineChoice, choose_engine
from loorl.settings import (
    EnvironmentSettings,
    EstimatorSettings,
    KLSettings,
    LossSettings,
    LRScheduleSettings,
    ModelSettings,
    RewardSettings,
    RLSettings,
    RolloutSettings,
    RunSettings,
    ToolsSettings,
    completion_budget,
)
from loorl.util.paths import CONF_DIR

resolvers.register()  # before any config under conf/ is composed or resolved


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


@dataclass(frozen=True)
class Settings:
    """Every checked section of a run's config."""

    run: RunSettings
    rl: RLSettings
    estimator: EstimatorSettings
    loss: LossSettings
    kl: KLSettings
    lr_schedule: LRScheduleSettings
    rollout: RolloutSettings
    model: ModelSettings
    reward: RewardSettings
    task: dict[str, Any]  # the task section, resolved: the Task's constructor arguments (`_target_`)
    optimizer: dict[str, Any]  # the optimizer section, resolved: a Hydra partial over the parameters
    strategy: str = "auto"  # the training strategy's kind: auto | ddp | fsdp (`strategy_kind`)
    accelerator: str = "auto"  # trainer.accelerator: cpu | gpu | auto (`loorl.util.hardware.uses_cuda`)
    tools: ToolsSettings = ToolsSettings()  # multi-turn rollouts with tools; max_turns 0: none
    environment: EnvironmentSettings = EnvironmentSettings()  # TRL's environment_factory contract
    # the rollout engine `check_config` chose (class, reason, its parsed settings); None: unchecked
    engine: EngineChoice | None = None

    @property
    def on_cuda(self) -> bool:
        """Whether the run trains on CUDA: what every device-dependent default asks."""
        from loorl.util.hardware import uses_cuda

        return uses_cuda(self.accelerator)

    @property
    def completion_tokens(self) -> int:
        """A sample's completion limit: one turn's `rollout.max_new_tokens`, or with tools the budget
        over all its turns and the results inserted between them (`tools.max_tokens`)."""
        return completion_budget(self.rollout.max_new_tokens, self.tools.max_turns, self.tools.max_tokens)


def load_settings(cfg: DictConfig) -> Settings:
    """One dataclass per section, each checking its own types, choices and rules."""
    top = {k: cfg[k] for k in RunSettings.__dataclass_fields__ if k in cfg}
    # the sections others interpolate from first, so a bad value is named where it was set
    run = RunSettings.from_cfg(top, "")
    model = ModelSettings.from_cfg(cfg.model, "model")
    rollout = RolloutSettings.from_cfg(cfg.rollout, "rollout")
    return Settings(
        run=run,
        rl=RLSettings.from_cfg(cfg.rl, "rl"),
        estimator=EstimatorSettings.from_cfg(cfg.estimator, "estimator"),
        loss=LossSettings.from_cfg(cfg.loss, "loss"),
        kl=KLSettings.from_cfg(cfg.kl, "kl"),
        lr_schedule=LRScheduleSettings.from_cfg(cfg.get("lr_schedule"), "lr_schedule"),
        rollout=rollout,
        model=model,
        reward=RewardSettings.from_cfg(cfg.reward, "reward"),
        tools=ToolsSettings.from_cfg(cfg.get("tools"), "tools"),
        environment=EnvironmentSettings.from_cfg(cfg.get("environment"), "environment"),
        task=OmegaConf.to_container(cfg.task, resolve=True),
        optimizer=OmegaConf.to_container(cfg.optimizer, resolve=True),
        strategy=strategy_kind(cfg) if "trainer" in cfg else "auto",
        accelerator=str(cfg.trainer.get("accelerator", "auto")) if "trainer" in cfg else "auto",
    )


def check_config(cfg: DictConfig) -> Settings:
    """The run's settings; raise ConfigError naming the setting and the fix for the first bad one.

    Each section checks itself (`loorl.settings`); here are only the rules that span sections and
    the checks that look outside the config (files, the hub, installed packages)."""
    if (
        "data" in cfg and "path" in cfg.data.keys() and OmegaConf.is_missing(cfg.data, "path")
    ):  # `in` skips ???
        raise ConfigError(
            f"data.path is not set: point it at the {cfg.task.name} data (data.path=/path/to/file_or_dir)"
        )
    for name, source in ((cfg.get("data") or {}).get("sources") or {}).items():  # task=mix
        if OmegaConf.is_missing(source, "path"):
            raise ConfigError(f"data.sources.{name}.path is not set: point it at the {name} data")
    try:
        s = load_settings(cfg)
    except InterpolationResolutionError as err:  # e.g. a model file without a recipe key
        raise ConfigError(f"{err.full_key}: {str(err).splitlines()[0]}") from None
    k, k_min = s.rl.samples_per_prompt, estimators.min_group_size(s.estimator.name, s.estimator.target)
    if k < k_min:
        raise ConfigError(
            f"rl.samples_per_prompt={k} is too small for estimator={s.estimator.label}: its baseline needs "
            f"K >= {k_min} samples per prompt; set rl.samples_per_prompt={k_min} or more"
        )
    if s.estimator.target is None and s.estimator.name == "rl_zvp" and s.loss.zvp_alpha is None:
        raise ConfigError(
            "estimator.name=rl_zvp with loss.zvp_alpha=null: without it RL-ZVP is GRPO; use estimator=rl_zvp "
            "(which sets loss.zvp_alpha=0.1) or set loss.zvp_alpha"
        )
    if s.loss.zvp_alpha is not None and s.rl.dynamic_sampling.enabled:
        raise ConfigError(
            f"loss.zvp_alpha={s.loss.zvp_alpha} with rl.dynamic_sampling: dynamic sampling sets aside the "
            "groups without reward spread that RL-ZVP trains on; set rl.dynamic_sampling.enabled=false or "
            "loss.zvp_alpha=null"
        )
    if s.rl.prompt_pools.enabled and s.rollout.max_staleness:
        raise ConfigError(
            f"rl.prompt_pools with rollout.max_staleness={s.rollout.max_staleness} is not supported yet (a "
            "rollout sampled ahead would be drawn from pools that its own step has not seen): set "
            "rollout.max_staleness=0 or rl.prompt_pools.enabled=false"
        )
    grow = s.rl.prompt_pools.grow_groups
    if s.rl.prompt_pools.enabled and grow > 1:
        if s.rl.dynamic_sampling.enabled:
            raise ConfigError(
                f"rl.prompt_pools.grow_groups={grow} with rl.dynamic_sampling is not supported yet (its "
                "rounds keep or set aside groups of K, not a grown prompt's): set "
                "rl.prompt_pools.grow_groups=1 or rl.dynamic_sampling.enabled=false"
            )
        if estimators.needs(s.estimator.function):
            raise ConfigError(
                f"rl.prompt_pools.grow_groups={grow} with estimator={s.estimator.label} is not supported "
                "yet (it reads a greedy baseline or reward parts per group of K): set "
                "rl.prompt_pools.grow_groups=1"
            )
    if s.rollout.temperature_schedule and s.rollout.max_staleness:
        raise ConfigError(
            f"rollout.temperature_schedule with rollout.max_staleness={s.rollout.max_staleness} is not "
            "supported yet (a sampler process samples at the temperature it was built with): set "
            "rollout.max_staleness=0 or rollout.temperature_schedule=null"
        )
    buffer, limit = s.reward.overlong.buffer, s.completion_tokens
    if buffer > limit:
        name = "tools.max_tokens" if s.tools.max_turns else "rollout.max_new_tokens"
        raise ConfigError(
            f"reward.overlong.buffer={buffer} is longer than a sample's limit ({name}={limit}): the penalty "
            f"ramps over the last `buffer` tokens of the limit; set reward.overlong.buffer={limit} or less"
        )
    check_optimizer(cfg.optimizer)
    check_rewards(cfg)
    check_estimator_inputs(s)  # what ReMax's and GDPO's inputs rule out
    check_model_reachable(s.model)
    check_lora(s.model)  # peft installed; the targets from the model's config alone (meta device)
    check_parallel(cfg, s)
    s = replace(s, engine=checked_engine(s))  # it checks its settings
    engine = s.engine.cls
    if s.environment.chosen and not s.tools.max_turns:
        raise ConfigError(
            f"{s.environment.described} needs tools.max_turns > 0: its methods are tools "
            "the policy calls between turns; set tools.max_turns (e.g. 2)"
        )
    if s.tools.max_turns:
        check_tools(s, engine)
    sampler_placement_of(s)  # rollout.devices checked against the staleness, the strategy and the cores
    return s


def checked_toolset(s: Settings, engine: type, tokenizer=None):
    """The run's `ToolSet`, once its rules hold: an engine that stops on a tool's closing tag, tools
    that import, a budget of at least one turn, and (given the tokenizer) closing tags the tokenizer
    can end a turn on. `check_tools` calls it before any model loads, `build.tool_engine` when the
    engine is built (where the tokenizer of a hub model is first at hand)."""
    from loorl.rollout.engines.wrappers.tool_engine import check_engine
    from loorl.tools.toolset import build_toolset, check_tags

    check_engine(engine, engine.name)
    budget, turn = s.completion_tokens, s.rollout.max_new_tokens  # the budget: with tools on, as here
    if budget < turn:
        raise ConfigError(
            f"tools.max_tokens={budget} is less than one turn (rollout.max_new_tokens={turn}): a sample's "
            "budget covers its turns and the results between them; set tools.max_tokens="
            f"{turn * (s.tools.max_turns + 1)}"
        )
    e = s.environment
    toolset = build_toolset(s.tools, e.chosen, route_column=e.route_column, isolation=e.isolation,
                            memory_mb=e.memory_mb, workers=e.workers)  # fmt: skip
    if tokenizer is not None:
        check_tags(tokenizer, toolset.tools, result_format=s.tools.result_format)
    return toolset


def check_tools(s: Settings, engine: type) -> None:
    """`checked_toolset` with the tokenizer where it can be had without building the model
    (`tokenizer_at_hand`; a hub model's tags are checked when the engine is built)."""
    checked_toolset(s, engine, tokenizer_at_hand(s.model))


def checked_engine(s: Settings) -> EngineChoice:
    """The engine class `rollout` names, with its own settings checked and parsed by its `check`
    (`factory.choose_engine`), before any model loads."""
    context = {"model_dtype": s.model.dtype, "model": s.model, "model_path": pretrained_path(s.model)}
    context |= {"seed": s.run.seed, "share_prompt": s.rl.share_prompt, "parallel": s.strategy}
    return choose_engine(s.rollout, cuda=s.on_cuda, **context)


def engine_choice(s: Settings) -> EngineChoice:
    """The run's rollout engine as `check_config` chose it; for settings loaded without the checks
    (`load_settings`: scripts, tests), chosen and checked now, the same way (`checked_engine`)."""
    return s.engine if s.engine is not None else checked_engine(s)


def sampler_placement_of(s: Settings):
    """Where the run's one-step-off sampler runs (`rollout.devices`): a `Placement`, or None (in the
    training process)."""
    from loorl.parallel.launch import cpu_set
    from loorl.rollout.engines.sampler_process import sampler_placement

    if engine_choice(s).cls.samples_apart:  # it samples outside the training process already (vLLM servers)
        return None
    several = s.strategy != "auto"  # ddp: one sampler per rank, placed beside it
    return sampler_placement(s.rollout.devices, max_staleness=s.rollout.max_staleness, cuda=s.on_cuda,
                             cpus=cpu_set(), several_processes=several)  # fmt: skip


STRATEGY_KINDS = {
    "lightning.pytorch.strategies.DDPStrategy": "ddp",
    "loorl.training.strategies.FSDPStrategy": "fsdp",
}


def strategy_kind(cfg: DictConfig) -> str:
    """auto | ddp | fsdp, or the strategy's own name (a Lightning registry name, a class path)."""
    strategy = cfg.trainer.strategy
    if isinstance(strategy, DictConfig):
        target = strategy.get("_target_", "")
        return STRATEGY_KINDS.get(target, target)
    return str(strategy)


def check_parallel(cfg: DictConfig, s: Settings) -> None:
    """Multi-process settings: a strategy loorl supports, whole groups per rank, shardable models."""
    kind, devices = strategy_kind(cfg), cfg.trainer.devices
    nodes = int(cfg.trainer.get("num_nodes", 1) or 1)
    if kind not in ("auto", "ddp", "fsdp"):
        raise ConfigError(f"trainer.strategy={kind} is not supported: use strategy=ddp or strategy=fsdp")
    if kind == "auto":
        if devices not in (1, "1", "auto") or nodes != 1:
            raise ConfigError(
                f"trainer.devices={devices} trainer.num_nodes={nodes} with strategy=auto: several processes "
                "need a data-parallel strategy; add strategy=ddp or strategy=fsdp"
            )
        return
    if s.rollout.max_staleness and kind == "fsdp":
        raise ConfigError(
            f"rollout.max_staleness={s.rollout.max_staleness} is not supported with strategy=fsdp yet (the "
            "rollouts sampled ahead would have to go into its sharded checkpoint): use strategy=ddp, or "
            "rollout.max_staleness=0"
        )
    if isinstance(devices, int) or str(devices).isdigit():  # "auto" / -1: known once launched (checked then)
        world, where = int(devices) * nodes, f"trainer.devices={devices} x trainer.num_nodes={nodes}"
        check_world_divides(s.rl.prompts_per_step, s.rl.prompts_per_minibatch, world, where)
    if kind == "fsdp" and not cfg.trainer.strategy.get("layer_classes"):
        cls = causal_lm_class(s.model)
        if not getattr(cls, "_no_split_modules", None):
            raise ConfigError(
                f"strategy=fsdp cannot find the layers of {cls.__name__} to shard (it names no decoder-layer "
                "class in _no_split_modules): set strategy.layer_classes=[<its decoder-layer class name>]"
            )


def causal_lm_class(model: ModelSettings) -> type:
    """The transformers class the policy will be, from its config alone (no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = pretrained_path(model)
    if path is None:
        from transformers import Qwen2ForCausalLM

        return Qwen2ForCausalLM  # the tiny model (models._tiny_policy)
    config = AutoConfig.from_pretrained(path)
    return AutoModelForCausalLM._model_mapping[type(config)]


def check_optimizer(optimizer_cfg: DictConfig) -> None:
    """Build the optimizer over one dummy parameter: its own argument checks (lr < 0, betas out of
    range) then fail here, in one line, instead of after the model has loaded."""
    import torch

    try:
        instantiate(optimizer_cfg)([torch.nn.Parameter(torch.zeros(1))])
    except Exception as err:  # noqa: BLE001 - any optimizer's own check
        cause = err.__cause__ or err
        raise ConfigError(
            f"optimizer ({optimizer_cfg.get('_target_')}): {cause}; fix the optimizer.* setting"
        ) from None


def check_rewards(cfg: DictConfig) -> None:
    """Every reward function must be importable and every reward-model path set and present."""
    import importlib

    from loorl.models.hub import looks_like_local_path

    functions = cfg.reward.functions
    if not functions:
        raise ConfigError("reward.functions is empty: name at least one reward function (see conf/reward/)")
    for name, spec in functions.items():
        key = f"reward.functions.{name}"
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ConfigError(f"{key}.weight={weight!r} must be a number")
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


def compose_config(*overrides: str, config_name: str = "train") -> DictConfig:
    """`conf/train.yaml` (or `conf/<config_name>.yaml`: `eval`) composed with command-line style
    overrides, without running Hydra's app.

    For notebooks, scripts and tests: `train(compose_config("debug=quick", "output_dir=/tmp/run"))`.
    `output_dir` must be given (its default, Hydra's run dir, exists only under `@hydra.main`).
    """
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name, overrides=list(overrides))

"""One run builder: from the checked settings to the pieces of a run.

`build_run(settings)` returns the task, the policy's files and tokenizer, the environment (the
`RolloutDataModule` with its rollout engine and reward functions) and the learner (the
`PolicyGradientModule`), in the order each needs the one before: settings -> task -> model path
(building or converting the model on its first use) -> tokenizer -> engine -> DataModule -> module.
`src/train.py`, `src/eval.py` and the scripts all build through it; the Lightning `Trainer`, its
loggers and callbacks stay with the command that runs them (`loorl.cli`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from loorl.config import Settings, checked_toolset, engine_choice, load_settings, sampler_placement_of
from loorl.errors import ConfigError
from loorl.models.load import load_tokenizer
from loorl.models.sources import model_identity, resolve_model_path
from loorl.rewards import build_composer
from loorl.rollout.datamodule import RolloutDataModule
from loorl.rollout.engines.factory import build_engine
from loorl.rollout.engines.wrappers.process_engine import ProcessEngine
from loorl.tasks.base import Task
from loorl.training.checkpoints import run_identity
from loorl.training.module import PolicyGradientModule

log = logging.getLogger(__name__)


@dataclass
class RunParts:
    settings: Settings
    task: Task
    model_path: str  # the policy's directory (or hub id)
    tokenizer: Any
    datamodule: RolloutDataModule  # the environment: task, engine, rewards
    module: PolicyGradientModule  # the learner: policy, reference, estimator, loss

    @property
    def engine(self):
        return self.datamodule.engine


def as_settings(cfg_or_settings: Settings | DictConfig) -> Settings:
    """Settings as they are, or loaded (unchecked: `loorl.config.check_config` checks) from a config,
    with the engine `rollout` names chosen once (`engine_choice`)."""
    if isinstance(cfg_or_settings, Settings):
        return cfg_or_settings
    s = load_settings(cfg_or_settings)
    return replace(s, engine=engine_choice(s))


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


def build_task(s: Settings) -> Task:
    """The run's task, with the environment's tools for its chat-template prompts (`prompt_tools`)."""
    task = instantiate_unwrapped(s.task)
    task.prompt_tools, task.route_column = prompt_tools(s), s.environment.route_column
    return task


def prompt_tools(s: Settings) -> list[dict] | dict[str, list[dict]] | None:
    """The tools' JSON schemas every chat-template prompt carries as `tools=`, as TRL renders them
    (`environment.tools_in_prompt`): the environment's, or each route's by name (a prompt carries its
    row's, `Task.tools_for`); None without one or with the setting off."""
    if not (s.environment.chosen and s.environment.tools_in_prompt):
        return None
    from loorl.tools.environment import Environment

    def tools(target: str) -> list[dict]:
        return Environment.of(target, timeout_s=s.tools.timeout_s, max_result_chars=s.tools.max_result_chars,
                              isolation="thread").tools()  # fmt: skip

    if s.environment.target:
        return tools(s.environment.target)
    return {name: tools(target) for name, target in s.environment.routes.items()}


def identity(s: Settings) -> dict:
    """What every checkpoint of this run records and a resume checks (`training.checkpoints`)."""
    return run_identity(s, model=model_identity(s.model, s.task), strategy=s.strategy)


def build_rollout_engine(s: Settings, tokenizer, model_path: str):
    """The run's rollout engine as the settings choose it, before tools or a sampler process wrap it
    (`build_datamodule`; scripts/bench/bench_engines.py times it alone)."""
    return build_engine(
        s.rollout,
        tokenizer,
        model_path=model_path,
        model_dtype=s.model.dtype,
        seed=s.run.seed,
        share_prompt=s.rl.share_prompt,
        cuda=s.on_cuda,
        completion_tokens=s.completion_tokens,
        model=s.model,
        choice=engine_choice(s),
    )


def build_datamodule(
    cfg_or_settings, task: Task, tokenizer, model_path: str, **evaluation
) -> RolloutDataModule:
    """The environment side: the task, the rollout engine and the reward functions. `evaluation`:
    the DataModule's eval_samples, eval_split and eval_limit (src/eval.py)."""
    s = as_settings(cfg_or_settings)
    engine = build_rollout_engine(s, tokenizer, model_path)
    # multi-turn rollouts: tools run between turns (in the sampler process, one step off)
    if s.tools.max_turns:
        engine = tool_engine(engine, s, tokenizer)
    placement = sampler_placement_of(s)
    if placement is not None:  # one step off, sampled in a process of its own while the trainer trains
        engine = ProcessEngine(engine, placement)
    return RolloutDataModule(
        task=task,
        tokenizer=tokenizer,
        engine=engine,
        rl=s.rl,
        rollout=s.rollout,
        rewards=build_composer(s.reward, task),
        seed=s.run.seed,
        pass_k=s.run.val_pass_k,
        estimator=s.estimator.function,  # dynamic sampling's judge of which groups have signal
        overlong=s.reward.overlong,
        completion_tokens=s.completion_tokens,  # the overlong penalty's limit (the tools budget)
        **evaluation,
    )


def tool_engine(engine, s: Settings, tokenizer):
    """The run's engine wrapped to generate in turns with the tools of `tools.available`."""
    from loorl.rollout.engines.wrappers.tool_engine import ToolEngine
    from loorl.tools.toolset import insertion

    toolset = checked_toolset(s, type(engine), tokenizer)
    toolset.template_ids, how = insertion(tokenizer, s.tools.insert)
    budget = s.completion_tokens
    names = ", ".join(f"{t.name} ({t.start}...{t.end})" for t in toolset.tools)
    tools = ToolEngine(engine, toolset, tokenizer, max_turns=s.tools.max_turns, max_tokens=budget,
                       workers=s.tools.workers, keep_cache=s.tools.keep_cache)  # fmt: skip
    later = "continue from the engine's kept cache" if tools.keep_cache else "prefill the transcript again"
    log.info("tools: %s; up to %d calls and %d completion tokens per sample; %s; later turns %s", names,
             s.tools.max_turns, budget, how, later)  # fmt: skip
    return tools


def build_module(cfg_or_settings, model_path: str) -> PolicyGradientModule:
    """The learner: policy, reference, optimizer, loss, KL and estimator settings."""
    s = as_settings(cfg_or_settings)
    return PolicyGradientModule(
        model_path=model_path,
        model=s.model,
        optimizer=instantiate(s.optimizer),
        rl=s.rl,
        lr_schedule=s.lr_schedule,
        loss=s.loss,
        kl=s.kl,
        estimator=s.estimator,
        sampling=s.rollout.sampling,
        seed=s.run.seed,
        sampler_logprobs_match_trainer=engine_choice(s).cls.logprobs_match_trainer(s.model.dtype),
        identity=identity(s),
    )


def build_run(s: Settings, *, task: Task | None = None, **evaluation) -> RunParts:
    """Every piece of a run, built in order; `task`: one already built (to log its facts first)."""
    task = task or build_task(s)
    model_path = resolve_model_path(s.model, s.task, task)
    tokenizer = load_tokenizer(model_path)
    datamodule = build_datamodule(s, task, tokenizer, model_path, **evaluation)
    module = build_module(s, model_path)
    return RunParts(s, task, model_path, tokenizer, datamodule, module)

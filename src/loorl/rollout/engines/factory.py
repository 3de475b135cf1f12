"""Which engine class a run uses, and building it: `rollout._target_` (any RolloutEngine subclass) or
the built-in that `rollout.engine` names (hf | vllm | vllm_server | auto).

The choice is made once, by `loorl.config.check_config` (`choose_engine`: the class, why, and the
settings its `check` parsed), and read by everything after it: the build, the sampler placement and
`build_engine`, which logs it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from loorl.errors import ConfigError
from loorl.rollout.engines.base import EngineContext, RolloutEngine
from loorl.rollout.engines.vllm_engine import VLLM_INSTALL_HINT, vllm_installed
from loorl.settings import RolloutSettings
from loorl.util.hardware import cuda_available
from loorl.util.plugins import import_object

log = logging.getLogger(__name__)

BUILT_IN_ENGINES = {  # rollout.engine -> class; any other engine is named by rollout._target_
    "hf": "loorl.rollout.engines.hf_engine.HFEngine",
    "vllm": "loorl.rollout.engines.vllm_engine.VLLMEngine",
    "vllm_server": "loorl.rollout.engines.vllm_server.ServerEngine",
}


def resolve_engine(name: str, *, cuda: bool | None = None) -> tuple[str, str]:
    """The built-in engine that will run and why, for `rollout.engine` = hf | vllm | auto. `cuda`:
    whether the run trains on CUDA (`Settings.on_cuda`; None: whether a CUDA device is available)."""
    if name != "auto":
        return name, f"rollout.engine={name}"
    if not (cuda_available() if cuda is None else cuda):
        return "hf", (
            "rollout=auto: training on the CPU, where the HF engine is faster (SmolLM2's rollout: 294 "
            "tokens/s against vLLM-CPU's 263; no start-up, no weight copy: docs/performance/generation.md)"
        )
    if not vllm_installed():
        return "hf", f"rollout=auto: vllm is not installed ({VLLM_INSTALL_HINT})"
    return "vllm", "rollout=auto: CUDA and vllm are present"


def engine_class(rollout: RolloutSettings, *, cuda: bool | None = None) -> tuple[type[RolloutEngine], str]:
    """The engine class of the run and why it was chosen (`cuda`: as `resolve_engine`)."""
    if rollout.target is not None:
        cls, reason = import_object(rollout.target, "rollout._target_"), f"rollout._target_={rollout.target}"
        if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
            raise ConfigError(
                f"rollout._target_={rollout.target} is not a RolloutEngine subclass: derive it from "
                "loorl.rollout.engines.base.RolloutEngine"
            )
        return cls, reason
    name, reason = resolve_engine(rollout.engine, cuda=cuda)
    return import_object(BUILT_IN_ENGINES[name], "rollout.engine"), reason


@dataclass(frozen=True)
class EngineChoice:
    """The run's engine: its class, why it was chosen (logged once, when it is built), and its own
    settings as its `check` parsed them (`ServerEngine`: a `ServerSettings`; None for an engine that
    returns none), handed to its `create` through `EngineContext.settings`."""

    cls: type[RolloutEngine]
    reason: str
    settings: Any = None


def choose_engine(rollout: RolloutSettings, *, cuda: bool | None = None, **context) -> EngineChoice:
    """The engine class of the run (`engine_class`; `cuda`: as `resolve_engine`) and its settings,
    checked and parsed by its `check` before any model loads (`context`: the `EngineContext` fields it
    is given)."""
    cls, reason = engine_class(rollout, cuda=cuda)
    return EngineChoice(cls, reason, cls.check(EngineContext(rollout, **context)))


def build_engine(
    rollout: RolloutSettings,
    tokenizer,
    *,
    model_path: str,
    model_dtype: str = "float32",
    seed: int,
    share_prompt: bool = True,
    cuda: bool | None = None,
    completion_tokens: int | None = None,
    model=None,
    choice: EngineChoice,
) -> RolloutEngine:
    """The engine, unbuilt where building is costly (vLLM starts at the first sync). `cuda`: whether
    the run trains on CUDA (None: whether a device is available). `completion_tokens`: a sample's
    budget over all its turns, where tools are on (None: `rollout.max_new_tokens`). `choice`: the
    engine `check_config` chose (`choose_engine`; `loorl.config.engine_choice` for
    settings loaded without the checks)."""
    log.info("rollout engine: %s (%s)", choice.cls.name, choice.reason)
    ctx = EngineContext(rollout, model_dtype=model_dtype, model_path=model_path, tokenizer=tokenizer,
                        seed=seed, share_prompt=share_prompt, cuda=cuda,
                        completion_tokens=completion_tokens, model=model,
                        settings=choice.settings)  # fmt: skip
    return choice.cls.create(ctx)

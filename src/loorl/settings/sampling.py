"""The sections of sampling: `rollout` (the engine and its sampler), `tools` and `environment` (what the
policy may call mid-answer), and a sample's completion budget that they set together."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field
from pydantic.dataclasses import dataclass

from loorl.errors import ConfigError
from loorl.settings.base import (
    ENGINES,
    SCHEMA,
    Fraction,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    TruncatedMode,
)
from loorl.types import SamplingConfig


@dataclass(frozen=True, config=SCHEMA)
class RolloutSettings(Section):
    """`rollout`: the engine, its sampler and the rollout's limits. The engine's own settings (`vllm`,
    `hf_attention`, `hf_decode`, a plug-in's `options`) are checked by the engine class
    (`loorl.rollout.engines.base`)."""

    engine: str = "auto"  # hf | vllm | vllm_server | auto; ignored when `_target_` names an engine class
    target: str | None = None  # `_target_` in YAML: package.module.Class, a RolloutEngine subclass
    max_new_tokens: PositiveInt = 16
    temperature: PositiveFloat = 1.0
    # later temperatures by RL step: {20: 0.9, 40: 1.1} (the step a rollout trains at -> its temperature)
    temperature_schedule: dict[int, PositiveFloat] | None = None
    temperature_ramp: Literal["step", "linear"] = "step"  # step: stages | linear: between the anchors
    top_p: Fraction = 1.0
    top_k: NonNegativeInt = 0  # 0: off
    truncated: TruncatedMode = "score"
    max_prompt_length: PositiveInt = 256
    batch_size: PositiveInt = 512
    eval_batch_size: PositiveInt = 256
    hf_attention: str = "auto"  # the HF engine's attention (its choices: loorl.rollout.engines.hf_engine)
    hf_decode: str = "auto"  # the HF engine's key/value cache and compiling (loorl.rollout.engines.hf_engine)
    vllm: dict[str, Any] | None = None  # the vLLM engine's block (rollout=hf has none)
    server: dict[str, Any] | None = None  # the vLLM server engine's block (rollout=vllm_server)
    options: dict[str, Any] = Field(default_factory=dict)  # a `_target_` engine's own settings
    max_staleness: NonNegativeInt = 0  # N: step t+N is sampled with step t's weights (1: one step off)
    devices: str = "auto"  # the one-step-off sampler's place: auto | trainer | cpu:<cores> | cuda:<gpu>

    def __post_init__(self) -> None:
        if any(step < 1 for step in self.temperature_schedule or {}):
            raise ConfigError(
                f"rollout.temperature_schedule has step {min(self.temperature_schedule)}: its steps start at "
                "1 (step 0 samples at rollout.temperature)"
            )
        if self.target is None and self.engine not in ENGINES:
            raise ConfigError(
                f"unknown rollout.engine '{self.engine}'; choose one of: {', '.join(ENGINES)} "
                "(or rollout._target_=<package.module.Class> for your own RolloutEngine)"
            )

    def temperature_at(self, step: int) -> float:
        """The sampling temperature of the rollout RL step `step` trains on: `temperature` from step 0, then
        `temperature_schedule`'s anchors, held until the next one (`temperature_ramp=step`, Polaris'
        stages) or interpolated linearly between them (`linear`; the last one held)."""
        anchors = sorted({0: self.temperature, **(self.temperature_schedule or {})}.items())
        before = [(s, t) for s, t in anchors if s <= step][-1]
        after = next(((s, t) for s, t in anchors if s > step), None)
        if self.temperature_ramp == "step" or after is None:
            return float(before[1])
        (s0, t0), (s1, t1) = before, after
        return float(t0 + (t1 - t0) * (step - s0) / (s1 - s0))

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )


ToolInsert = Literal["auto", "text", "template"]
TOOL_INSERTS = get_args(ToolInsert)


@dataclass(frozen=True, config=SCHEMA)
class ToolsSettings(Section):
    """`tools`: multi-turn rollouts with tools (`loorl.rollout.multi_turn`, `loorl.tools`). Each entry
    of `available` is `{_target_: a class or function, start: the call's opening tag, end: its closing
    tag, ...the class's keyword arguments}` (`loorl.tools.toolset.build_toolset` checks them)."""

    max_turns: NonNegativeInt = 0  # tool calls per sample at most; 0: one turn, exactly the run without tools
    max_tokens: PositiveInt | None = None  # completion tokens per sample, generated and inserted; None:
    # rollout.max_new_tokens x (max_turns + 1)
    timeout_s: PositiveFloat = 5.0  # wall seconds per call; then its result is an error
    max_result_chars: PositiveInt = 200  # a longer result is cut, with a marker
    result_format: str = " <result>{result}</result>"  # a result as text in the transcript
    insert: ToolInsert = "auto"  # text: result_format | template: the chat template's tool message | auto
    workers: PositiveInt = 2  # calls run at the same time (threads; the Python tool's sandbox processes)
    keep_cache: bool = True  # the HF engine continues a sample from its key/value cache of the last turn
    # (rollout.hf_decode dynamic); false: it prefills the whole transcript again each turn (the same ids)
    available: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def __post_init__(self) -> None:
        if "{result}" not in self.result_format:
            raise ConfigError(
                f"tools.result_format={self.result_format!r} has no {{result}}: write where the result goes, "
                "e.g. '<result>{result}</result>'"
            )


EnvironmentIsolation = Literal["process", "thread"]


@dataclass(frozen=True, config=SCHEMA)
class EnvironmentSettings(Section):
    """`environment`: a class written to TRL's `environment_factory` contract, its public methods the
    policy's tools (`loorl.tools.environment`; its calls run under `tools.*`'s limits)."""

    target: str | None = None  # `_target_` in YAML: the class (mypkg.MyEnv); None: no environment
    isolation: EnvironmentIsolation = "process"  # process: each sample's instance in a worker process,
    # killed on a timeout, exit, crash or memory overrun (the run goes on) | thread: in the training
    # process, as TRL (a hang keeps its thread, an exit or crash ends the run)
    memory_mb: PositiveInt = 1024  # isolation process: what each worker may map beyond its imports
    workers: PositiveInt | None = None  # isolation process: worker processes at most; None: one per sample
    # in flight (no sample shares a worker), kept and reused across steps
    tools_in_prompt: bool = True  # as TRL: every prompt a task renders with a chat template gets the
    # tools' schemas as `tools=` (`Task.prompt_tools`); plain-text prompts (no chat template: the tiny
    # model) are unchanged; false: no tools in the prompt (describe them in task.system_prompt)
    routes: dict[str, str] = Field(default_factory=dict)  # several environments by name (TRL's dict
    # environment_factory): each prompt's row names its own in the column `route_column`
    route_column: str = "environment"  # the row's column that names its environment (TRL's field)

    def __post_init__(self) -> None:
        if self.target and self.routes:
            raise ConfigError(
                f"environment._target_={self.target} and environment.routes are both set: name one class, "
                "or several by name in routes (environment._target_=null)"
            )

    @property
    def chosen(self) -> str | dict[str, str] | None:
        """The environment class, or the routes' classes by name; None: no environment."""
        return self.target or dict(self.routes) or None

    @property
    def described(self) -> str:
        """How the run's error messages name it."""
        return f"environment._target_={self.target}" if self.target else "environment.routes"


def completion_budget(max_new_tokens: int, max_turns: int, max_tokens: int | None) -> int:
    """A sample's completion limit: one turn's `rollout.max_new_tokens` without tools; with tools,
    `tools.max_tokens` over all its turns and the results between them, or one turn's limit per
    possible turn (`Settings.completion_tokens`, and `loss.max_len`'s default by the resolver
    `loorl.completion_tokens`)."""
    if max_turns <= 0:  # no tools (a negative count is refused by tools.max_turns' own check, by name)
        return max_new_tokens
    return max_tokens if max_tokens is not None else max_new_tokens * (max_turns + 1)

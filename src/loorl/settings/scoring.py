"""The sections of scoring: `reward` (the weighted reward functions, the clip, the overlong penalty) and
`eval` (what `src/eval.py` measures)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from loorl.errors import ConfigError
from loorl.settings.base import SCHEMA, NonNegativeFloat, NonNegativeInt, PositiveInt, Section


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

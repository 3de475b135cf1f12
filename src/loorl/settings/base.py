"""The schema's building blocks: the constrained number types, the choices of every enumerated setting,
and `Section` (a section built from the config, a bad value one `ConfigError` line)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar, get_args

from omegaconf import DictConfig, OmegaConf
from pydantic import ConfigDict, Field, ValidationError

from loorl.algo.kl import KL_ESTIMATORS as KL_ESTIMATORS
from loorl.algo.objectives import (
    AGGREGATIONS as AGGREGATIONS,  # re-exported: every setting's choices in one place
)
from loorl.algo.objectives import IS_MODES as IS_MODES
from loorl.algo.objectives import RATIO_LEVELS as RATIO_LEVELS
from loorl.errors import ConfigError

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
Engine = Literal["hf", "vllm", "vllm_server", "auto"]
DTYPES, TRUNCATED_MODES, ENGINES = get_args(Dtype), get_args(TruncatedMode), get_args(Engine)

SCHEMA = ConfigDict(extra="forbid")  # an unknown key is a typo, not a setting
# Keys renamed in a section, old: new; the old spelling gets a one-line error naming the new one
RENAMED = {"kv_cache_memory_gb": "kv_cache_memory_gib"}  # it always held GiB (issue 79: one unit)
T = TypeVar("T")


def _one_line(err: ValidationError, section: str) -> str:
    """The first validation error as `section.key=value: reason`."""
    first = err.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # raised by a __post_init__ rule: already one full line
        return str(cause)
    key = ".".join(str(part) for part in (section, *first["loc"]) if part != "")
    key = key.replace(".target", "._target_")  # the YAML spelling of the field
    if first["type"] == "unexpected_keyword_argument" and str(first["loc"][-1]) in RENAMED:
        new = f"{key.rsplit('.', 1)[0]}.{RENAMED[str(first['loc'][-1])]}"
        return f"{key} is now called {new} (the same value, in GiB): set {new}={first.get('input')!r}"
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

"""`task=reasoning_gym`'s settings, checked before any problem is generated: each dataset's entry
(`Source`), `task.curriculum`, `task.eval_levels` and `task.curriculum.fixed_levels`. Every bad value
is a one-line `ConfigError` naming the setting and the fix. reasoning-gym is imported only here and in
`loorl.tasks.reasoning_gym`, when the task is built.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loorl.errors import ConfigError

INSTALL = 'pip install -e ".[reasoning-gym]"'
DATASET_KEYS = ("weight", "level", "config")
CURRICULUM_KEYS = ("enabled", "window", "raise_above", "lower_below", "range_mode", "fixed_levels")
CURRICULUM_DEFAULTS = {"enabled": False, "window": 64, "raise_above": 0.8, "lower_below": None,
                       "range_mode": "inclusive", "fixed_levels": None}  # fmt: skip


def import_reasoning_gym():
    """The `reasoning_gym` module, or a one-line error naming the install command."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise ConfigError(f"task=reasoning_gym needs the reasoning-gym package: {INSTALL}") from err
    return reasoning_gym


@dataclass(frozen=True)
class Source:
    """One dataset of the mixture as configured."""

    name: str
    weight: float
    level: int | None  # the curriculum's starting level; None: `config` alone sets the difficulty
    config: dict


def max_level(name: str) -> int:
    """The highest global level of a reasoning-gym dataset's curriculum."""
    from reasoning_gym.factory import create_curriculum

    return max(len(a.levels) for a in create_curriculum(name).attributes.values()) - 1


def ruled_fields(curriculum) -> set[str]:
    """The config fields a reasoning-gym curriculum sets from its level."""
    out = set()
    for attr in curriculum.attributes.values():
        names = (getattr(attr, "lower_field_name", None), getattr(attr, "upper_field_name", None),
                 getattr(attr, "field_name", None))  # fmt: skip
        out |= {n for n in names if n}
    return out


def curriculum_settings(curriculum: Mapping | None) -> dict:
    """`task.curriculum` with its defaults, its keys and range mode checked."""
    from reasoning_gym.coaching.base_curriculum import RangeAttributeMode

    cur = {**CURRICULUM_DEFAULTS, **dict(curriculum or {})}
    unknown = set(cur) - set(CURRICULUM_KEYS)
    if unknown:
        raise ConfigError(f"task.curriculum.{sorted(unknown)[0]} is not a curriculum setting")
    modes = [m.value for m in RangeAttributeMode]
    if cur["range_mode"] not in modes:
        raise ConfigError(
            f"task.curriculum.range_mode={cur['range_mode']!r} is not one of: {', '.join(modes)}"
        )
    return cur


def parse_source(name: str, spec) -> Source:
    """`task.datasets.<name>` checked against reasoning-gym's datasets, their configs and curricula."""
    from reasoning_gym.factory import CURRICULA, DATASETS

    spec = dict(spec or {})
    if name not in DATASETS:
        close = difflib.get_close_matches(name, list(DATASETS), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"task.datasets.{name} is not a reasoning-gym dataset{hint}")
    unknown = set(spec) - set(DATASET_KEYS)
    if unknown:
        raise ConfigError(f"task.datasets.{name}.{sorted(unknown)[0]} is not a dataset setting "
                          f"({', '.join(DATASET_KEYS)})")  # fmt: skip
    weight, level, config = float(spec.get("weight", 1.0)), spec.get("level"), dict(spec.get("config") or {})
    if not weight > 0:
        raise ConfigError(f"task.datasets.{name}.weight={weight} must be positive")
    config_cls = DATASETS[name][1]
    fields = set(config_cls.__dataclass_fields__)
    for key in config:
        if key not in fields or key in ("seed", "size"):
            raise ConfigError(
                f"task.datasets.{name}.config.{key} is not a setting of {config_cls.__name__} "
                f"(seed and size are loorl's): {', '.join(sorted(fields - {'seed', 'size'}))}"
            )
    if level is not None:
        if name not in CURRICULA:
            raise ConfigError(
                f"task.datasets.{name}.level={level}: {name} has no reasoning-gym curriculum: "
                "set level: null and its difficulty in config"
            )
        clash = sorted(set(config) & ruled_fields(CURRICULA[name]()))
        if clash:
            raise ConfigError(
                f"task.datasets.{name}.config.{clash[0]} is set by the curriculum level "
                f"(task.datasets.{name}.level); drop it, or set level: null to set it by hand"
            )
        level = int(level)
    return Source(name, weight, level, config)


def parse_eval_levels(eval_levels, leveled: dict[str, int]) -> list[int]:
    """`task.eval_levels` checked: distinct levels in order; [] for null."""
    if eval_levels is None:
        return []
    if isinstance(eval_levels, str) or not isinstance(eval_levels, Sequence):
        raise ConfigError(
            f"task.eval_levels={eval_levels!r} is not a list of levels: give one such as [1, 2], or null"
        )
    bad = [v for v in eval_levels if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise ConfigError(
            f"task.eval_levels has {bad[0]!r}: levels are whole numbers from 0 (reasoning-gym's global "
            "levels), such as [1, 2]"
        )
    if eval_levels and not leveled:
        raise ConfigError(
            "task.eval_levels adds held-out sets at other levels, and no dataset of task.datasets has "
            "a level: give a dataset a starting level (task.datasets.<name>.level=0) or set it to null"
        )
    return sorted(set(eval_levels))


def parse_fixed_levels(fixed, leveled: dict[str, int], *, enabled: bool) -> dict[str, int]:
    """`task.curriculum.fixed_levels` checked: dataset -> the level it trains at throughout."""
    if not fixed:
        return {}
    key = "task.curriculum.fixed_levels"
    if not isinstance(fixed, Mapping):
        raise ConfigError(f"{key}={fixed!r} is not a mapping: give one such as {{chain_sum: 1}}, or null")
    if enabled:
        raise ConfigError(
            f"{key} holds training levels fixed, and the curriculum moves them: set "
            "task.curriculum.enabled=false, or fixed_levels: null"
        )
    out = {}
    for name, level in fixed.items():
        if name not in leveled:
            raise ConfigError(
                f"{key}.{name}: not a dataset of task.datasets with a level (task.datasets.{name}.level)"
            )
        top = max_level(name)
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= top:
            raise ConfigError(f"{key}.{name}={level!r}: a level from 0 to {name}'s highest, {top}")
        out[name] = level
    return out
